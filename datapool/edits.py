"""Matching that tolerates edits: a request continues an earlier turn when its messages hold that
turn's history and reply as an ordered subsequence once the system prompt, inserted summaries and
instructions are left out, not only as a prefix; and the shape of a summarisation call.

Prefix matching (datapool.canonical) finds the turn a request continues with one lookup of a
hash of its whole history. This module is the fallback stitching takes when no turn continues
the request's whole history (datapool.sessions): the request's (message, reply) pairs are looked
up by :func:`pair_key`, stored for every turn's replies, and the turns found are checked message
by message (:func:`align`). The rules are in docs/sessions.md#edited-histories.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from base.jsonfast import canonical_dumps
from base.vocab import Endpoint, TurnKind, TurnStatus
from datapool.canonical import Continuation, Message, Prefixes, Prepared, canonical_message, continuations_of

_SYSTEM_ROLES = ("system", "developer")

# how a turn continues its parent when its request is not the parent's history plus reply
RECOVERY = "recovery"  # the history again without system prompt or tools, asking for the answer
COMPACTION_INSERT = "compaction-insert"  # a summary inserted before (or among) the messages kept
COMPACTION_REPLACE = "compaction-replace"  # a summary in place of the earlier messages
FORK = "fork"  # continues a turn another turn already continued
RETRY = "retry"  # the same messages as a turn that failed
SUMMARY = "summary"  # a side turn summarising the session's history
EDIT_KINDS = (RECOVERY, COMPACTION_INSERT, COMPACTION_REPLACE, FORK, RETRY, SUMMARY)

# the choice_index under which a turn's reply pairs (-1000, -1001, ...) and its request tail are
# stored in turn_continuations
REPLY_PAIR_BASE = -1000
TAIL_INDEX = -999
NO_REPLY = -1  # the "choice" of a request tail: the turn's request without its reply


def reply_pair_index(choice: int) -> int:
    return REPLY_PAIR_BASE - choice


def choice_of(choice_index: int) -> int:
    """The choice a reply pair's choice_index names; NO_REPLY for a request tail."""
    return NO_REPLY if choice_index == TAIL_INDEX else REPLY_PAIR_BASE - choice_index


def is_pair_index(choice_index: int) -> bool:
    """Whether a continuation row is a reply pair or a request tail (this module's keys)."""
    return choice_index <= TAIL_INDEX


def is_system_free_index(choice_index: int) -> bool:
    """Whether a continuation's choice_index is one of a system-free continuation (-2, -3, ...)."""
    return TAIL_INDEX < choice_index <= -2


# -- the loose form: one message compared on its own ------------------------------------------------


# what agents add around a person's words and leave out when they replay them in an edited history:
# an arrival stamp before them, a line of session facts after them (OpenClaw's recovery pass sends
# the bare words of a first message whose every other replay carries both)
_ARRIVAL_STAMP = re.compile(r"\A\[[A-Z][a-z]{2} \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})? [A-Za-z+\-0-9:]+\]\s*")
_RUNTIME_LINE = re.compile(r"(?m)^Runtime: .*\bsessionId=.*$")


def _words(text: str) -> str:
    if text.startswith("["):
        text = _ARRIVAL_STAMP.sub("", text)
    if "Runtime: " in text:
        text = _RUNTIME_LINE.sub("", text)
    return text.strip()


def _loose(m: Message) -> dict[str, Any]:
    """canonical_message, with a user message's text reduced to the person's words (_words)."""
    canon = canonical_message(m)
    if m.get("role") == "user":
        content = canon["content"]
        canon["content"] = _words(content) if isinstance(content, str) else [
            _words(c) if isinstance(c, str) else c for c in content]
    return canon


def _digest(canon: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_dumps(canon).encode()).hexdigest()[:32]


def _call_of(messages: Sequence[Message], call_id: Any) -> list[Any]:
    """The call a tool result answers, as loose_forms names it: the latest call with that id."""
    for m in reversed(messages):
        for k, call in enumerate(m.get("tool_calls") or () if isinstance(m, dict) else ()):
            if isinstance(call, dict) and call.get("id") == call_id:
                return [k, *canonical_message({"role": "assistant", "tool_calls": [call]})["tool_calls"][0]]
    return ["unknown", call_id]


