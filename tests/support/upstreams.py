"""Test-only helpers around the processes of tests.support.processes: an upstream that never
answers, and talking to a gateway's `policy` alias (the publish tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx

from tests.support.processes import GatewayProcess


class SilentUpstream:
    """Accepts connections and never answers: an upstream that times out."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self._conns.append(conn)
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        for c in self._conns:
            c.close()
        self.sock.close()



# ------------------------------------------------------------------------------------------
# talking to a gateway's `policy` alias (the publish tests)


def openai_client(gw: GatewayProcess, timeout: float = 180) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=timeout)


def greedy_reply(gw: GatewayProcess, messages: list[dict[str, Any]], max_tokens: int, model: str = "policy") -> str:
    r = openai_client(gw).chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=max_tokens)
    return r.choices[0].message.content or ""


def alias_root(gw: GatewayProcess) -> str | None:
    """What the gateway's `policy` alias serves now: a version's name or the base model's."""
    models = httpx.get(f"{gw.base_url}/models", timeout=10).json()["data"]
    return next(m.get("root") for m in models if m["id"] == "policy")


class PolicyStream(threading.Thread):
    """A streaming request via `policy` that runs its full *max_tokens* (ignore_eos), in a
    thread: start it, wait for ``first_chunk``, switch something, then :meth:`result`.

    Or, where only "in flight across the switch" matters, :meth:`close_after` the switch: the
    stream reads *chunks* more and then closes (the client going away, as a person cancelling),
    so that *max_tokens* can be a generous ceiling for a slow switch on a loaded machine without
    every run paying for all of it (1000 CPU-decoded tokens each were most of a minute)."""

    def __init__(self, gw: GatewayProcess, messages: list[dict[str, Any]], max_tokens: int):
        super().__init__(daemon=True)
        self.gw, self.messages, self.max_tokens = gw, messages, max_tokens
        self.first_chunk = threading.Event()
        self.text = ""
        self.tokens = 0
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self._close_after: tuple[float, int] | None = None  # (switched_at, chunks to read after it)
        self.chunks_after: int = 0  # chunks that arrived after the switch (close_after)
        self.closed_early = False

    def close_after(self, switched_at: float, chunks: int = 24) -> None:
        """Read *chunks* more after *switched_at* (a monotonic time), then close the stream."""
        self._close_after = (switched_at, chunks)

    def run(self) -> None:
        try:
            stream = openai_client(self.gw).chat.completions.create(
                model="policy", messages=self.messages, temperature=0, max_tokens=self.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    self.model = chunk.model
                    self.text += choice.delta.content or ""
                    self.finish_reason = choice.finish_reason or self.finish_reason
                    self.first_chunk.set()
                if self._close_after is not None and time.monotonic() > self._close_after[0]:
                    self.chunks_after += 1
                    if self.chunks_after >= self._close_after[1] and self.finish_reason is None:
                        self.closed_early = True
                        stream.close()
                        break
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()

    def result(self, timeout: float = 300) -> PolicyStream:
        """Wait for the end; assert it completed its full length (or, after :meth:`close_after`,
        ran on past the switch until it was closed) without an error."""
        self.join(timeout)
        assert not self.is_alive(), "the stream did not finish"
        assert self.error is None, f"stream failed: {self.error!r}"
        if not self.closed_early:
            assert self.finish_reason == "length" and self.tokens == self.max_tokens, (self.finish_reason, self.tokens)
        return self
