"""The canonical form of a conversation and the hashes stitching finds a turn's parent by.

A request continues an earlier turn when its messages begin with that turn's request messages
followed by that turn's reply. Both sides are reduced to hashes of a canonical form of the
messages (this module), so the match is a pool lookup (datapool.sessions) and works across
gateway replicas and out of order. The rules of the form are in docs/sessions.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from datapool.records import TurnRecord
from base.jsonfast import canonical_dumps
from base.vocab import Endpoint, TurnKind, TurnStatus

Message = dict[str, Any]


def _plain(value: Any, *, drop_nulls: bool) -> Any:
    """A JSON value with integral floats as integers, the way every client round-trips it
    (JavaScript's JSON.stringify prints 1.0 as 1), and null members dropped if asked."""
    if isinstance(value, dict):
        return {str(k): _plain(v, drop_nulls=drop_nulls) for k, v in value.items()
                if v is not None or not drop_nulls}
    if isinstance(value, list):
        return [_plain(v, drop_nulls=drop_nulls) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


# Context an agent wraps in these tags (Claude Code, Qwen Code: the date, the skills it offers,
# notes about files) is its own, re-rendered at will: Qwen Code's `--continue` sends the
# transcript without the reminders its first call carried. Not part of the history.
_REMINDER = re.compile(r"<system-reminder>[\s\S]*?</system-reminder>")


def _text(text: str) -> str:
    return _REMINDER.sub("", text) if "<system-reminder>" in text else text


def _content(content: Any) -> Any:
    """Text is the same text whether sent as a string or as ``{"type": "text"}`` parts, and
    without the ``<system-reminder>`` blocks an agent puts in it; other parts (images, audio)
    count with their null fields dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        return _plain(content, drop_nulls=True)
    out: list[Any] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            text = _text(str(part.get("text") or ""))
            if out and isinstance(out[-1], str):
                out[-1] += text
            else:
                out.append(text)
        else:
            out.append(_plain(part, drop_nulls=True))
    if not out:
        return ""
    return out[0] if len(out) == 1 and isinstance(out[0], str) else out


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments compared as the JSON they encode, not as the string that encodes it
    (clients re-serialise them: key order, whitespace, escapes). An empty string means no
    arguments; what is not JSON is compared as sent."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            return _plain(json.loads(arguments), drop_nulls=False)
        except ValueError:
            return arguments
    return _plain(arguments, drop_nulls=False)


class CanonicalHistory:
    """A conversation's messages, fed in order, in the form matching compares, and the running
    hash of that form.

    Tool-call ids are not compared as strings: clients rewrite them (OpenClaw strips the dashes
    of ``chatcmpl-tool-…``). The n-th tool call of the conversation is call number n, matched by
    its position, function name and arguments; a tool message's ``tool_call_id`` is replaced by
    the number of the call that carried that id. The rules are in docs/sessions.md.
    """

    __slots__ = ("_hash", "_calls", "_count")

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._calls: dict[str, int] = {}  # tool-call id as this history spells it -> its number
        self._count = 0

    def copy(self) -> CanonicalHistory:
        other = CanonicalHistory.__new__(CanonicalHistory)
        other._hash = self._hash.copy()
        other._calls = dict(self._calls)
        other._count = self._count
        return other

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def add(self, message: Message) -> dict[str, Any]:
        """Feed one message; returns its canonical form."""
        canon = self.canonical(message)
        self.feed(canonical_dumps(canon).encode())
        return canon

    def encode(self, message: Message) -> bytes:
        """The message's canonical form as the hash takes it (:meth:`canonical`: numbers its calls)."""
        return canonical_dumps(self.canonical(message)).encode()

    def feed(self, encoded: bytes) -> None:
        """Feed a message :meth:`encode` made, here or in a history that numbers calls as this one."""
        self._hash.update(encoded)
        self._hash.update(b"\x1e")

    def digest_after(self, encoded: bytes) -> str:
        """The hash after one more encoded message, this history left as it is."""
        h = self._hash.copy()
        h.update(encoded)
        h.update(b"\x1e")
        return h.hexdigest()

    def numbering(self) -> CanonicalHistory:
        """An empty history that numbers tool calls as this one does after its messages."""
        other = CanonicalHistory()
        other._calls = dict(self._calls)
        other._count = self._count
        return other

    def canonical(self, message: Message) -> dict[str, Any]:
        """The parts of a message that identify it; numbers the message's tool calls.

        SDKs echo an assistant reply back with extra null fields (refusal, audio, annotations),
        content ``None`` beside tool calls, text as a list of parts, a ``name`` added; none of
        that matters.
        """
        out: dict[str, Any] = {"role": message.get("role"), "content": _content(message.get("content"))}
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            canon_calls = []
            for call in calls:
                call = call if isinstance(call, dict) else {}
                fn = call.get("function") if isinstance(call.get("function"), dict) else {}
                call_id = call.get("id")
                if isinstance(call_id, str) and call_id:
                    self._calls[call_id] = self._count  # an id used twice names its latest call
                self._count += 1
                canon_calls.append([fn.get("name"), _arguments(fn.get("arguments"))])
            out["tool_calls"] = canon_calls
        function_call = message.get("function_call")  # the single call of the older Chat Completions API
        if isinstance(function_call, dict):
            out["function_call"] = [function_call.get("name"), _arguments(function_call.get("arguments"))]
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str) and call_id:
            number = self._calls.get(call_id)
            # an id no earlier call carried stays a string, never equal to a number
            out["tool_call_id"] = number if number is not None else call_id
        return out


def canonical_message(message: Message) -> dict[str, Any]:
    """One message's canonical form, on its own (tool-call ids are numbered from 0)."""
    return CanonicalHistory().canonical(message)


def _hasher(messages: Iterable[Message]) -> CanonicalHistory:
    h = CanonicalHistory()
    for m in messages:
        h.add(m)
    return h


def history_hash(messages: Iterable[Message]) -> str:
    """The hash of a whole message history in the canonical form: the same for every client
    spelling of the same history (the eval gate's held-out prompts are keyed by it)."""
    return _hasher(messages).hexdigest()


class Prefixes:
    """One pass over a history: the canonical hash after each message (``digests[i]`` covers
    ``messages[: i + 1]``) and the hasher at its end. Every key stitching looks a request up by,
    or stores a turn under, is read from these, so a request's messages are canonicalized once,
    not once per kind of key."""

    __slots__ = ("messages", "digests", "end", "canon", "encoded", "source", "replied")

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = messages
        h = CanonicalHistory()
        self.digests: list[str] = []
        self.canon: list[dict[str, Any]] = []  # each message's canonical form (CanonicalHistory.canonical)
        self.encoded: list[bytes] = []  # the same as hashed
        for m in messages:
            c = h.canonical(m)
            e = canonical_dumps(c).encode()
            h.feed(e)
            self.canon.append(c)
            self.encoded.append(e)
            self.digests.append(h.hexdigest())
        self.end = h
        # the Prefixes whose tool-call numbering this one's shares at every message (see kept)
        self.source: Prefixes = self
        self.replied: tuple[list[Message], list[bytes]] | None = None  # see replies_encoded

    def kept(self, indices: Sequence[int]) -> Prefixes:
        """``Prefixes([messages[i] for i in indices])``. Where the messages left out carry no tool
        calls (the system messages prepare leaves out), the tool calls are numbered as in this one
        at every kept message, so their canonical forms are this one's: hashed again, not made again."""
        chosen = set(indices)
        if any(isinstance(m.get("tool_calls"), list) and m.get("tool_calls")
               for i, m in enumerate(self.messages) if i not in chosen):
            return Prefixes([self.messages[i] for i in indices])
        out = Prefixes.__new__(Prefixes)
        out.messages = [self.messages[i] for i in indices]
        h = self.end.numbering()
        out.digests = []
        out.canon = [self.canon[i] for i in indices]
        out.encoded = [self.encoded[i] for i in indices]
        for e in out.encoded:
            h.feed(e)
            out.digests.append(h.hexdigest())
        out.end = h
        out.source = self.source
        out.replied = None
        return out

    def links(self) -> list[tuple[int, str]]:
        """:func:`link_candidates`."""
        return [(i, self.digests[i]) for i in range(len(self.messages) - 1, -1, -1)
                if self.messages[i].get("role") == "assistant"]

    def retries(self) -> list[tuple[int, str]]:
        """:func:`retry_candidates`."""
        m = self.messages
        start = after_last_assistant(m) if any(x.get("role") == "assistant" for x in m) else 1
        return [(k, _salted(self.digests[k - 1])) for k in range(len(m), start - 1, -1)]

    def request(self) -> str:
        """:func:`request_hash`."""
        return _salted(self.end.hexdigest())

    def continuations(self, replies: Sequence[Message], encoded: Sequence[bytes] | None = None) -> list[str]:
        """:func:`continuation_hashes`; *encoded*: the replies' canonical forms as another Prefixes
        of the same ``source`` made them (``replies_encoded``)."""
        encoded = self.replies_encoded(replies) if encoded is None else encoded
        return [self.end.digest_after(e) for e in encoded]

    def replies_encoded(self, replies: Sequence[Message]) -> list[bytes]:
        """Each reply's canonical form after these messages, as ``continuations`` hashes it. Made
        once for the same reply objects: a turn's continuations and its reply pairs
        (datapool.edits.pair_continuations) both read them."""
        if self.replied is not None and len(self.replied[0]) == len(replies) \
                and all(a is b for a, b in zip(self.replied[0], replies)):
            return self.replied[1]
        out = [self.end.copy().encode(reply) for reply in replies]
        self.replied = (list(replies), out)
        return out


def link_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """(index, hash of messages[: index + 1]) for every assistant message, longest prefix first.

    A continuing request's prefix ends with the reply it continues, so only prefixes that end
    at an assistant message can match an earlier turn.
    """
    return Prefixes(messages).links()


def continuation_hashes(messages: Sequence[Message], replies: Sequence[Message]) -> list[str]:
    """For each choice's reply, the hash a request continuing with that reply starts with."""
    return Prefixes(messages).continuations(replies)


def after_last_assistant(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i + 1
    return len(messages)


_SYSTEM_ROLES = ("system", "developer")
_RETRY = -1  # the choice_index of a turn's request hash (see request_hash)


def system_free_index(choice: int) -> int:
    """The choice_index of a choice's continuation without the system messages (-2, -3, ...)."""
    return -2 - choice


def request_hash(messages: Sequence[Message]) -> str:
    """The key under which a turn's own request is found by a request that extends it without a
    reply in between: a retry of a failed or cancelled call, or an agent that dropped the reply
    (mini-swe-agent drops one that made no tool call and says so in a new user message). Salted,
    so it never equals a continuation of a reply."""
    return Prefixes(messages).request()


def _salted(history: str) -> str:
    return hashlib.sha256(b"request\x1e" + history.encode()).hexdigest()


class Continuation(NamedTuple):
    hash: str
    choice_index: int  # the reply's choice; _RETRY for the request hash
    prefix: int  # how many messages a request continuing by this hash starts with


def continuations_of(r: TurnRecord, prefixes: Prefixes | None = None,
                     system_free: Prefixes | None = None) -> list[Continuation]:
    """What a request continuing *r* may start with: each choice's reply after the messages,
    the same without the system (and developer) messages for an agent that drops them on the
    next call, and the request itself (request_hash). *prefixes* and *system_free*: the
    :class:`Prefixes` of its messages and of them without the system ones, if already made."""
    if r.turn_type != TurnKind.MAIN or r.endpoint != Endpoint.CHAT:
        return []
    messages = r.messages
    whole = prefixes or Prefixes(messages)
    out = [Continuation(whole.request(), _RETRY, len(messages))] if messages else []
    if r.status != TurnStatus.OK:
        return out
    replies = r.replies
    encoded = whole.replies_encoded(replies)
    out += [Continuation(h, i, len(messages) + 1) for i, h in enumerate(whole.continuations(replies, encoded))]
    if system_free is None:
        kept = _without_system(messages)
        system_free = whole.kept(kept) if len(kept) < len(messages) else None
    if system_free is not None and system_free.messages:
        same = encoded if system_free.source is whole.source else None
        out += [Continuation(h, system_free_index(i), len(system_free.messages) + 1)
                for i, h in enumerate(system_free.continuations(replies, same))]
    return out


def _without_system(messages: Sequence[Message]) -> list[int]:
    """The indices of the messages that are not system (or developer) messages."""
    return [i for i, m in enumerate(messages) if m.get("role") not in _SYSTEM_ROLES]


def system_free_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """link_candidates of the messages without their system (and developer) messages, each
    index that of the assistant message in *messages*: what a request finds the turns by that
    were sent without the system prompt. Empty when there is none to leave out."""
    kept = _without_system(messages)
    if len(kept) == len(messages):
        return []
    return _system_free_links(kept, Prefixes([messages[i] for i in kept]))


def _system_free_links(kept: list[int], rest: Prefixes) -> list[tuple[int, str]]:
    return [(kept[i], h) for i, h in rest.links()]


def retry_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """(k, request_hash(messages[:k])) for every prefix that covers the last assistant message,
    longest first: the turns a request extends without their reply (a retry when k is all of it)."""
    return Prefixes(messages).retries()


class Prepared(NamedTuple):
    """A record with every hash stitching needs of it (see prepare)."""

    record: TurnRecord
    candidates: list[tuple[int, str]]  # link_candidates of its messages
    continuations: list[Continuation]  # what a request continuing it starts with
    retries: list[tuple[int, str]]  # retry_candidates of its messages
    system_free: list[tuple[int, str]]  # system_free_candidates of its messages


def longest_end(p: Prepared) -> int:
    """Where what a record appended begins if its longest candidate matched."""
    return p.candidates[0][0] + 1 if p.candidates else 0


def tenant_hash(tenant: str | None, h: str) -> str:
    """A stitching hash of a tenant's turn: only the same tenant's requests find it, so the same
    conversation sent by two tenants never joins one session. Unchanged without a tenant."""
    return h if tenant is None else hashlib.sha256(f"tenant\x1e{tenant}\x1e{h}".encode()).hexdigest()


def prepare(r: TurnRecord, whole: Prefixes | None = None) -> Prepared:
    """Every hash stitching needs of a record, from one pass over its messages (*whole*, if the
    caller made it) and one over them without the system messages (when it has any)."""
    whole = Prefixes(r.messages) if whole is None else whole
    kept = _without_system(whole.messages)
    rest = whole.kept(kept) if len(kept) < len(whole.messages) else None
    return Prepared(r, whole.links(), continuations_of(r, whole, rest),
                    whole.retries() if r.turn_type == TurnKind.MAIN else [],
                    _system_free_links(kept, rest) if rest is not None else [])


def tenant_scoped(p: Prepared) -> Prepared:
    """*p* with every hash scoped to its record's tenant (tenant_hash)."""
    t = p.record.tenant
    if t is None:
        return p
    return Prepared(p.record, [(i, tenant_hash(t, h)) for i, h in p.candidates],
                    [c._replace(hash=tenant_hash(t, c.hash)) for c in p.continuations],
                    [(k, tenant_hash(t, h)) for k, h in p.retries],
                    [(i, tenant_hash(t, h)) for i, h in p.system_free])