def loose_forms(messages: Sequence[Message]) -> list[str | None]:
    """Each message's canonical form (datapool.canonical) made independent of what precedes it, as
    a short digest; None for a system or developer message. A tool result's ``tool_call_id`` is
    replaced by the call it answers in the same history (function, arguments, place in its
    message), so results compare equal however the ids were rewritten and whichever earlier
    messages were left out."""
    calls: dict[str, Any] = {}
    out: list[str | None] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") in _SYSTEM_ROLES:
            out.append(None)
            continue
        canon = _loose(m)
        for k, call in enumerate(m.get("tool_calls") or ()):
            if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]:
                calls[call["id"]] = [k, *canon["tool_calls"][k]]
        if "tool_call_id" in canon:
            canon["tool_call_id"] = calls.get(str(m.get("tool_call_id")), ["unknown", canon["tool_call_id"]])
        out.append(_digest(canon))
    return out


def loose_form_at(messages: Sequence[Message], i: int) -> str | None:
    """``loose_forms(messages)[i]``, reading only what that message needs of the ones before it."""
    m = messages[i]
    if not isinstance(m, dict) or m.get("role") in _SYSTEM_ROLES:
        return None
    canon = _loose(m)
    if "tool_call_id" in canon:
        found = _call_of(messages[:i], m.get("tool_call_id"))
        canon["tool_call_id"] = found if found[0] != "unknown" else ["unknown", canon["tool_call_id"]]
    return _digest(canon)


def loose_form_in(prefixes: Prefixes, i: int) -> str | None:
    """``loose_form_at(prefixes.messages, i)`` from the canonical forms *prefixes* made of the
    messages: a loose form is the message's canonical form, changed only in a user message's text
    (_words) and a tool result's call, so mostly it is hashed as it is and nothing is made again."""
    messages = prefixes.messages
    m = messages[i]
    if not isinstance(m, dict) or m.get("role") in _SYSTEM_ROLES:
        return None
    canon = prefixes.canon[i]
    if "tool_call_id" in canon:
        if m.get("tool_calls"):  # its own calls name the id on its own (canonical_message): made anew
            return loose_form_at(messages, i)
        call_id = m.get("tool_call_id")
        canon = dict(canon, tool_call_id=_call_in(prefixes, i, call_id) or ["unknown", call_id])
    if m.get("role") == "user":
        content = canon["content"]
        words = _words(content) if isinstance(content, str) else [
            _words(c) if isinstance(c, str) else c for c in content]
        if words != content:
            canon = dict(canon, content=words)
    if canon is prefixes.canon[i]:
        return hashlib.sha256(prefixes.encoded[i]).hexdigest()[:32]
    return _digest(canon)


def _call_in(prefixes: Prefixes, i: int, call_id: str) -> list[Any] | None:
    """_call_of over the messages before *i*, its call's canonical form read from *prefixes*; None
    where no call has that id."""
    for j in range(i - 1, -1, -1):
        calls = prefixes.messages[j].get("tool_calls")
        if isinstance(calls, list):
            for k, call in enumerate(calls):
                if isinstance(call, dict) and call.get("id") == call_id:
                    return [k, *prefixes.canon[j]["tool_calls"][k]]
    return None


def system_of(messages: Sequence[Message]) -> str | None:
    """A digest of a history's system and developer messages in canonical form; None without any."""
    system = [canonical_message(m) for m in messages if isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES]
    if not system:
        return None
    return hashlib.sha256(canonical_dumps(system).encode()).hexdigest()[:32]


def pair_key(prompt: str, reply: str) -> str:
    """The key a (last message, reply) pair is stored and looked up under."""
    return hashlib.sha256(f"reply-pair\x1e{prompt}\x1e{reply}".encode()).hexdigest()


