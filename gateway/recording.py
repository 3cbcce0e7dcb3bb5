"""What the gateway keeps of each call, and how it trims vLLM's extra fields off the client's copy.

White-box capture asks vLLM for ``return_token_ids`` and ``logprobs`` on every call; these
functions take them out of the upstream's response (whole or streamed), and remove them from
what the client receives unless the client asked for them itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# Fields of the body the pool keeps outside `params`.
_REQUEST_KEYS = {"chat": ("messages", "tools"), "completions": ("prompt",)}


def request_record(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    keys = _REQUEST_KEYS[endpoint]
    out: dict[str, Any] = {k: body[k] for k in keys if k in body}
    out["params"] = {k: v for k, v in body.items() if k not in keys and k != "model"}
    return out


@dataclass(frozen=True)
class ClientWants:
    """What the client itself asked vLLM for, so the gateway's additions can be taken back out."""

    logprobs: bool
    token_ids: bool

    @classmethod
    def of(cls, endpoint: str, body: dict[str, Any]) -> "ClientWants":
        lp = body.get("logprobs")
        return cls(
            logprobs=bool(lp) if endpoint == "chat" else lp is not None,
            token_ids=bool(body.get("return_token_ids")),
        )

    @property
    def everything(self) -> bool:
        return self.logprobs and self.token_ids


def white_box_body(endpoint: str, body: dict[str, Any], served_name: str) -> dict[str, Any]:
    """The body sent to vLLM: the client's, plus what exact capture needs."""
    out = dict(body)
    out["model"] = served_name
    out["return_token_ids"] = True
    if endpoint == "chat":
        out["logprobs"] = True
    elif body.get("logprobs") is None:
        out["logprobs"] = 0  # the sampled token's logprob, no alternatives
    return out


def strip_for_client(obj: dict[str, Any], wants: ClientWants) -> None:
    """Null, in place, what the gateway asked vLLM for and the client did not: vLLM itself
    sends these keys as null when not asked, so the client sees exactly that."""
    if not wants.token_ids and obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
    for choice in obj.get("choices") or ():
        if not wants.token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if choice.get(key) is not None:
                    choice[key] = None
        if not wants.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None


def _token_logprobs(endpoint: str, logprobs: Any) -> list[float]:
    if not logprobs:
        return []
    if endpoint == "chat":
        return [float(t["logprob"]) for t in logprobs.get("content") or ()]
    return [float(x) if x is not None else 0.0 for x in logprobs.get("token_logprobs") or ()]


@dataclass
class _Choice:
    index: int
    role: str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Captured:
    """The pool's view of one response: shape shared by whole and streamed replies."""

    response: dict[str, Any]
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    logprobs: list[float] | None
    usage: dict[str, Any] | None


class Accumulator:
    """Builds the captured response from a whole response or from stream chunks."""

    def __init__(self, endpoint: str, white_box: bool):
        self.endpoint = endpoint
        self.white_box = white_box
        self.id: str | None = None
        self.model: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, _Choice] = {}

    def feed(self, obj: dict[str, Any]) -> None:
        """Take one stream chunk, or a whole (non-streamed) response."""
        self.id = self.id or obj.get("id")
        self.model = self.model or obj.get("model")
        if obj.get("prompt_token_ids"):
            self.prompt_token_ids = list(obj["prompt_token_ids"])
        if obj.get("usage"):
            self.usage = obj["usage"]
        for c in obj.get("choices") or ():
            i = c.get("index", 0)
            st = self.choices.get(i)
            if st is None:  # not setdefault: a _Choice built per chunk only to be thrown away
                st = self.choices[i] = _Choice(index=i)
            if c.get("prompt_token_ids") and self.prompt_token_ids is None:
                self.prompt_token_ids = list(c["prompt_token_ids"])  # completions: per choice
            if self.endpoint == "chat":
                self._feed_message(st, c.get("delta") or c.get("message") or {})
            elif c.get("text"):
                st.text.append(c["text"])
            if c.get("finish_reason") is not None:
                st.finish_reason = c["finish_reason"]
            if c.get("token_ids"):
                st.token_ids.extend(c["token_ids"])
            st.logprobs.extend(_token_logprobs(self.endpoint, c.get("logprobs")))

    @staticmethod
    def _feed_message(st: _Choice, part: dict[str, Any]) -> None:
        st.role = st.role or part.get("role")
        if part.get("content"):
            st.text.append(part["content"])
        reasoning = part.get("reasoning_content") or part.get("reasoning")
        if reasoning:
            st.reasoning.append(reasoning)
        for call in part.get("tool_calls") or ():
            slot = st.tool_calls.setdefault(
                call.get("index", len(st.tool_calls)),
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] = fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]

    def finished(self, n: int) -> bool:
        """Whether each of the *n* choices asked for has its finish reason: the reply is whole,
        though the usage chunk and [DONE] that follow it may not have arrived."""
        return len(self.choices) >= n and all(c.finish_reason is not None for c in self.choices.values())

    def result(self) -> Captured:
        choices = []
        for i, st in enumerate(sorted(self.choices.values(), key=lambda c: c.index)):
            entry: dict[str, Any] = {"index": st.index, "finish_reason": st.finish_reason}
            if self.endpoint == "chat":
                message: dict[str, Any] = {"role": st.role or "assistant", "content": "".join(st.text) or None}
                if st.reasoning:
                    message["reasoning_content"] = "".join(st.reasoning)
                if st.tool_calls:
                    message["tool_calls"] = [st.tool_calls[k] for k in sorted(st.tool_calls)]
                entry["message"] = message
            else:
                entry["text"] = "".join(st.text)
            if self.white_box and i > 0:  # choice 0's live in the turn's own columns
                entry["token_ids"] = st.token_ids
                entry["logprobs"] = st.logprobs
            choices.append(entry)
        first = self.choices.get(min(self.choices)) if self.choices else None
        usage = self.usage
        if usage is None and self.white_box and self.prompt_token_ids is not None:
            # vLLM sends usage in a stream only when asked; the token ids give it exactly
            completion = sum(len(c.token_ids) for c in self.choices.values())
            usage = {
                "prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": completion,
                "total_tokens": len(self.prompt_token_ids) + completion,
            }
        return Captured(
            response={"id": self.id, "model": self.model, "choices": choices},
            prompt_token_ids=self.prompt_token_ids if self.white_box else None,
            token_ids=(first.token_ids if first else []) if self.white_box else None,
            logprobs=(first.logprobs if first else []) if self.white_box else None,
            usage=usage,
        )


# raw event bytes and its data payload or None (a stream LiteLLM parsed already: empty bytes and the object)
SSEvent = tuple[bytes, bytes | dict[str, Any] | None]


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[SSEvent]]:
    """Split a byte stream into server-sent events, yielding the complete events of each read
    together: what arrived at once can be relayed in one write."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        events: list[SSEvent] = []
        start = 0
        while (cut := buffer.find(b"\n\n", start)) >= 0:
            raw = buffer[start : cut + 2]
            events.append((raw, _data(raw)))
            start = cut + 2
        buffer = buffer[start:]
        if events:
            yield events
    if buffer.strip():
        yield [(buffer, _data(buffer))]


def _data(raw: bytes) -> bytes | None:
    lines = [line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
