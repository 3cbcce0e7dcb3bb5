"""The gateway's upstream client: httpx against aiohttp, CPU per request, side by side.

    python -m benchmarks.gateway.clients [--requests 4000] [--rounds 2]

Starts the fixed OpenAI-wire-format upstream (tests/support/upstream.py) in its own process,
then, in this process on uvloop, sends the same non-streamed chat request through each client
the way the gateway does (a pooled client, 8 requests in flight), alternating the clients for
``--rounds`` rounds so both see the same machine. Prints the CPU time and wall time this
process spent per request. Pin it to one core (``taskset -c 1``) for steadier numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import uvloop

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.upstream import UpstreamProcess  # noqa: E402

BODY = {"model": "fixed", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
IN_FLIGHT = 8


async def _measure(one: Callable[[], Awaitable[None]], n: int) -> tuple[float, float]:
    for _ in range(50):
        await one()  # warm the pool
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n // IN_FLIGHT):
        await asyncio.gather(*(one() for _ in range(IN_FLIGHT)))
    done = n // IN_FLIGHT * IN_FLIGHT
    return (time.process_time() - cpu) / done * 1000, (time.perf_counter() - wall) / done * 1000


async def with_httpx(url: str, n: int) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one() -> None:
            resp = await client.send(client.build_request("POST", url, json=BODY), stream=True)
            await resp.aread()
            await resp.aclose()

        return await _measure(one, n)


async def with_aiohttp(url: str, n: int) -> tuple[float, float]:
    data = json.dumps(BODY).encode()
    connector = aiohttp.TCPConnector(limit=2000, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> None:
            async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()

        return await _measure(one, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="requests per client and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, UpstreamProcess(Path(tmp) / "upstream.log") as up:
        url = f"{up.base_url}/chat/completions"
        rows: dict[str, list[tuple[float, float]]] = {"httpx": [], "aiohttp": []}
        for _ in range(args.rounds):
            rows["httpx"].append(uvloop.run(with_httpx(url, args.requests)))
            rows["aiohttp"].append(uvloop.run(with_aiohttp(url, args.requests)))
    print(f"{'client':<10}{'CPU ms/request (each round)':>32}{'wall ms/request':>20}")
    for name, results in rows.items():
        cpu = " / ".join(f"{c:.3f}" for c, _ in results)
        wall = " / ".join(f"{w:.3f}" for _, w in results)
        print(f"{name:<10}{cpu:>32}{wall:>20}")
    h = min(c for c, _ in rows["httpx"])
    a = min(c for c, _ in rows["aiohttp"])
    print(f"httpx / aiohttp CPU per request (best rounds): {h / a:.1f}x")


if __name__ == "__main__":
    main()
