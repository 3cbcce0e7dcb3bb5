"""The load generator, run in its own process so it never shares an event loop with what it measures.

    python -m benchmarks.gateway.load --url http://127.0.0.1:8400/v1 --rate 200 --duration 10 [--stream]
    python -m benchmarks.gateway.load --url ... --concurrency 64 --duration 10      # saturation
    python -m benchmarks.gateway.load --url ... --concurrency 64 --requests 20000   # fixed count
    python -m benchmarks.gateway.load --url ... --rate 200 --format messages        # another wire format

Open loop (``--rate``): requests start on a fixed schedule whatever the server does, and each
latency is measured from its scheduled start, so a server that falls behind shows it (no
coordinated omission). Closed loop (``--concurrency``): that many clients back to back.
Prints one JSON object: ok, errors, elapsed, and per-request TTFT / total in milliseconds
(TTFT = the first byte of the body; for a whole response it equals the total).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from typing import Any

import aiohttp


# the same request in each wire format the gateway speaks: its path and body
FORMATS = {
    "chat": ("/chat/completions", lambda model: {
        "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}),
    "responses": ("/responses", lambda model: {"model": model, "input": "Say hello.", "max_output_tokens": 8}),
    "messages": ("/messages", lambda model: {
        "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}),
}


UNIQUE = b"@@N@@"


def _body(model: str, stream: bool, extra: dict[str, Any], fmt: str = "chat") -> bytes:
    body = FORMATS[fmt][1](model) | {"stream": stream} | extra
    return json.dumps(body).encode()


class Run:
    def __init__(self, url: str, payload: bytes, headers: dict[str, str]):
        self.url = url
        self.payload = payload
        # UNIQUE in the body becomes a counter: each request's text differs (nothing cached)
        self.unique = UNIQUE in payload
        self.sent = 0
        self.headers = {"content-type": "application/json", **headers}
        self.ttft: list[float] = []
        self.total: list[float] = []
        self.errors: dict[str, int] = {}

    async def one(self, session: aiohttp.ClientSession, start: float) -> None:
        payload = self.payload
        if self.unique:
            self.sent += 1
            payload = payload.replace(UNIQUE, str(self.sent).encode())
        try:
            async with session.post(self.url, data=payload, headers=self.headers) as resp:
                first = None
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                end = time.perf_counter()
                if resp.status != 200:
                    key = f"HTTP {resp.status}"
                    self.errors[key] = self.errors.get(key, 0) + 1
                    return
        except Exception as exc:  # noqa: BLE001 - every failure is counted by its kind
            key = type(exc).__name__
            self.errors[key] = self.errors.get(key, 0) + 1
            return
        self.ttft.append(((first or end) - start) * 1000)
        self.total.append((end - start) * 1000)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    extra = json.loads(args.extra) if args.extra else {}
    run = Run(args.url.rstrip("/") + FORMATS[args.format][0], _body(args.model, args.stream, extra, args.format),
              {"authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(args.warmup):
            await run.one(session, time.perf_counter())
        run.ttft.clear(), run.total.clear(), run.errors.clear()
        t0 = time.perf_counter()
        if args.rate:
            n = int(args.rate * args.duration)
            tasks = []
            for i in range(n):
                at = t0 + i / args.rate
                delay = at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run.one(session, at)))
            await asyncio.gather(*tasks)
        else:
            deadline = t0 + args.duration if args.duration else None
            remaining = [args.requests] if args.requests else None

            async def client() -> None:
                while True:
                    if deadline is not None and time.perf_counter() >= deadline:
                        return
                    if remaining is not None:
                        if remaining[0] <= 0:
                            return
                        remaining[0] -= 1
                    await run.one(session, time.perf_counter())

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"ok": len(run.total), "errors": run.errors, "elapsed_s": elapsed,
            "ttft_ms": run.ttft if args.latencies else [], "total_ms": run.total if args.latencies else [],
            "cpu_s": ru.ru_utime + ru.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="base URL (…/v1)")
    ap.add_argument("--model", default="fixed")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--format", choices=sorted(FORMATS), default="chat",
                    help="wire format: Chat Completions, OpenAI Responses or Anthropic Messages")
    ap.add_argument("--rate", type=float, help="open loop: requests per second")
    ap.add_argument("--concurrency", type=int, default=64, help="closed loop: clients")
    ap.add_argument("--duration", type=float, default=0, help="seconds")
    ap.add_argument("--requests", type=int, default=0, help="closed loop: stop after this many")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--api-key")
    ap.add_argument("--extra", help="JSON object merged into the request body; @@N@@ in it becomes a "
                                    "counter, so that every request's text differs")
    ap.add_argument("--no-latencies", dest="latencies", action="store_false")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    json.dump(asyncio.run(main_async(args)), sys.stdout)


if __name__ == "__main__":
    main()
