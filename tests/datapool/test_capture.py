"""The write-behind capture writer and its spool, against a real PostgreSQL that goes away."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from datapool.capture import CaptureWriter, Spool, approx_bytes
from datapool.db import make_engine, upgrade
from datapool.models import Turn
from datapool.records import TurnRecord
from tests.support.holds import HeldPool
from tests.support.pg import ThrowawayPostgres
from tests.support.records import turn_record


def _record(i: int) -> TurnRecord:
    return turn_record([{"role": "user", "content": f"message {i} {uuid.uuid4().hex}"}], capture="black-box",
                       response_id="r")


def _stored_ids(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with OrmSession(engine) as db:
            return list(db.scalars(select(Turn.id)))
    finally:
        engine.dispose()


async def _until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_database_outage_spools_and_replays_exactly_once(pg_cluster: ThrowawayPostgres, tmp_path: Path) -> None:
    engine = make_engine(pg_cluster.dsn)
    spool = Spool(tmp_path / "spool")
    writer = CaptureWriter(engine, spool, flush_interval_s=0.01, retry_interval_s=0.2)
    writer.start()
    records = [_record(i) for i in range(60)]
    for r in records[:20]:
        writer.submit(r)
    await _until(lambda: len(_stored_ids(pg_cluster.dsn)) == 20)

    pg_cluster.kill()
    for r in records[20:40]:
        writer.submit(r)
    await _until(lambda: spool.records == 20)
    assert spool.path is not None and spool.path.stat().st_size > 0
    for r in records[40:]:
        writer.submit(r)
    await _until(lambda: spool.records == 40)

    pg_cluster.restart()
    await _until(lambda: not spool.pending)
    await writer.stop()
    engine.dispose()
    stored = _stored_ids(pg_cluster.dsn)
    assert sorted(stored) == sorted(r.id for r in records)


async def test_leftover_spool_is_replayed_by_the_next_process(pg_cluster: ThrowawayPostgres, tmp_path: Path) -> None:
    # a gateway that died with turns in its spool: the next one on this data dir replays them
    records = [_record(i) for i in range(5)]
    dead = Spool(tmp_path / "spool")
    dead.append(records)
    dead.append(records[3:])  # written twice (e.g. replay interrupted after commit): stored once
    dead.close()
    engine = make_engine(pg_cluster.dsn)
    writer = CaptureWriter(engine, Spool(tmp_path / "spool"), retry_interval_s=0.1)
    assert writer.spool.pending
    writer.start()
    await _until(lambda: not writer.spool.pending)
    await writer.stop()
    engine.dispose()
    assert sorted(_stored_ids(pg_cluster.dsn)) == sorted(r.id for r in records)


async def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    spool = Spool(tmp_path / "spool")
    records = [_record(i) for i in range(3)]
    spool.append(records)
    assert spool.path is not None
    with open(spool.path, "ab") as f:
        f.write(b'{"id": "torn-by-a-cra')  # the crash happened mid-append
    spool.close()
    engine = make_engine(url)
    spool = Spool(tmp_path / "spool")
    late = _record(3)
    spool.append([late])  # the next process appends before it replays: a line of its own
    assert spool.read() == [*records, late]
    writer = CaptureWriter(engine, spool, retry_interval_s=0.05)
    writer.start()
    await _until(lambda: not writer.spool.pending)
    await writer.stop()
    engine.dispose()
    assert sorted(_stored_ids(url)) == sorted(r.id for r in [*records, late])


async def test_unusable_spool_holds_turns_in_memory(tmp_path: Path) -> None:
    # a regular file where the spool directory should be: unusable even for root
    blocked = tmp_path / "spool"
    blocked.write_text("not a directory")
    spool = Spool(blocked)
    assert spool.error and "unusable" in spool.error
    records = [_record(0), _record(1)]
    spool.append(records)
    assert spool.pending and spool.read() == records
    spool.advance(spool.chunk(None))
    assert not spool.pending


async def test_two_spools_on_one_directory_take_different_files(tmp_path: Path) -> None:
    a, b = Spool(tmp_path), Spool(tmp_path)
    assert a.path != b.path
    a.close()
    c = Spool(tmp_path)
    assert c.path == a.path  # a freed slot is taken again
    b.close(), c.close()


def test_writer_counts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    written: list[int] = []

    async def run() -> None:
        engine = make_engine(url)
        writer = CaptureWriter(engine, Spool(tmp_path / "spool"), on_written=written.append)
        writer.start()
        for i in range(10):
            writer.submit(_record(i))
        await writer.stop()  # stop() drains what was submitted
        engine.dispose()

    asyncio.run(run())
    assert sum(written) == 10
    engine = make_engine(url)
    with OrmSession(engine) as db:
        assert db.scalar(select(func.count()).select_from(Turn)) == 10
    engine.dispose()


async def test_writer_behind_sheds_its_backlog_to_the_spool(pg_url: str, tmp_path: Path) -> None:
    """A burst far above what the writer stores per cycle, while the pool is held: the backlog
    moves to the spool in one append instead of waiting in memory; traffic that arrives while
    the writer is stuck is shed the same way once it moves again; the spool is replayed a
    bounded chunk per cycle, and every turn is stored exactly once."""
    engine = make_engine(pg_url)
    spool = Spool(tmp_path / "spool")
    shed: list[int] = []
    writer = CaptureWriter(engine, spool, batch_size=16, max_queue=100, replay_chunk=64,
                           flush_interval_s=0.005, on_shed=shed.append)
    records = [_record(i) for i in range(3000)]
    held = HeldPool(pg_url)
    try:
        writer.start()
        for r in records[:2000]:
            writer.submit(r)  # no await between them: 2,000 queued before the writer wakes
        # the writer takes one batch, sees 1,984 more waiting, spools all 2,000 and starts
        # replaying them; the replay's first write waits on the held pool, so this state stays
        await _until(lambda: spool.records == 2000)
        assert shed == [2000] and writer.depth == 0  # the backlog is on disk, not in memory
        for r in records[2000:]:  # traffic while the writer waits on the pool
            writer.submit(r)
        assert writer.depth == 1000 and spool.records == 2000
    finally:
        held.release()
    await _until(lambda: writer.processed == 3000 and not spool.pending, timeout=120)
    # once the replay's write went through, the next cycle found 1,000 waiting: shed too
    assert shed == [2000, 1000]
    await writer.stop()
    engine.dispose()
    stored = _stored_ids(pg_url)
    assert len(stored) == len(set(stored)) == 3000
    assert set(stored) == {r.id for r in records}
    assert spool.path is not None and not spool.path.exists()  # drained and removed


@pytest.mark.parametrize("bound", ["bytes", "none"])
async def test_a_few_long_turns_go_to_the_spool_by_their_bytes(bound: str, pg_url: str, tmp_path: Path) -> None:
    """The queue's bound is turns or bytes, whichever comes first: 20 long agent turns (10,000
    prompt token ids each, about 360 kB in memory) are far below the count bound but above a
    1 MB bound, so the writer sheds them to the spool; with a bound of 1 GB the same 20 wait in
    memory and are written from there. Either way each is stored once and the byte count
    returns to 0."""
    engine = make_engine(pg_url)
    spool = Spool(tmp_path / "spool")
    shed: list[int] = []
    writer = CaptureWriter(engine, spool, batch_size=2, max_batch=2, max_queue=10_000,
                           max_queue_bytes=(1 << 20) if bound == "bytes" else (1 << 30),
                           flush_interval_s=0.005, on_shed=shed.append)
    records = [_record(i) for i in range(20)]
    for r in records:
        r.prompt_token_ids = list(range(10_000))
    assert approx_bytes(records[0], 400) > 10_000 * 32
    writer.start()
    for r in records:  # no await between them: all 20 queued before the writer wakes
        writer.submit(r, request_bytes=400)
    assert writer.queued_bytes == sum(approx_bytes(r, 400) for r in records)
    await _until(lambda: writer.processed == 20 and not spool.pending, timeout=60)
    await writer.stop()
    engine.dispose()
    assert shed == ([20] if bound == "bytes" else [])
    assert writer.queued_bytes == 0
    stored = _stored_ids(pg_url)
    assert sorted(stored) == sorted(r.id for r in records)


async def test_replay_goes_a_chunk_at_a_time_and_resumes_after_an_outage(
    pg_cluster: ThrowawayPostgres, tmp_path: Path
) -> None:
    records = [_record(i) for i in range(50)]
    spool = Spool(tmp_path / "spool")
    spool.append(records)
    first = spool.chunk(20)
    assert first.records == records[:20] and first.lines == 20
    spool.advance(first)
    assert spool.waiting == 30 and spool.read() == records[20:]  # the cursor moved past them
    # the pool goes away mid-replay: nothing is lost, and the replay resumes at the cursor
    engine = make_engine(pg_cluster.dsn)
    writer = CaptureWriter(engine, spool, batch_size=8, replay_chunk=16, retry_interval_s=0.1)
    pg_cluster.kill()
    writer.start()
    await _until(lambda: writer.last_db_error is not None)
    assert spool.waiting == 30
    pg_cluster.restart()
    await _until(lambda: not spool.pending)
    await writer.stop()
    engine.dispose()
    # the first 20 were "written" by a replay whose pool we never saw: only the rest is stored
    assert sorted(_stored_ids(pg_cluster.dsn)) == sorted(r.id for r in records[20:])


async def test_writer_behind_writes_its_backlog_in_one_bigger_batch(pg_url: str, tmp_path: Path) -> None:
    """A backlog above the batch size but under the queue bound goes to the pool in one batch of
    all of it (not batch by batch, not through the spool); while it is written, the writer says
    how far behind it is: the turns in memory, batch in flight included, and the oldest one's age."""
    engine = make_engine(pg_url)
    written: list[int] = []
    shed: list[int] = []
    writer = CaptureWriter(engine, Spool(tmp_path / "spool"), batch_size=8, max_queue=1000,
                           flush_interval_s=0.005, on_written=written.append, on_shed=shed.append)
    records = [_record(i) for i in range(300)]
    assert writer.oldest_unstored_s() == 0.0
    held = HeldPool(pg_url)
    try:
        writer.start()
        for r in records:
            writer.submit(r)  # no await between them: 300 queued before the writer wakes
        await _until(lambda: writer.queue.qsize() == 0)  # taken: the batch waits on the held pool
        assert writer.depth == 300 and writer.in_flight[0] is records[0]
        assert writer.oldest_unstored_s() > 0.0
    finally:
        held.release()
    await _until(lambda: writer.processed == 300)
    assert written == [300] and shed == [] and not writer.spool.pending
    assert writer.depth == 0 and writer.oldest_unstored_s() == 0.0
    await writer.stop()
    engine.dispose()
    assert sorted(_stored_ids(pg_url)) == sorted(r.id for r in records)


async def test_spool_knows_its_oldest_turn(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    assert spool.oldest is None
    records = [_record(i) for i in range(4)]
    spool.append(records[:2])
    spool.append(records[2:])
    assert spool.oldest == records[0].created_at
    spool.advance(spool.chunk(3))
    assert spool.oldest == records[3].created_at  # read back from the file, past the cursor
    spool.close()
    spool = Spool(tmp_path / "spool")  # the next process replays the file from its start
    assert spool.oldest == records[0].created_at
    spool.advance(spool.chunk(None))
    assert spool.oldest is None and not spool.pending
    spool.close()
