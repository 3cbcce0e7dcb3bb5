"""The trajectory graph (docs/sessions.md): requests whose history is not an append-only extension
of the turn before still join its session and record the turn they continue as their parent.

A hypothesis property writes generated conversations through the real Stitcher, each request
sent with the rewrites of the matching tests, and on top of that, per request at random: sent
without its system prompt (the next one carries it again), or first sent and failed and then
retried with the same messages, or sent with a `<system-reminder>` of its own in the first user
message that the next request leaves out (Qwen Code's resume); and at the end one of: a fork
from an earlier turn, a call cancelled and the conversation resumed after it (Codex), a reply
dropped and the conversation gone on without it (mini-swe-agent), or nothing. Inferred and named (session key) sessions
alike: always one session, each turn's parent the turn it continues, each next state what the
request continuing it appended.
"""

from __future__ import annotations

import random
import uuid
from datetime import timedelta

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.models import Turn
from datapool.sessions import Stitcher
from tests.support.conversations import draw_steps, requests
from tests.support.records import turn_record
from tests.support.trajectories import T0, plan

SEEN: dict[str, int] = {}  # what the property generated, checked by the last test


# derandomized (generate only: no database of examples, no shrinking): the same 40 draws every run,
# so the last test's check that every case was generated cannot fail by chance
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.generate])
@given(r=st.randoms(use_true_random=False), batches=st.integers(1, 3),
       ending=st.sampled_from(["none", "fork", "cancelled and resumed", "reply dropped"]), named=st.booleans())
def test_forks_retries_and_dropped_system_prompts_stay_in_one_session(
        module_sqlite_engine: Engine, r: random.Random, batches: int, ending: str, named: bool) -> None:
    steps = draw_steps(r, system=f"agent run {uuid.uuid4().hex}")
    # what the person says is this conversation's own: without the system prompt, two
    # conversations that say the same are one history to anybody reading the requests
    steps[1].text = f"{uuid.uuid4().hex} {steps[1].text}"
    planned = plan(r, requests(r, steps), ending, f"s-{uuid.uuid4().hex[:12]}" if named else None, SEEN)
    records = [p.record for p in planned]
    cuts = sorted(r.sample(range(1, len(records)), min(batches - 1, len(records) - 1))) if len(records) > 1 else []
    for a, b in zip([0, *cuts], [*cuts, len(records)]):
        with OrmSession(module_sqlite_engine) as db, db.begin():
            Stitcher(db).write(records[a:b])
    with OrmSession(module_sqlite_engine) as db:
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_([x.id for x in records])))}
        db.expunge_all()
    shown = [(p.record.status, [m["role"] for m in p.record.messages], turns[p.record.id].session_id[:6])
             for p in planned]
    assert len({t.session_id for t in turns.values()}) == 1, (ending, shown)
    for p in planned:
        t = turns[p.record.id]
        assert t.parent_turn_id == (p.parent.id if p.parent else None), (ending, p.record.status)
        if p.appended_from is not None and p.parent is not None and p.parent.status == "ok":
            assert turns[p.parent.id].next_state == {"turn_id": p.record.id,
                                                     "messages": p.record.messages[p.appended_from:]}
    SEEN[ending] = SEEN.get(ending, 0) + 1
    SEEN["named" if named else "inferred"] = SEEN.get("named" if named else "inferred", 0) + 1


def test_every_case_was_generated() -> None:
    print(f"\ntrajectories: {SEEN}")
    assert {"plain", "no system", "retried", "reminded", "fork", "cancelled and resumed", "reply dropped", "none",
            "named", "inferred"} <= set(SEEN), SEEN


def test_a_fork_written_later_leaves_the_next_state_to_the_child_with_the_system_prompt_again(module_sqlite_engine: Engine) -> None:
    """A turn sent without the system prompt, continued by one that has it again (stored first),
    then forked in a later batch: the fork is a branch and does not take over the next state
    (the stored child is the parent's exact continuation once its system prompt is left out)."""
    system = {"role": "system", "content": f"agent run {uuid.uuid4().hex}"}
    first = [system, {"role": "user", "content": f"{uuid.uuid4().hex} list the files"}]
    a = turn_record(first, "a.txt", at=T0 + timedelta(seconds=1))
    b = turn_record([*first[1:], a.replies[0], {"role": "user", "content": "and b?"}],
                    "b.txt", at=T0 + timedelta(seconds=2))  # without the system prompt
    c = turn_record([system, *b.messages, b.replies[0], {"role": "user", "content": "thanks"}],
                    "ok", at=T0 + timedelta(seconds=3))  # with it again
    fork = turn_record([*b.messages, b.replies[0], {"role": "user", "content": "no, c"}],
                       "c.txt", at=T0 + timedelta(seconds=4))
    for batch in ([a, b, c], [fork]):
        with OrmSession(module_sqlite_engine) as db, db.begin():
            Stitcher(db).write(batch)
    with OrmSession(module_sqlite_engine) as db:
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_([a.id, b.id, c.id, fork.id])))}
        assert turns[c.id].parent_turn_id == b.id and turns[fork.id].parent_turn_id == b.id
        assert turns[b.id].next_state == {"turn_id": c.id, "messages": [{"role": "user", "content": "thanks"}]}
