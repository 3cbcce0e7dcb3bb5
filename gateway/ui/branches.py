"""The session page's branch view: the trajectory graph of a session's main turns
(docs/sessions.md#the-trajectory-graph-histories-that-are-not-append-only) as a tree, each turn
under the turn it continues (``turns.parent_turn_id``), with how it continues it.

The pool stores only the parent; how a turn continues it is read back here from the two
requests, compared in the stitcher's canonical form (``datapool.canonical.history_hash``):

- ``fork``: the parent's next state came from another turn (the parent has more than one child);
- ``retry``: the same messages as a parent that failed or was cancelled;
- ``same request``: the same messages as a parent that answered (a session key joined them);
- ``resumed``: the parent's messages, then more, without the parent's reply (a cancelled or failed
  call gone on from, or a reply the agent dropped: ``reply dropped``);
- ``no system prompt`` / ``system prompt again``: it continues the parent once the system (and
  developer) messages are left out of both;
- ``summary``: it shares no history with its parent (a summary replaced the earlier messages;
  such a turn is tied to its session by the agent's session key);
- ``start`` / ``new start``: no parent, first in the session or not.

An edit the stitcher recorded on the turn (``turns.edit``, datapool.edits) labels the edge to its
parent: ``recovery pass`` (the history once more without system prompt and tools, asking for the
answer), ``summary inserted`` (before the messages kept), ``summary in place of history`` (the
earlier messages replaced); such a turn is not marked ``summary`` as well. A summarisation side
call the stitcher tied to a turn is drawn as an edge leaving that turn (``summarised by``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from datapool import browse
from datapool.canonical import history_hash
from base.vocab import TurnKind, TurnStatus

_SYSTEM = ("system", "developer")
# the label of the edge from a turn to its parent, by the edit recorded on the turn
EDGE_LABELS = {"recovery": "recovery pass", "compaction-insert": "summary inserted",
               "compaction-replace": "summary in place of history"}


@dataclass
class Node:
    turn: dict[str, Any]
    marks: list[str]
    said: str  # the last message the turn's request added, for a person to recognise it
    children: list[Node] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)  # side calls that summarised up to here

    @property
    def edge(self) -> str | None:
        """The label of the edge to the parent: the edit recorded on the turn, if one is drawn."""
        return EDGE_LABELS.get(self.turn.get("edit") or "") if self.parent_id else None

    @property
    def id(self) -> str:
        return str(self.turn["id"])

    @property
    def parent_id(self) -> str | None:
        return self.turn.get("parent_turn_id")

    def main_child(self) -> Node | None:
        """The child that gave this turn its next state (else the first): the line goes on there."""
        given = (self.turn.get("next_state") or {}).get("turn_id")
        return next((c for c in self.children if c.id == given), self.children[0] if self.children else None)


@dataclass
class Graph:
    roots: list[Node]
    nodes: dict[str, Node]

    @property
    def branches(self) -> bool:
        """Whether it is more than one line of turns each continuing the one before as it was sent."""
        return len(self.roots) > 1 or any(len(n.children) > 1 or (set(n.marks) - {"start"}) for n in self.nodes.values())


    def rows(self) -> list[tuple[Node, int]]:
        """Every node with its depth, for a flat list: a turn, then the branches that leave it (one
        level deeper), then the turn it handed its next state to (the same level: a line of turns
        does not indent)."""
        out: list[tuple[Node, int]] = []
        stack = [(n, 0) for n in reversed(self.roots)]
        while stack:
            node, depth = stack.pop()
            out.append((node, depth))
            main = node.main_child()
            if main is not None:
                stack.append((main, depth))
            stack += [(c, depth + 1) for c in reversed(node.children) if c is not main]
        return out


def _messages(t: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in (t.get("request") or {}).get("messages") or [] if isinstance(m, dict)]


def _replies(t: dict[str, Any]) -> list[dict[str, Any]]:
    choices = (t.get("response") or {}).get("choices") or []
    return [c.get("message") for c in choices if isinstance(c, dict) and isinstance(c.get("message"), dict)]


def _same(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    return len(a) == len(b) and history_hash(a) == history_hash(b)


def _how(child: list[dict[str, Any]], parent: list[dict[str, Any]], replies: list[dict[str, Any]],
         failed: bool) -> str | None:
    """How messages *child* continue a request *parent* answered with *replies*; None if they do not."""
    if _same(child, parent):
        return "retry" if failed else "same request"
    n = len(parent)
    if len(child) > n and _same(child[:n], parent) and child[n].get("role") != "assistant":
        return "resumed" if failed else "reply dropped"
    if len(child) > n and any(_same(child[: n + 1], [*parent, r]) for r in replies):
        return "continues"
    return None


def marks_of(turn: dict[str, Any], parent: dict[str, Any] | None, first: bool) -> list[str]:
    """What the branch view says of how *turn* continues *parent* (module docstring)."""
    if parent is None:
        return ["start" if first else "new start"]
    out: list[str] = []
    child, before = _messages(turn), _messages(parent)
    failed = parent.get("status") != TurnStatus.OK
    how = _how(child, before, _replies(parent), failed)
    if how is None:
        plain_child = [m for m in child if m.get("role") not in _SYSTEM]
        plain_before = [m for m in before if m.get("role") not in _SYSTEM]
        how = _how(plain_child, plain_before, _replies(parent), failed)
        if how is not None:
            out.append("no system prompt" if len(plain_child) == len(child) else "system prompt again")
    if how is None and turn.get("edit") not in EDGE_LABELS:
        out.append("summary")
    elif how != "continues":
        out.append(how)
    state = parent.get("next_state") or {}
    if state.get("turn_id") not in (None, turn["id"]) and how not in ("retry", "resumed"):
        out.append("fork")
    return out


def _said(t: dict[str, Any]) -> str:
    messages = _messages(t)
    if not messages:
        return ""
    last = messages[-1]
    text = " ".join(browse.content_text(last.get("content")).split())
    if not text and last.get("tool_calls"):
        text = "tool call"
    return f"{last.get('role', '?')}: {text[:80]}{'…' if len(text) > 80 else ''}"


def graph(turns: Sequence[dict[str, Any]]) -> Graph:
    """The session's main turns (in the order given: created_at) as a tree of who continues whom."""
    main = [t for t in turns if t.get("turn_type", TurnKind.MAIN) == TurnKind.MAIN]
    by_id = {t["id"]: t for t in main}
    nodes = {t["id"]: Node(t, marks_of(t, by_id.get(t.get("parent_turn_id") or ""), first=i == 0), _said(t))
             for i, t in enumerate(main)}
    for t in turns:
        if t.get("turn_type") == TurnKind.SIDE and t.get("edit") == "summary" and t.get("parent_turn_id") in nodes:
            nodes[t["parent_turn_id"]].summaries.append(t)
    roots: list[Node] = []
    for node in nodes.values():
        parent = nodes.get(node.parent_id or "")
        (parent.children if parent is not None else roots).append(node)
    return Graph(roots, nodes)
