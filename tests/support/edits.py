"""Generated sessions whose agent edits its history (docs/sessions.md#edited-histories): a recovery
pass, a summary inserted before the messages kept, a summary in place of the earlier messages, a
fork, a retry, a summarisation call (its transcript embedded, or the history with the instruction
appended), each over a random conversation with tool loops (tests.support.conversations) whose
requests are rewritten as real clients do (tool-call ids stripped or re-minted, arguments
re-serialised, text as parts, ...). Each planned turn carries the session it belongs to, the parent
and edit the pool must record, and its parent's next state.

Used by tests/datapool/test_edits.py and benchmarks/edits/run.py.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from datapool.records import TurnRecord
from tests.support.conversations import STAMPS, Step, draw_steps, requests, rewrite
from tests.support.records import turn_record

T0 = datetime(2026, 11, 29, tzinfo=timezone.utc)
KINDS = ("recovery", "compaction-insert", "compaction-replace", "fork", "retry", "summary-embedded",
         "summary-appended")
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("read", "exec", "web_search", "edit")]
# different agents' wording: the shape, not the words, makes a summary or a summarisation call
SUMMARY_TEXTS = [
    "The conversation history before this point was compacted into the following summary:\n\n<summary>{}</summary>",
    "This session is being continued from a previous conversation that ran out of context. "
    "The conversation is summarized below:\n{}",
    "Summary of the earlier discussion: {}",
]
INSTRUCTIONS = [
    "You are a context summarization assistant. Read the conversation and produce a structured summary.",
    "Summarise the following transcript so that the agent can continue the task from it.",
    "Create a concise summary of this chat history, keeping file names and decisions.",
]
APPENDED = ("Your task is to create a detailed summary of the conversation so far, paying close attention "
            "to the user's explicit requests and your previous actions. This summary should be thorough in "
            "capturing technical details, code patterns, and architectural decisions that would be "
            "essential for continuing the work without losing context.")
LABELS = [("[user]", "[assistant]", "[tool]"), ("User:", "Assistant:", "Tool result:"),
          ("**User:**", "**Assistant:**", "**Tool:**"), ("<user>", "<assistant>", "<tool>")]


@dataclass
class Planned:
    record: TurnRecord
    session: int  # the generated session it belongs to
    parent: TurnRecord | None  # the turn it must record as its parent (None: not checked)
    edit: str | None = None  # the edit the pool must record on it
    appended_from: int | None = None  # its parent's next state: its messages from here on


@dataclass
class Clock:
    now: int = 0

    def tick(self) -> datetime:
        self.now += 1
        return T0 + timedelta(milliseconds=self.now)


def own_steps(r: random.Random, system: str) -> list[Step]:
    """A conversation whose person's words and first reply are its own (a token in each), so that
    any merge of two of them is a false one."""
    steps = draw_steps(r, system=system, rounds=r.randrange(2, 4))
    for s in steps:
        if s.role == "user" or s is next(x for x in steps if x.role == "assistant"):
            s.text = f"{s.text} {uuid.uuid4().hex[:12]}".strip()
    return steps


def _user_indices(messages: list[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "user"]


def _summary(r: random.Random) -> dict[str, Any]:
    text = r.choice(SUMMARY_TEXTS).format(f"the user asked for files; {uuid.uuid4().hex[:8]}")
    return {"role": "user", "content": [{"type": "text", "text": text}] if r.random() < 0.5 else text}


def _transcript(r: random.Random, messages: list[dict[str, Any]]) -> str:
    user, assistant, tool = r.choice(LABELS)
    lines = []
    for m in messages:
        label = {"user": user, "assistant": assistant, "tool": tool}.get(m.get("role", ""))
        if label is None:
            continue
        content = m.get("content")
        text = content if isinstance(content, str) else "".join(
            str(p.get("text") or "") for p in content or () if isinstance(p, dict))
        calls = " ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls") or ())
        lines.append(f"{label}\n{text or ''} {calls}".rstrip())
    return "\n\n".join(lines)


class Sender:
    """The turns one session sends, planned with what the pool must record of each."""

    def __init__(self, n: int, clock: Clock):
        self.n, self.clock = n, clock
        self.planned: list[Planned] = []

    def send(self, messages: list[dict[str, Any]], reply: dict[str, Any] | None, parent: TurnRecord | None, *,
             edit: str | None = None, appended_from: int | None = None, tools: bool = True, status: str = "ok",
             turn_type: str = "main") -> TurnRecord:
        rec = turn_record(messages, reply, at=self.clock.tick(), status=status,
                          params={"tools": TOOLS} if tools else {}, turn_type=turn_type)
        self.planned.append(Planned(rec, self.n, parent, edit, appended_from))
        return rec


def _openclaw_first_message(r: random.Random, steps: list[Step]) -> str:
    """Decorate the first user message as OpenClaw does (an arrival stamp before the words, its
    `Runtime:` line after them); returns the bare words its recovery pass sends instead."""
    first = next(s for s in steps if s.role == "user")
    words = first.text
    for stamp in STAMPS:  # one stamp, OpenClaw's own
        words = words.removeprefix(stamp)
    first.text = f"[Sun 2026-11-29 02:59 UTC] {words}\n\nRuntime: agent=main | sessionId=oc-{uuid.uuid4().hex[:10]} | host=vm"
    return words


def plan_session(r: random.Random, n: int, kind: str, clock: Clock, system: str) -> list[Planned]:
    """Session number *n*: its requests sent in order with the edit *kind* at a random request."""
    steps = own_steps(r, system)
    words = _openclaw_first_message(r, steps) if kind == "recovery" else ""
    reqs = requests(r, steps)
    cut = r.randrange(1, len(reqs))  # the request the edit happens at (never the first)
    sender = Sender(n, clock)
    send, out = sender.send, sender.planned
    records: list[TurnRecord] = []
    for k, q in enumerate(reqs[:cut]):
        records.append(send(q.messages, q.reply, records[-1] if records else None,
                            appended_from=len(reqs[k - 1].messages) + 1 if k else None))
    prev, q = records[-1], reqs[cut]
    before = len(reqs[cut - 1].messages)  # the index of prev's reply in q.messages
    systems = sum(m.get("role") == "system" for m in q.messages[:before])
    if kind == "recovery":
        # OpenClaw's: the history once more without system prompt and tools, the first user message
        # reduced to the person's words, and an instruction asking for the answer; half the time
        # after a call whose reply was empty, which the pass leaves out (it goes on from that call)
        empty = r.random() < 0.5
        if empty:
            prev = send(q.messages, {"role": "assistant", "content": " "}, prev, appended_from=before + 1)
        messages = [m for m in rewrite(r, q.messages) if m.get("role") != "system"]
        first = next(i for i, m in enumerate(messages) if m.get("role") == "user")
        messages[first] = {"role": "user", "content": words}
        messages.append({"role": "user", "content": "The previous assistant turn completed its tool calls but did "
                                                    "not produce a user-visible answer. Produce it now."})
        send(messages, {"role": "assistant", "content": f"done {uuid.uuid4().hex[:6]}"}, prev, edit="recovery",
             appended_from=len(messages) - 1 if empty else before - systems + 1, tools=False)
        return out
    if kind in ("summary-embedded", "summary-appended"):
        history = [*q.messages[:before], reqs[cut - 1].reply]
        if kind == "summary-embedded":
            body = f"<conversation>\n{_transcript(r, history)}\n</conversation>"
            messages = [{"role": "system", "content": r.choice(INSTRUCTIONS)}, {"role": "user", "content": body}]
        else:
            messages = [*rewrite(r, history), {"role": "user", "content": APPENDED}]
        send(messages, {"role": "assistant", "content": "summary"}, prev, edit="summary", tools=False,
             turn_type="side")
        return out
    if kind == "fork":
        if cut == 1:  # nothing continued yet to fork from: continue once first
            records.append(send(q.messages, q.reply, prev, appended_from=before + 1))
        back = r.randrange(0, len(records) - 1)  # a turn that already has its next state
        base = reqs[back]
        messages = [*rewrite(r, base.messages), base.reply, {"role": "user", "content": f"no, {uuid.uuid4().hex[:8]}"}]
        send(messages, {"role": "assistant", "content": "ok"}, records[back], edit="fork")
        return out
    if kind == "retry":
        failed = send(q.messages, None, prev, appended_from=before + 1, status="error")
        send(rewrite(r, q.messages), q.reply, failed, edit="retry")
        return out
    _compacted(r, reqs, cut, kind, sender, records)
    return out


def _compacted(r: random.Random, reqs: list[Any], cut: int, kind: str, sender: Sender,
               records: list[TurnRecord]) -> None:
    """From request *cut* on, every request carries one summary: inserted before the messages it
    keeps (after the system prompt, or later but before the last turn's last message), or in place
    of the messages before a user message after the first (compaction-replace)."""
    q = reqs[cut]
    before = len(reqs[cut - 1].messages)
    users = [i for i, m in enumerate(q.messages) if m.get("role") == "user"]
    later = [i for i in users[1:] if i < before]
    replace = kind == "compaction-replace" and bool(later)
    start = r.choice(later) if replace else 0
    systems = sum(m.get("role") == "system" for m in q.messages[:before])
    at = systems if replace or r.random() < 0.5 else r.randrange(systems, before)
    summary = _summary(r)
    last_len = 0
    send = sender.send
    for k in range(cut, len(reqs)):
        kept = [m for i, m in enumerate(reqs[k].messages) if i >= start or m.get("role") == "system"]
        messages = [*kept[:at], summary, *kept[at:]]
        if k == cut:
            reply_at = before - start + (systems if replace else 0) + 1
            send(messages, reqs[k].reply, records[-1], appended_from=reply_at + 1,
                 edit="compaction-replace" if replace else "compaction-insert")
        else:
            send(messages, reqs[k].reply, records[-1], appended_from=last_len + 1)
        records.append(sender.planned[-1].record)
        last_len = len(messages)


@dataclass
class Outcome:
    """What the pool recorded of generated sessions, against the plan."""

    sessions: int = 0
    turns: int = 0
    splits: int = 0  # generated sessions spread over more than one pool session
    false_merges: int = 0  # pool sessions holding turns of more than one generated session
    wrong_parent: int = 0
    wrong_edit: int = 0
    wrong_next_state: int = 0
    edits: dict[str, int] | None = None  # edits recorded as planned, by kind
    failures: list[str] | None = None  # the first few mismatches, for a person to read


def outcome(stored: dict[str, Any], planned: list[Planned]) -> Outcome:
    """*stored*: turn id -> its row (session_id, parent_turn_id, edit, next_state)."""
    out = Outcome(edits={}, failures=[])
    by_session: dict[int, set[str]] = {}
    by_pool: dict[str, set[int]] = {}
    for p in planned:
        t = stored[p.record.id]
        by_session.setdefault(p.session, set()).add(t.session_id)
        by_pool.setdefault(t.session_id, set()).add(p.session)
        bad = []
        if p.parent is not None and t.parent_turn_id != p.parent.id:
            out.wrong_parent += 1
            bad.append(f"parent {t.parent_turn_id} != {p.parent.id}")
        if t.edit != p.edit:
            out.wrong_edit += 1
            bad.append(f"edit {t.edit} != {p.edit}")
        elif p.edit is not None:
            out.edits[p.edit] = out.edits.get(p.edit, 0) + 1  # type: ignore[index]
        if p.appended_from is not None and p.parent is not None and p.parent.status == "ok":
            want = {"turn_id": p.record.id, "messages": p.record.messages[p.appended_from:]}
            if stored[p.parent.id].next_state != want:
                out.wrong_next_state += 1
                bad.append("next state")
        if bad and len(out.failures) < 5:  # type: ignore[arg-type]
            out.failures.append(f"session {p.session} {p.edit or 'plain'}: {', '.join(bad)}")  # type: ignore[union-attr]
    out.sessions, out.turns = len(by_session), len(planned)
    out.splits = sum(len(s) > 1 for s in by_session.values())
    out.false_merges = sum(len(s) > 1 for s in by_pool.values())
    return out
