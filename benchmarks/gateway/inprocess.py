"""CPU per request of the gateway driven in process: no server, no load generator, no other row.

    python -m benchmarks.gateway.inprocess [--requests 2000] [--rounds 2] [--concurrency 8]
        [--formats chat,responses,messages] [--root PATH] [--floor] [--rate RPS] [--cprofile PATH]

Starts the benchmark's fixed-reply upstream (a process of its own) and a fresh PostgreSQL pool,
builds the gateway's ASGI application in this process (``--root``: from another checkout, e.g. a
``git worktree`` of the revision to compare with; default this one) and calls it directly,
``--concurrency`` requests at a time, with the benchmark's request in each wire format, whole and
streamed. Per format and mode and round it prints the CPU seconds per request of the whole process
(the event loop and the capture writer, whose turns are waited for before the clock stops) and of
the event loop's thread alone, and, over the run, the garbage collector's time per generation.
``--floor``: the same calls to benchmarks/gateway/floor.py's application (no writer).
``--rate``: the requests started at that many per second instead of back to back, as ``--quick``
measures its CPU column (200 RPS): the event loop then sleeps between requests and wakes for each,
and the capture writer's batches are as small as that rate makes them (a request costs about
twice its CPU of a back-to-back run, the floor's too). ``--cprofile PATH``: cProfile of the event
loop's thread (its CPU clock) over the measured rounds, saved to PATH (``python -m pstats PATH``)
and its widest frames printed; the profiler's own cost per call inflates every frame (~2.5x the
request's CPU), so read it for shares and call counts, and this run's µs per request as no measure.

Without uvicorn and the load generator beside it on 2 shared cores, one round moves by a few
per cent rather than the third that ``--quick``'s CPU column can: what a change on the request
path or in the writer saves shows here first (benchmarks/gateway/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pstats
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests per format, mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--formats", default="chat,responses,messages")
    ap.add_argument("--root", type=Path, default=HERE, help="the checkout whose gateway is measured")
    ap.add_argument("--floor", action="store_true", help="benchmarks/gateway/floor.py's application instead")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="requests started per second (0: back to back, --concurrency at a time)")
    ap.add_argument("--cprofile", type=Path, help="save a cProfile of the event loop's thread here")
    args = ap.parse_args()
    root = args.root.resolve()
    sys.path.insert(0, str(root))
    os.chdir(root)
    from benchmarks.gateway.__main__ import CLIENT_KEY, Proc, _pg_and_redis, _wait_http
    from benchmarks.gateway.load import FORMATS
    from tests.support.processes import free_port

    with ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="bench-inprocess-"))
        port = free_port()
        upstream = Proc([sys.executable, "-m", "tests.support.upstream", "--port", str(port)], work / "upstream.log",
                        {"PYTHONPATH": str(root)})
        stack.callback(upstream.stop)
        url = f"http://127.0.0.1:{port}/v1"
        _wait_http(f"{url}/models", upstream, 30, "upstream")
        database_url, broker = _pg_and_redis(stack)
        models = work / "models.yaml"
        models.write_text(yaml.safe_dump({"model_list": [{"model_name": "fixed", "litellm_params": {
            "model": "hosted_vllm/fixed", "api_base": url}}], "policy_model": "fixed"}))
        os.environ.update({"NEXTSTATE_DATA_DIR": str(work), "NEXTSTATE_BROKER_URL": broker,
                           "NEXTSTATE_API_KEYS": CLIENT_KEY, "NEXTSTATE_DATABASE_URL": database_url,
                           "NEXTSTATE_MODEL_LIST": str(models)})
        from datapool.db import upgrade
        from gateway.app import create_app

        upgrade(database_url)
        app: Any = create_app()
        if args.floor:
            from benchmarks.gateway.floor import app_for

            app = app_for(url)
        import uvloop

        print(f"gateway from {Path(sys.modules['gateway'].__file__).parent.parent}")  # type: ignore[arg-type]
        uvloop.run(_measure(app, args, FORMATS, CLIENT_KEY))


async def _measure(app: Any, args: argparse.Namespace, formats: dict[str, Any], key: str) -> None:
    async def call(fmt: str, stream: bool) -> None:
        path, body_of = formats[fmt]
        body = json.dumps(body_of("fixed") | {"stream": stream}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1" + path, "raw_path": f"/v1{path}".encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000),
                 "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                             (b"authorization", f"Bearer {key}".encode()),
                             (b"content-length", str(len(body)).encode()), (b"user-agent", b"Python/3.11 aiohttp")],
                 "state": {}}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never hangs up
            raise AssertionError

        out: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            out.append(message)

        await app(scope, receive, send)
        if out[0]["status"] != 200:
            raise RuntimeError(f"{fmt}: {out}")

    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                       inbox.get, outbox.put))
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the application did not start: {started}")
    writer = None if args.floor else app.state.gateway.writer
    thresholds = gc.get_threshold()  # as the gateway set them at its start
    fmts = [f for f in args.formats.split(",") if f]
    for fmt in fmts:  # LiteLLM's translators are imported at the first Responses or Messages request
        await call(fmt, False)
    collected: dict[int, list[float]] = {}
    began = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.thread_time()
        else:
            entry = collected.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.thread_time() - began[0]

    gc.callbacks.append(on_gc)
    profiler = cProfile.Profile(time.thread_time) if args.cprofile else None
    rows: dict[str, list[tuple[float, float]]] = {}
    total = 0
    try:
        for _ in range(args.rounds):
            for fmt in fmts:
                for stream in (False, True):
                    await asyncio.sleep(0.5)  # the writer's last batch stored
                    gate = asyncio.Semaphore(args.concurrency)

                    async def one(fmt: str = fmt, stream: bool = stream) -> None:
                        async with gate:
                            await call(fmt, stream)

                    cpu, loop_cpu = time.process_time(), time.thread_time()
                    if profiler is not None:
                        profiler.enable()  # this thread's: the writer's threads are not profiled
                    if args.rate:
                        await _paced(one, args.requests, args.rate)
                    else:
                        await asyncio.gather(*(one() for _ in range(args.requests)))
                    if profiler is not None:
                        profiler.disable()
                    loop_cpu = time.thread_time() - loop_cpu
                    if writer is not None:
                        await writer.flushed()
                    cpu = time.process_time() - cpu
                    total += args.requests
                    rows.setdefault(f"{fmt} {'streamed' if stream else 'whole'}", []).append(
                        (cpu / args.requests * 1e6, loop_cpu / args.requests * 1e6))
    finally:
        gc.callbacks.remove(on_gc)
        await inbox.put({"type": "lifespan.shutdown"})
        await lifespan
    print(f"{'row':20s} {'process µs/request, per round':32s} event loop µs/request, per round")
    for name, values in rows.items():
        print(f"{name:20s} {' '.join(f'{p:6.0f}' for p, _ in values):32s} {' '.join(f'{t:6.0f}' for _, t in values)}")
    print("garbage collector: " + ", ".join(
        f"generation {g}: {n} runs, {s * 1e3:.0f} ms" for g, (n, s) in sorted(collected.items()))
        + f"; {sum(s for _, s in collected.values()) / max(total, 1) * 1e6:.1f} µs per request, "
        f"thresholds {thresholds}")
    if profiler is not None:
        profiler.dump_stats(args.cprofile)
        print(f"event loop's profile: {args.cprofile}, {total} requests; the widest frames by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


async def _paced(one: Any, n: int, rate: float) -> None:
    """*n* calls of *one*, started *rate* per second (open loop: a slow one does not delay the start of
    the next, which waits only for --concurrency calls in flight)."""
    tasks = []
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    main()
