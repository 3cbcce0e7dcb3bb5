"""Where the gateway's CPU goes under the benchmark's load: py-spy per wire format and mode.

    python -m benchmarks.gateway.profile [--rate 200] [--duration 8] [--formats chat,responses,messages]
        [--pin CPU] [--out benchmarks/gateway/results/profile-<UTC time>.txt]
    python -m benchmarks.gateway.profile --rate 0 --pin 1    # at saturation, pinned as in the benchmark

Starts the benchmark's fixed-reply upstream and a gateway capturing into a fresh PostgreSQL
database (redaction at its default), then, for each wire format, whole and streamed, sends
``--rate`` requests/s (``--rate 0``: as fast as ``--concurrency`` clients can, the benchmark's
saturation rows) for ``--duration`` seconds while ``py-spy record --threads --gil`` samples the
gateway. Each sample is put in one of two parts: the **capture writer** (any stack through
datapool/, the spool, redaction or the writer's coroutine) and the **request path** (the rest of
the event loop's thread). Per part it prints the share of the samples and the top frames by own
time and by time including callees, as text (the flame graph's widest frames), and writes the
same to ``--out``. Only the thread holding the GIL is sampled: on the one core the gateway is
pinned to, that is where its CPU goes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gateway.__main__ import CLIENT_KEY, Proc, _pg_and_redis, _pinned, _wait_http, load  # noqa: E402
from tests.support.processes import GatewayProcess, free_port  # noqa: E402

PY_SPY = Path(sys.executable).with_name("py-spy")
# a stack through any of these is the capture writer's work, wherever it runs
WRITER_MARKS = ("datapool/", "capture.py", "redact", "token_mask", "sqlalchemy", "psycopg", "kombu", "celery",
                "opentelemetry")
LINE = re.compile(r":\d+\)$")


def _part(stack: list[str]) -> str:
    joined = ";".join(stack)
    return "capture writer" if any(m in joined for m in WRITER_MARKS) else "request path"


def summarise(collapsed: str, top: int = 25) -> str:
    """py-spy's raw (collapsed) output as text: per part, its share and its widest frames."""
    own: dict[str, Counter[str]] = {}
    total: dict[str, Counter[str]] = {}
    samples: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        frames = [LINE.sub(")", f) for f in stack_text.split(";") if not f.startswith(("process ", "thread "))]
        n = int(count_text)
        part = _part(frames)
        samples[part] += n
        if frames:
            own.setdefault(part, Counter())[frames[-1]] += n
        for f in set(frames):
            total.setdefault(part, Counter())[f] += n
    busy = sum(samples.values()) or 1
    out = [f"samples holding the GIL: {busy} ({dict(samples)})"]
    for part in ("request path", "capture writer"):
        if not samples[part]:
            continue
        out.append(f"\n  {part}: {samples[part] / busy:.0%} of the samples holding the GIL")
        out.append("    own time (leaf frames):")
        out += [f"      {n / busy:6.1%}  {f}" for f, n in own[part].most_common(top)]
        out.append("    with callees:")
        # the frames every stack of the part passes through (runpy, click, the loop) say nothing
        wide = [(f, n) for f, n in total[part].most_common() if n < 0.9 * samples[part]]
        out += [f"      {n / busy:6.1%}  {f}" for f, n in wide[:top]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200, help="open-loop rate, requests/s; 0: saturation (closed loop)")
    ap.add_argument("--concurrency", type=int, default=64, help="clients at saturation (--rate 0)")
    ap.add_argument("--pin", type=int, help="pin the gateway to this CPU and the load to the others, as the benchmark "
                                            "does (default: not pinned)")
    ap.add_argument("--duration", type=float, default=8, help="seconds per format and mode")
    ap.add_argument("--formats", default="chat,responses,messages")
    ap.add_argument("--sampling-rate", type=int, default=400, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25, help="frames listed per part")
    ap.add_argument("--out", type=Path, help="text file (default results/profile-<UTC time>.txt)")
    args = ap.parse_args()
    if not PY_SPY.exists():
        sys.exit(f"{PY_SPY} missing: pip install py-spy")
    work = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    sections = []
    with ExitStack() as stack:
        port = free_port()
        upstream = Proc([sys.executable, "-m", "tests.support.upstream", "--port", str(port)],
                        work / "upstream.log", {"PYTHONPATH": str(ROOT)})
        stack.callback(upstream.stop)
        upstream_url = f"http://127.0.0.1:{port}/v1"
        _wait_http(f"{upstream_url}/models", upstream, 30, "upstream")
        database_url, broker = _pg_and_redis(stack)
        gw = GatewayProcess(work / "gw", database_url=database_url, upstream_url=upstream_url,
                            env={"NEXTSTATE_BROKER_URL": broker, "NEXTSTATE_API_KEYS": CLIENT_KEY,
                                 "PYTHONPATH": str(ROOT)})
        if args.pin is not None:
            gw.args = _pinned(args.pin, gw.args)
        gw.start()
        stack.callback(gw.stop)
        others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != args.pin) or None
        formats = list(filter(None, args.formats.split(",")))
        for fmt in formats:  # LiteLLM's translators are imported at the first Responses or Messages request
            load(gw.base_url, stream=False, fmt=fmt, requests=1, concurrency=1, latencies=False, warmup=0)
        for fmt in formats:
            for stream in (False, True):
                name = f"{fmt} {'streamed' if stream else 'whole'}"
                raw = work / f"{fmt}-{int(stream)}.txt"
                spy = subprocess.Popen([str(PY_SPY), "record", "--pid", str(gw.proc.pid), "--format", "raw",  # type: ignore[union-attr]
                                        "--threads", "--gil", "--rate", str(args.sampling_rate),
                                        "--duration", str(int(args.duration)), "--output", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                r = load(gw.base_url, stream=stream, rate=args.rate or None, duration=args.duration, fmt=fmt,
                         warmup=0, concurrency=args.concurrency, latencies=False,
                         cpu=others if args.pin is not None else None)  # type: ignore[arg-type]
                rate = f"{args.rate:.0f} RPS" if args.rate else f"saturation ({r['ok'] / r['elapsed_s']:.0f} RPS)"
                spy.wait(60)
                text = summarise(raw.read_text() if raw.exists() else "", args.top)
                sections.append(f"## {name}: {r['ok']} ok, errors {r['errors'] or 0} at {rate}\n{text}\n")
                print(sections[-1], flush=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "benchmarks" / "gateway" / "results" / f"profile-{stamp}.txt"
    out.write_text(f"python -m benchmarks.gateway.profile {' '.join(sys.argv[1:])}\n\n" + "\n".join(sections))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
