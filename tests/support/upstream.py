"""A small, fast upstream speaking vLLM's OpenAI wire format with a fixed reply.

    python -m tests.support.upstream --port 9100

It answers ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (streamed and not),
with ``prompt_token_ids`` / ``token_ids`` / ``logprobs`` when asked for them, exactly where
vLLM puts them. It exists for what vLLM on two shared CPU cores cannot do: answer thousands of
requests a second (the gateway benchmark) and fail on cue (the fault tests). A request steers it
with extra body fields, which the gateway passes through untouched:

- ``fake_chunks`` (int): reply tokens (default 8), one stream chunk each;
- ``fake_chunk_delay_s`` (float): pause before each chunk (before each write, with
  ``fake_together``);
- ``fake_done_delay_s`` (float): pause before the last write, the one that carries ``[DONE]``;
- ``fake_together`` (int): send the stream's events that many at a time, each group in one
  socket write, so that they reach the gateway in one read;
- ``fake_split`` (bool): send each write in two halves, cut inside an event, with a pause
  between them, so that an event reaches the gateway across two reads;
- ``fake_die_after_chunks`` (int): the process exits (``os._exit``) after sending that many
  chunks, like a vLLM server that crashes mid-stream;
- ``fake_tag`` (str): remembered in ``GET /stats`` as completed or aborted (the client hung
  up before the end), so a test can see the gateway cancel the upstream request.

And by what it is asked: a chat request whose first user message is ``FAKE TOOL CALL: TEXT``
is answered (whole, not streamed) with one ``get_weather`` tool call whose arguments are TEXT
verbatim, as a model may write them (odd spacing, or not JSON at all).

Hand-rolled HTTP/1.1 on asyncio (keep-alive, Content-Length bodies, chunked replies): a
framework here would make the upstream, not the gateway, the thing the benchmark measures.
"""

from __future__ import annotations

import argparse
import subprocess  # noqa: F401 - used by UpstreamProcess
import asyncio
import json
import os
import time
from typing import Any

WORDS = ["Hello", "!", " How", " can", " I", " help", " you", " today", "?", " I", " am", " here", "."]
PROMPT_IDS = list(range(1, 17))


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.completed: list[str] = []
        self.aborted: list[str] = []

    def as_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "completed": self.completed, "aborted": self.aborted}


STATS = Stats()


def _chat_choice(i: int, lp: bool, ids: bool, text: str, n_tokens: int) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": i,
        "message": {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None},
        "logprobs": {"content": [{"token": w, "logprob": -0.25, "bytes": None, "top_logprobs": []}
                                 for w in _words(n_tokens)]} if lp else None,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": list(range(100, 100 + n_tokens)) if ids else None,
    }
    return choice


def _words(n: int) -> list[str]:
    return [WORDS[k % len(WORDS)] for k in range(n)]


TOOL_CALL_MARK = "FAKE TOOL CALL: "


def _asked_tool_arguments(body: dict[str, Any]) -> str | None:
    """TEXT of a first user message ``FAKE TOOL CALL: TEXT`` (string or text parts)."""
    for m in body.get("messages") or ():
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
        if isinstance(content, str) and content.startswith(TOOL_CALL_MARK):
            return content[len(TOOL_CALL_MARK):]
        return None
    return None


