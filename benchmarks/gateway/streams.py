"""Long streams through several gateways at once: does any request fail, and how?

    python -m benchmarks.gateway.streams [--duration 240] [--concurrency 200] [--gateways 2]
        [--upstream http://127.0.0.1:8501/v1] [--chunks 48 --chunk-delay-s 0.13]

It starts --gateways `nextstate gateway` processes on one SQLite pool (as the GPU runs do:
benchmarks/gpu/shape2.py, publish_load.py) and --concurrency workers that each stream chat
completions through them in turn with httpx (one client, keep-alive, as those runs' load),
until --duration has passed. The upstream is the fast fake (tests/support/upstream.py: --chunks
tokens, --chunk-delay-s apart) or, with --upstream, a real vLLM. Every failure is classified:
an HTTP status, a stream without ``[DONE]``, an error event, or an httpx exception (with how
many lines had arrived and after how long). Prints a table and the first failures; exits 1 if
any request failed.

Why: the GPU runs saw 6 of ~9,500 streams end in ``httpx.ReadError`` with an empty message,
outside every weight push (benchmarks/gpu/results/README.md). This reproduces their shape
so that the cause can be looked for, on the GPU machine with --upstream pointing at vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.upstream import UpstreamProcess  # noqa: E402
from tests.support.processes import GatewayProcess  # noqa: E402


class Streams:
    def __init__(self, args: argparse.Namespace, gateways: list[str]):
        self.args, self.gateways = args, gateways
        self.ok: list[float] = []
        self.failures: collections.Counter[str] = collections.Counter()
        self.details: list[str] = []
        self.t0 = time.monotonic()

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        self.details.append(f"{time.monotonic() - self.t0:7.1f}s {kind}: {detail}")

    async def one(self, http: httpx.AsyncClient, worker: int, i: int) -> None:
        a = self.args
        gateway = self.gateways[(worker + i) % len(self.gateways)]
        body: dict[str, Any] = {"model": a.model, "stream": True, "max_tokens": a.chunks, "temperature": 0.7,
                                "messages": [{"role": "user", "content": f"Tell me about the number {worker}-{i}."}]}
        if not a.upstream:
            body |= {"fake_chunks": a.chunks, "fake_chunk_delay_s": a.chunk_delay_s}
        lines, started = 0, time.monotonic()
        try:
            async with http.stream("POST", f"{gateway}/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.fail(f"HTTP {r.status_code}", (await r.aread())[:200].decode(errors="replace"))
                    return
                done = False
                async for line in r.aiter_lines():
                    lines += 1
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith('data: {"error"'):
                        self.fail("error event", line[:200])
                        return
                if not done:
                    self.fail("no [DONE]", f"{lines} lines, {gateway}")
                    return
        except httpx.HTTPError as exc:
            self.fail(type(exc).__name__, f"{exc!r} after {lines} lines and {time.monotonic() - started:.2f} s, "
                                          f"{gateway}")
            return
        self.ok.append(time.monotonic() - started)

    async def run(self) -> None:
        a = self.args
        stop = time.monotonic() + a.duration
        limits = httpx.Limits(max_connections=a.concurrency * 2, max_keepalive_connections=a.concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            async def worker(w: int) -> None:
                i = 0
                while time.monotonic() < stop:
                    await self.one(http, w, i)
                    i += 1
            await asyncio.gather(*(worker(w) for w in range(a.concurrency)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="See the module docstring for what runs and why.")
    p.add_argument("--duration", type=float, default=240.0, help="seconds of load (default 240)")
    p.add_argument("--concurrency", type=int, default=200, help="streams at once (default 200)")
    p.add_argument("--gateways", type=int, default=2, help="gateway processes on one pool (default 2)")
    p.add_argument("--upstream", help="a real vLLM (…/v1) instead of the fake upstream")
    p.add_argument("--model", default="policy",
                   help="the model asked for (default policy: the gateway's alias for the served policy)")
    p.add_argument("--chunks", type=int, default=48, help="tokens per reply (default 48)")
    p.add_argument("--chunk-delay-s", type=float, default=0.13,
                   help="fake upstream: seconds between tokens (default 0.13: ~6.5 s streams, as on the GPU)")
    args = p.parse_args()
    if args.concurrency < 1 or args.gateways < 1 or args.duration <= 0:
        p.error("--concurrency and --gateways must be ≥ 1, --duration > 0")
    work = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    with ExitStack() as stack:
        upstream = args.upstream or stack.enter_context(UpstreamProcess(work / "upstream.log")).base_url
        pool = f"sqlite:///{work / 'pool.db'}"
        gateways = []
        for i in range(args.gateways):
            (work / f"g{i}").mkdir()
            gateways.append(stack.enter_context(GatewayProcess(work / f"g{i}", database_url=pool,
                                                               upstream_url=upstream)).base_url)
        streams = Streams(args, gateways)
        asyncio.run(streams.run())
    total = len(streams.ok) + sum(streams.failures.values())
    print(f"\n{total} streams in {args.duration:.0f} s, {args.concurrency} at once through {args.gateways} gateways "
          f"({'vLLM ' + args.upstream if args.upstream else 'fake upstream'}); logs under {work}\n")
    print("| outcome | streams |\n|---|---|")
    print(f"| ok | {len(streams.ok)} |")
    for kind, n in streams.failures.most_common():
        print(f"| {kind} | {n} |")
    if streams.ok:
        q = statistics.quantiles(streams.ok, n=100) if len(streams.ok) > 1 else [streams.ok[0]] * 99
        print(f"\nstream seconds: p50 {q[49]:.2f}, p99 {q[98]:.2f}")
    if streams.details:
        print("\nfirst failures:\n" + "\n".join(streams.details[:20]))
    sys.exit(1 if streams.failures else 0)


if __name__ == "__main__":
    main()
