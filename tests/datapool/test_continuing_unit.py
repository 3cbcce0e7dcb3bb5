"""datapool.stitch_reads.Continuing: the first turn passing a filter, in parent order, is the least
of all passing turns (what stitching took before the index), for any turns added in any order."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from base.vocab import TurnStatus
from datapool.stitch_reads import Continuing, StitchTurn

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

turns = st.lists(
    st.tuples(st.integers(0, 20), st.sampled_from(["s1", "s2", "s3"]),
              st.sampled_from([TurnStatus.OK, TurnStatus.OK, TurnStatus.ERROR, "cancelled"])),
    max_size=40,
)


def _turns(spec: list[tuple[int, str, str]]) -> list[StitchTurn]:
    # equal times on purpose: the id breaks the tie, as the pool's ORDER BY created_at, id does
    return [StitchTurn(id=f"t{i:03d}", session_id=session, created_at=T0 + timedelta(seconds=at), turn_type="main",
                       status=status, parent_id=None, has_next_state=False, stored=False)
            for i, (at, session, status) in enumerate(spec)]


@settings(max_examples=300, deadline=None)
@given(spec=turns, order=st.randoms(use_true_random=False), session=st.sampled_from([None, "s1", "s2"]),
       excluded=st.integers(0, 40))
def test_first_is_the_least_passing_turn(spec: list[tuple[int, str, str]], order, session: str | None,
                                         excluded: int) -> None:
    all_turns = _turns(spec)
    added = list(all_turns)
    order.shuffle(added)
    index = Continuing()
    for t in added + added[:3]:  # a turn added twice counts once
        index.add(t)
    assert len(index) == len(all_turns)

    def keep(t: StitchTurn) -> bool:
        return (session is None or t.session_id == session) and t.id != f"t{excluded:03d}"

    passing = [t for t in all_turns if keep(t)]
    assert index.first(keep) is min(passing, key=lambda t: t.order, default=None)
    assert index.first() is min(all_turns, key=lambda t: t.order, default=None)
    failed = [t for t in passing if t.status != TurnStatus.OK]
    assert index.first_failed(keep) is min(failed, key=lambda t: t.order, default=None)
    # a retry's choice (datapool.sessions._Batch._find_parent): an answered turn before a failed one
    best = min(passing, key=lambda t: (t.status != TurnStatus.OK, t.order), default=None)
    found = index.first(lambda t: t.status == TurnStatus.OK and keep(t)) or index.first_failed(keep)
    assert found is best
