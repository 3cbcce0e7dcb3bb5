"""The least a Python proxy on the gateway's own stack can add: a benchmark row, not a product.

    python -m benchmarks.gateway.floor --upstream http://127.0.0.1:8000/v1 --port 8402

uvicorn (httptools, uvloop) serving a raw ASGI app that forwards each request body to the
upstream with aiohttp and relays the reply bytes as they come: no FastAPI, no parsing, no
key check, no capture. What nextstate adds on top of this row is the cost of its own work
(routing, validation, session headers, capture); what this row adds over ``direct`` is the
cost of any second hop through a Python process on this machine.
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn


def app_for(upstream: str) -> Any:
    session: aiohttp.ClientSession | None = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=2000, keepalive_timeout=2.0))
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if session is not None:
                        await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert session is not None
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        url = upstream + scope["path"].removeprefix("/v1")
        async with session.request(scope["method"], url, data=body or None,
                                   headers={"Content-Type": "application/json"}) as resp:
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", resp.headers.get("content-type", "").encode())]})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="the upstream's base URL (…/v1)")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(app_for(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