def tail_key(before: str, last: str) -> str:
    """The key a turn's request is found by without its reply: its last two non-system messages."""
    return hashlib.sha256(f"request-tail\x1e{before}\x1e{last}".encode()).hexdigest()


def _last_two(messages: Sequence[Message], prefixes: Prefixes | None = None) -> tuple[str | None, str | None]:
    """The loose forms of a request's last two non-system messages (before, last); None where
    there is no such message. *prefixes*: the Prefixes of *messages*, to make them from."""
    found = [i for i in range(len(messages) - 1, -1, -1)
             if isinstance(messages[i], dict) and messages[i].get("role") not in _SYSTEM_ROLES][:2]
    if prefixes is None:
        forms = [loose_form_at(messages, i) for i in found] + [None, None]
    else:
        forms = [loose_form_in(prefixes, i) for i in found] + [None, None]
    return forms[1], forms[0]


def request_tail(messages: Sequence[Message]) -> str | None:
    """The tail key of a turn's request (None with fewer than two non-system messages)."""
    before, last = _last_two(messages)
    return tail_key(before, last) if before is not None and last is not None else None


def request_tails(messages: Sequence[Message], forms: Sequence[str | None]) -> list[tuple[int, str]]:
    """(j, tail key of the non-system messages before and at j) for every j from the last assistant
    message on: where the history of a turn that the request goes on from without its reply may end."""
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last_assistant is None:
        return []
    out: list[tuple[int, str]] = []
    prev: str | None = None
    for j, f in enumerate(forms):
        if f is None:
            continue
        if prev is not None and j >= last_assistant:
            out.append((j, tail_key(prev, f)))
        prev = f
    out.reverse()
    return out


def reply_pairs(messages: Sequence[Message], replies: Sequence[Message]) -> list[str]:
    """For each choice, the pair key of the turn's last non-system message and that reply (none
    when the turn sent no other message)."""
    last = next((i for i in range(len(messages) - 1, -1, -1)
                 if isinstance(messages[i], dict) and messages[i].get("role") not in _SYSTEM_ROLES), None)
    return [] if last is None else _pairs(loose_form_at(messages, last), replies)  # type: ignore[arg-type]


def _pairs(prompt: str, replies: Sequence[Message], prefixes: Prefixes | None = None) -> list[str]:
    """The pair key of *prompt* (a loose form) and each reply that is a dict. A reply's loose form is
    its canonical form hashed as it is unless it is a user message or names a tool call (_loose, a
    tool result's call); its canonical form is *prefixes*' (the Prefixes of the request's messages:
    Prefixes.replies_encoded, made once for a turn's continuations and its pairs) or, without one,
    its own: the same, as only a tool_call_id's number depends on the messages before it."""
    replies = [reply for reply in replies if isinstance(reply, dict)]
    encoded = (prefixes.replies_encoded(replies) if prefixes is not None
               else [canonical_dumps(canonical_message(reply)).encode() for reply in replies])
    return [pair_key(prompt, _digest(_loose(reply)) if reply.get("role") == "user" or reply.get("tool_call_id")
                     else hashlib.sha256(e).hexdigest()[:32])
            for reply, e in zip(replies, encoded)]


def request_pairs(messages: Sequence[Message], forms: Sequence[str | None] | None = None) -> list[tuple[int, str]]:
    """(index of the assistant message, pair key of it and the non-system message before it) for
    every assistant message of a request, latest first; *forms*: ``loose_forms(messages)``, when
    the caller has them."""
    forms = loose_forms(messages) if forms is None else forms
    out: list[tuple[int, str]] = []
    prev: str | None = None
    for i, (m, f) in enumerate(zip(messages, forms)):
        if f is None:
            continue
        if prev is not None and m.get("role") == "assistant":
            out.append((i, pair_key(prev, f)))
        prev = f
    out.reverse()
    return out


# -- summaries and instructions ---------------------------------------------------------------------