def whole_reply(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    n_tokens = int(body.get("fake_chunks", 8))
    n = int(body.get("n") or 1)
    ids = bool(body.get("return_token_ids"))
    text = "".join(_words(n_tokens))
    now = int(time.time())
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n_tokens * n,
             "total_tokens": len(PROMPT_IDS) + n_tokens * n}
    if endpoint == "chat":
        lp = bool(body.get("logprobs"))
        choices = [_chat_choice(i, lp, ids, text, n_tokens) for i in range(n)]
        arguments = _asked_tool_arguments(body)
        if arguments is not None:
            for c in choices:
                c["message"].update(content=None, tool_calls=[{
                    "id": f"chatcmpl-tool-{os.urandom(8).hex()}", "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments}}])
                c["finish_reason"] = "tool_calls"
        return {"id": f"chatcmpl-{os.urandom(8).hex()}", "object": "chat.completion", "created": now,
                "model": body.get("model"), "choices": choices,
                "usage": usage, "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS if ids else None}
    lp = body.get("logprobs") is not None
    return {"id": f"cmpl-{os.urandom(8).hex()}", "object": "text_completion", "created": now,
            "model": body.get("model"),
            "choices": [{"index": i, "text": text, "finish_reason": "stop", "stop_reason": None,
                         "logprobs": {"tokens": _words(n_tokens), "token_logprobs": [-0.25] * n_tokens,
                                      "text_offset": [], "top_logprobs": None} if lp else None,
                         "prompt_token_ids": PROMPT_IDS if ids else None,
                         "token_ids": list(range(100, 100 + n_tokens)) if ids else None}
                        for i in range(n)],
            "usage": usage}


def stream_events(endpoint: str, body: dict[str, Any]) -> list[bytes]:
    n_tokens = int(body.get("fake_chunks", 8))
    ids = bool(body.get("return_token_ids"))
    cid = f"chatcmpl-{os.urandom(8).hex()}"
    now = int(time.time())
    events = []
    for k, word in enumerate(_words(n_tokens)):
        last = k == n_tokens - 1
        if endpoint == "chat":
            lp = bool(body.get("logprobs"))
            delta: dict[str, Any] = {"content": word}
            if k == 0:
                delta = {"role": "assistant", "content": word}
            choice = {"index": 0, "delta": delta,
                      "logprobs": {"content": [{"token": word, "logprob": -0.25, "bytes": None,
                                                "top_logprobs": []}]} if lp else None,
                      "finish_reason": "stop" if last else None,
                      "token_ids": [100 + k] if ids else None}
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": body.get("model"),
                     "choices": [choice]}
        else:
            lp = body.get("logprobs") is not None
            chunk = {"id": cid, "object": "text_completion", "created": now, "model": body.get("model"),
                     "choices": [{"index": 0, "text": word,
                                  "logprobs": {"tokens": [word], "token_logprobs": [-0.25],
                                               "text_offset": [], "top_logprobs": None} if lp else None,
                                  "finish_reason": "stop" if last else None,
                                  "token_ids": [100 + k] if ids else None}]}
        if k == 0 and ids:
            chunk["prompt_token_ids"] = PROMPT_IDS
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "OK")
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_response(status: int, obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _head(status, [("content-type", "application/json"), ("content-length", str(len(data)))]) + data


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {}
            for line in header_lines:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            path = path.split("?", 1)[0]
            if method == "GET" and path.endswith("/models"):
                writer.write(_json_response(200, {"object": "list", "data": [
                    {"id": "fixed", "object": "model", "created": 0, "owned_by": "bench"}]}))
            elif method == "GET" and path == "/stats":
                writer.write(_json_response(200, STATS.as_json()))
            elif method == "POST" and path.endswith(("/chat/completions", "/completions")):
                STATS.requests += 1
                payload = json.loads(body)
                endpoint = "chat" if path.endswith("/chat/completions") else "completions"
                if payload.get("stream"):
                    if not await _stream(writer, endpoint, payload):
                        return
                else:
                    writer.write(_json_response(200, whole_reply(endpoint, payload)))
            else:
                writer.write(_json_response(404, {"error": {"message": f"no route {path}", "type": "NotFound",
                                                            "param": None, "code": 404}}))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def _stream(writer: asyncio.StreamWriter, endpoint: str, payload: dict[str, Any]) -> bool:
    """Send one streamed reply; False if the client went away before its end."""
    tag = payload.get("fake_tag")
    delay = float(payload.get("fake_chunk_delay_s") or 0)
    done_delay = float(payload.get("fake_done_delay_s") or 0)  # a pause before [DONE] alone
    die_after = payload.get("fake_die_after_chunks")
    together = max(1, int(payload.get("fake_together") or 1))
    split = bool(payload.get("fake_split"))
    writer.write(_head(200, [("content-type", "text/event-stream; charset=utf-8"),
                             ("transfer-encoding", "chunked")]))
    events = stream_events(endpoint, payload)
    try:
        for k in range(0, len(events), together):
            if die_after is not None and k >= int(die_after):
                os._exit(3)  # a crash: no [DONE], no closing chunk, the socket just drops
            if delay:
                await asyncio.sleep(delay)
            if done_delay and k + together >= len(events):
                await asyncio.sleep(done_delay)
            data = b"".join(events[k:k + together])
            for part in (data[:len(data) // 2], data[len(data) // 2:]) if split else (data,):
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await writer.drain()
                if writer.transport.is_closing():
                    raise ConnectionResetError
                if split:
                    await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    except ConnectionError:
        if tag:
            STATS.aborted.append(tag)
        return False
    if tag:
        STATS.completed.append(tag)
    return True


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(_serve_one, host, port, backlog=4096)
    async with server:
        print(f"listening on http://{host}:{port}/v1", flush=True)
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()


class UpstreamProcess:
    """This upstream in a process of its own (so a test can kill it and start it again on the
    same port)."""

    def __init__(self, log_path: "os.PathLike[str] | str", port: int | None = None):
        from tests.support.processes import free_port

        self.port = port or free_port()
        self.log_path = str(log_path)
        self.proc: "subprocess.Popen[bytes] | None" = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def model_list(self, path: "os.PathLike[str] | str") -> "os.PathLike[str] | str":
        """Writes a gateway model list (``--model-list``) with one group, ``fixed``, served by this
        upstream as a vLLM (white-box) deployment, to *path*; returns *path*."""
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump({"model_list": [{"model_name": "fixed", "litellm_params": {
                "model": "hosted_vllm/fixed", "api_base": self.base_url}}]}, f)
        return path

    def start(self, timeout: float = 30.0) -> "UpstreamProcess":
        import subprocess
        import sys

        import httpx

        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.upstream", "--port", str(self.port)],
                                     stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"upstream exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"upstream not up after {timeout}s")

    def stats(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=5).json()

    def wait_exit(self, timeout: float = 10.0) -> int | None:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "UpstreamProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