_SUMMARY_WORDS = re.compile(r"(?i)\b(?:summar(?:y|ies|ise|ize|ised|ized|isation|ization)|compact(?:ed|ion)?|condensed)\b")
_HISTORY_WORDS = re.compile(r"(?i)\b(?:conversation|transcript|history|context|session|chat|discussion)\b")
# a role label opening a line of an embedded transcript: "[user]", "User:", "**Assistant:**", "<assistant>", "## Tool"
_ROLE_LINE = re.compile(
    r"(?im)^[ \t]*(?:\[|<|\*\*|#{1,4}[ \t]*)?(user|human|person|assistant|ai|model|agent|tool(?:[ _]result)?)"
    r"(?:\]|>|\*\*|:|[ \t]*\()")
_ASSISTANT_ROLES = {"assistant", "ai", "model", "agent"}
# an instruction to summarise the messages before it is an agent's (a side turn) from this length on
APPENDED_MIN_CHARS = 200


def text_of(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def is_summary_message(message: Message) -> bool:
    """A message that reads as an agent's summary of earlier messages (what a compaction inserts):
    a user or system message that speaks of a summary of the conversation."""
    if message.get("role") not in ("user", "system", "developer") or message.get("tool_calls"):
        return False
    text = text_of(message)
    return bool(_SUMMARY_WORDS.search(text) and _HISTORY_WORDS.search(text))


def embedded_transcript(text: str) -> bool:
    """Whether *text* carries a transcript: lines labelled by a person's and an assistant's role."""
    roles = {m.group(1).lower() for m in _ROLE_LINE.finditer(text)}
    return bool(roles & _ASSISTANT_ROLES) and bool(roles - _ASSISTANT_ROLES)


def summary_shape(messages: Any, has_tools: bool) -> str | None:
    """How a request is a summarisation call, by its shape and not by any client's wording:

    - ``embedded``: an instruction to summarise (system or user) and one user message that
      embeds a transcript (lines labelled with a person's and an assistant's role), no
      assistant message;
    - ``appended``: the conversation as messages (at least one assistant reply), then a last user
      message of at least APPENDED_MIN_CHARS that speaks of a summary of the conversation, and no
      tools declared (an agent's own calls declare its tools).
    None for anything else."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None
    users = [m for m in messages if m.get("role") == "user"]
    if any(m.get("role") == "assistant" for m in messages):
        last = messages[-1]
        if has_tools or last.get("role") != "user":
            return None
        # an agent's instruction, not a person's question ("summarise what we said")
        return "appended" if len(text_of(last)) >= APPENDED_MIN_CHARS and is_summary_message(last) else None
    if len(users) != 1 or has_tools:
        return None
    instruction = " ".join(text_of(m) for m in messages)
    if not (_SUMMARY_WORDS.search(instruction) and embedded_transcript(text_of(users[0]))):
        return None
    return "embedded"


# -- aligning a request with an earlier turn ----------------------------------------------------------


class Alignment(NamedTuple):
    """How a request holds an earlier turn's history and reply."""

    reply_at: int  # the index in the request of the turn's reply
    tail: int  # how many of the turn's non-system messages and its reply the request holds, in order
    whole: bool  # all of them
    edit: str | None  # compaction-insert, compaction-replace or None
    dropped_system: bool  # the turn had a system prompt the request does not


def align(request: Sequence[Message], request_forms: Sequence[str | None], reply_at: int,
          history: Sequence[Message], history_forms: Sequence[str | None]) -> Alignment | None:
    """Whether *request* holds *history* (a turn's request messages) and the reply at *reply_at*
    (the pair key matched there), and how; None when it does not.

    The turn's non-system messages are matched backwards from the reply, each at the latest place
    it can be. Every request message left over before the reply must be a summary (inserted:
    ``compaction-insert``) or one of the turn's own messages repeated; where the turn's earlier
    messages are missing, a summary must stand in for them (``compaction-replace``), and every
    request message after that summary must be matched. A request without the turn's system
    prompt that holds its whole history may be a recovery pass (the stitcher knows its tools).
    A request whose system prompt differs from the turn's continues nothing of it (one without
    any, or a turn without any, may)."""
    theirs = system_of(history)
    ours = system_of([m for m, f in zip(request[:reply_at], request_forms) if f is None])
    if theirs is not None and ours is not None and theirs != ours:
        return None
    wanted = [f for f in history_forms if f is not None]
    i, k = len(wanted) - 1, reply_at - 1
    skipped: list[int] = []
    while i >= 0 and k >= 0:
        form = request_forms[k]
        if form is None:
            k -= 1
            continue
        if form == wanted[i]:
            i -= 1
        else:
            skipped.append(k)
        k -= 1
    skipped += [j for j in range(k, -1, -1) if request_forms[j] is not None]
    own = set(wanted)
    summaries = [j for j in skipped if is_summary_message(request[j])]
    strays = [j for j in skipped if j not in summaries and request_forms[j] not in own]
    if strays:
        return None
    tail = len(wanted) - 1 - i + 1
    if i >= 0:  # the turn's earliest messages are missing: a summary must replace them
        if not summaries or tail < 2:
            return None
        last_summary = max(summaries)
        if any(j > last_summary for j in skipped):
            return None
        return Alignment(reply_at, tail, False, COMPACTION_REPLACE, False)
    dropped = theirs is not None and ours is None
    return Alignment(reply_at, tail, True, COMPACTION_INSERT if summaries else None, dropped)


def transcript_overlap(transcript: str, history: Sequence[Message], reply: Message | None) -> int:
    """How many of a turn's non-system messages (and its reply) with text appear in *transcript*
    in order, compared without whitespace (a transcript wraps lines and joins text parts its own way); 0 unless the last of them with text and the last user
    message (the person's latest words, which a summary of the session holds) are among them."""
    flat = "".join(transcript.split())
    said = [(m.get("role"), "".join(text_of(m).split())) for m in [*history, *([reply] if reply else [])]
            if m.get("role") not in _SYSTEM_ROLES]
    said = [(role, t) for role, t in said if t]
    if not said:
        return 0
    last_user = max((n for n, (role, _) in enumerate(said) if role == "user"), default=None)
    found, at = 0, 0
    needed = {len(said) - 1} | ({last_user} if last_user is not None else set())
    for n, (_, t) in enumerate(said):
        where = flat.find(t, at)
        if where >= 0:
            found += 1
            at = where + len(t)
            needed.discard(n)
    return 0 if needed else found


# -- what a turn stores for this -----------------------------------------------------------------------


def pair_continuations(r: Any, prefixes: Prefixes | None = None) -> list[Continuation]:
    """The keys a main chat turn is found by here (turn_continuations rows): its request tail
    (choice_index TAIL_INDEX), and if it answered, its reply pairs (:func:`reply_pair_index`).
    *prefixes*: the Prefixes of its messages, if made (prepare): the loose forms come from its
    canonical forms instead of canonicalising the messages again."""
    if r.turn_type != TurnKind.MAIN or r.endpoint != Endpoint.CHAT:
        return []
    messages = r.messages if prefixes is None else prefixes.messages
    # request_tail and reply_pairs, with the last non-system message's loose form made once
    before, last = _last_two(messages, prefixes)
    out: list[Continuation] = []
    if before is not None and last is not None:
        out.append(Continuation(tail_key(before, last), TAIL_INDEX, len(messages)))
    if r.status == TurnStatus.OK and last is not None:
        out += [Continuation(h, reply_pair_index(i), 0) for i, h in enumerate(_pairs(last, r.replies, prefixes))]
    return out


def stored_continuations(r: Any) -> list[Continuation]:
    """Every turn_continuations row of a record: continuations_of and its reply pairs."""
    return [*continuations_of(r), *pair_continuations(r)]


def with_pairs(p: Prepared, prefixes: Prefixes | None = None) -> Prepared:
    """*p* with its record's reply pairs among its continuations (*prefixes*: see pair_continuations)."""
    pairs = pair_continuations(p.record, prefixes)
    return p._replace(continuations=[*p.continuations, *pairs]) if pairs else p
