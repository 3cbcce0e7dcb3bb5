"""Write-behind capture: the gateway hands over records and never waits for the database.

One writer task drains an in-memory queue in batches and writes each batch in one transaction.
While the database is unreachable, batches go to an append-only spool file (fsync'd per batch);
once the database answers again the spool is replayed in order, a bounded chunk per cycle, and
because the pool skips turn ids it already holds, a batch that was written but not yet cleared
from the spool is never stored twice.

A writer behind the traffic first takes bigger batches (everything queued, up to ``max_batch``):
a batch costs about as many statements for a thousand turns as for ten, so the writer's
throughput grows with its backlog. The queue is bounded: when the database is reachable but
slower than that, the writer moves the whole backlog to the spool in one append (it "sheds") and
writes it to the pool from there. The bound is ``max_queue`` turns or ``max_queue_bytes`` (by
``approx_bytes``), whichever comes first: a burst of short turns waits in memory, where it is
cheapest to write, and a few long agent turns still go to disk. Memory stays flat under any
load, and what a SIGKILL can lose is what sits in memory: at most that bound queued, the batch
being written and those answered during one writer cycle, and, while the writer keeps up, only
the turns of the last flush interval. How far behind it is shows as ``depth`` (in memory), the
spool's ``waiting`` and ``oldest_unstored_s()``.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

from datapool.db import as_utc, chunked, utcnow
from datapool.records import TurnRecord
from base.jsonfast import dumps, loads
from base.redact import Found, Redactor
from datapool.token_mask import DecoderFor, blank, mask_ids, redact_text
from datapool.sessions import Stitcher

log = logging.getLogger("nextstate.capture")

GIL_SWITCH_INTERVAL_S = 0.0005
# the most turns one writer cycle takes, however far behind it is: one transaction stays seconds, not minutes
MAX_BATCH = 4096


def approx_bytes(record: TurnRecord, request_bytes: int = 0) -> int:
    """About how much memory *record* holds, for the queue's bound: its request parsed (about
    three times the JSON it came as; *request_bytes*, else a floor) and its token ids and
    logprobs (a Python int or float and its list slot, about 36 bytes each). An estimate: what
    it bounds is the order of magnitude, megabytes for a long agent turn, not a count of turns.
    Against tracemalloc, for a 20 kB agent request with 0, 4,000 and 30,000 prompt tokens: 57,
    212 and 1,218 KiB estimated, 28, 183 and 1,186 KiB held."""
    tokens = sum(len(x) for x in (record.prompt_token_ids, record.token_ids, record.logprobs) if x)
    return 3 * max(request_bytes, 1024) + 36 * tokens


@dataclass
class SpoolChunk:
    """Records read from the spool for one replay step, and where they end."""

    records: list[TurnRecord]
    offset: int  # file offset after the last line read
    lines: int  # file lines consumed (a torn line counts, though it yields no record)
    from_memory: int  # records taken from the in-memory overflow, after the file's


class Spool:
    """An append-only JSONL file of records waiting for the database.

    Each process takes its own file (``capture-N.jsonl``, guarded by an flock on
    ``capture-N.lock``), so gateways sharing a data directory never interleave writes, and a
    restarted gateway picks up the file its predecessor left behind.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self._lock_file: IO[bytes] | None = None
        self.path: Path | None = None
        self.records = 0
        self.bytes = 0
        # bytes of the file already written to the pool by this process's replay
        self.offset = 0
        # records that could not even be spooled (disk full, read-only) wait here, in order
        self.memory: list[TurnRecord] = []
        # when the oldest turn waiting here was answered (None: nothing waits)
        self.oldest: datetime | None = None
        self.error: str | None = None
        try:
            self._claim()
        except OSError as exc:
            self.error = f"spool directory {directory} unusable: {exc}"
            log.error("%s; captured turns will be held in memory while the database is down", self.error)

    def _claim(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            lock = open(self.directory / f"capture-{i}.lock", "ab")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            self._lock_file = lock
            self.path = self.directory / f"capture-{i}.jsonl"
            if self.path.exists():
                with open(self.path, "r+b") as f:
                    self.records = sum(1 for _ in f)
                    if f.tell() > 0:
                        f.seek(-1, os.SEEK_END)
                        if f.read(1) != b"\n":
                            # a crash mid-append tore the last line: end it, so the next append
                            # starts a line of its own instead of being glued to the torn one
                            f.write(b"\n")
                self.bytes = self.path.stat().st_size
                self.oldest = self._peek()
            return
        raise OSError("no free spool slot (256 gateways on one data directory?)")

    @property
    def pending(self) -> bool:
        return self.records > 0 or bool(self.memory)

    @property
    def waiting(self) -> int:
        """Turns waiting here for the pool: in the file and, when it cannot be written, in memory."""
        return self.records + len(self.memory)

    def _peek(self) -> datetime | None:
        """When the first turn after the replay cursor was answered; None when none is readable."""
        if self.path is None or not self.path.exists():
            return None
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                try:
                    return as_utc(TurnRecord.from_json(loads(line)).created_at)
                except (ValueError, TypeError):
                    continue
        return None

    def append(self, batch: Sequence[TurnRecord]) -> None:
        if batch and not self.pending:
            self.oldest = as_utc(batch[0].created_at)
        if self.memory or self.path is None:
            self.memory.extend(batch)  # keep order: nothing may overtake what waits in memory
            return
        data = b"".join(dumps(r.to_json()) + b"\n" for r in batch)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self.error = f"cannot write spool {self.path}: {exc}"
            log.error("%s; holding %d turns in memory", self.error, len(batch))
            self.memory.extend(batch)
            return
        self.error = None
        self.records += len(batch)
        self.bytes += len(data)

    def read(self) -> list[TurnRecord]:
        """Everything waiting, oldest first: the file from the replay cursor, then memory."""
        return self.chunk(None).records

    def chunk(self, limit: int | None) -> SpoolChunk:
        """Up to ``limit`` waiting records, oldest first, from the replay cursor; `advance`
        takes the chunk once its records are in the pool."""
        chunk = SpoolChunk([], self.offset, 0, 0)
        if self.path is not None and self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(chunk.offset)
                for line in f:
                    if limit is not None and len(chunk.records) >= limit:
                        break
                    chunk.offset += len(line)
                    chunk.lines += 1
                    try:
                        chunk.records.append(TurnRecord.from_json(loads(line)))
                    except (ValueError, TypeError) as exc:
                        # only a crash mid-append leaves a torn line, and only as the last one
                        log.warning("spool %s at byte %d unreadable, skipped: %s",
                                    self.path, chunk.offset - len(line), exc)
        room = len(self.memory) if limit is None else max(0, limit - len(chunk.records))
        chunk.from_memory = min(room, len(self.memory))
        chunk.records.extend(self.memory[: chunk.from_memory])
        return chunk

    def advance(self, chunk: SpoolChunk) -> None:
        """Mark a chunk as written to the pool; the file goes once all of it is."""
        self.offset = chunk.offset
        self.records = max(0, self.records - chunk.lines)
        del self.memory[: chunk.from_memory]
        if self.path is not None and self.path.exists() and self.offset >= self.path.stat().st_size:
            self.path.unlink()
            self.records = self.bytes = self.offset = 0
        if not self.pending:
            self.oldest = None
        elif self.records:
            self.oldest = self._peek()
        else:
            self.oldest = as_utc(self.memory[0].created_at)
        if self.path is not None and not self.memory:
            self.error = None  # nothing waits in memory; the next write tries the disk again

    def reject(self, record: TurnRecord, exc: Exception) -> None:
        """Park a record the database refuses (never retried automatically; kept for a person)."""
        log.error("pool rejected turn %s, parked in rejected.jsonl: %s", record.id, exc)
        line = {"error": str(exc).splitlines()[0], "record": record.to_json()}
        with open(self.directory / "rejected.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


def _unreachable(exc: SQLAlchemyError) -> bool:
    if isinstance(exc, OperationalError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


class CaptureWriter:
    """Batches records into the pool; falls back to the spool while the database is away."""

    def __init__(
        self,
        engine: Engine,
        spool: Spool,
        *,
        batch_size: int = 256,
        max_batch: int | None = None,
        flush_interval_s: float = 0.05,
        retry_interval_s: float = 1.0,
        max_queue: int = 16384,
        max_queue_bytes: int = 256 << 20,
        replay_chunk: int | None = None,
        on_written: Callable[[int], None] | None = None,
        on_ready: Callable[[list[str]], None] | None = None,
        on_shed: Callable[[int], None] | None = None,
        redactor: Redactor | None = None,
        decoder_for: DecoderFor | None = None,
        on_redacted: Callable[[Mapping[str, int]], None] | None = None,
        on_stored: Callable[[Sequence[TurnRecord], Mapping[str, str]], None] | None = None,
    ):
        self.engine = engine
        self.spool = spool
        self.batch_size = batch_size
        # a writer behind the traffic takes up to this many queued turns in one batch: a batch's
        # statements are about as many for 1,000 turns as for 10, so a bigger one catches up
        self.max_batch = max(batch_size, max_batch if max_batch is not None else min(max_queue // 2, MAX_BATCH))
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        # the backlog held in memory before it goes to the spool: this many turns, or this many
        # bytes by approx_bytes (a long agent turn's token ids and logprobs are megabytes)
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        # records replayed per writer cycle: bounds the cycle, so the queue is looked at often
        self.replay_chunk = replay_chunk or 4 * batch_size
        self.on_written = on_written
        self.on_ready = on_ready  # called with turns whose next state just became known
        self.on_shed = on_shed  # called with how many queued turns were moved to the spool
        # redaction runs on every record before the pool, the spool or a log sees it
        self.redactor = redactor if redactor is not None and redactor.active else None
        self.decoder_for = decoder_for
        self.on_redacted = on_redacted  # called with the counts per detector of each batch
        # called, in the writer's thread, with each batch just committed and the session of each
        # turn it stored (turn id -> session id; turns already in the pool are left out): the
        # trace exporter (datapool.traces). What it raises is logged, never in capture's way.
        self.on_stored = on_stored
        self.queue: asyncio.Queue[TurnRecord | None] = asyncio.Queue()
        self._sizes: deque[int] = deque()  # approx_bytes of each queued item, in the queue's order
        self.queued_bytes = 0
        self.in_flight: list[TurnRecord] = []  # the batch being written
        # the batch being collected wakes once when this many more records are queued (0: none waits)
        self._want = 0
        self._filled = asyncio.Event()
        self.last_db_error: str | None = None
        self._last_failure = 0.0
        self._task: asyncio.Task[None] | None = None
        # records handed over, and records written (or spooled): what `flushed` waits on
        self.submitted = 0
        self.processed = 0

    def submit(self, record: TurnRecord, request_bytes: int = 0) -> None:
        """Hand a record over (*request_bytes*: the size of the request as sent, for the memory
        bound). Never blocks and never raises."""
        self.submitted += 1
        size = approx_bytes(record, request_bytes)
        self._sizes.append(size)
        self.queued_bytes += size
        self.queue.put_nowait(record)
        if self._want and self.queue.qsize() >= self._want:
            self._filled.set()  # the batch being collected is full

    async def flushed(self) -> None:
        """Return once every record submitted before the call is in the pool (or, while the
        database is away, in the spool). A rollout runner calls it before reading a session."""
        target = self.submitted
        while self.processed < target or (self.spool.pending and self.last_db_error is None):
            await asyncio.sleep(max(self.flush_interval_s / 2, 0.005))

    @property
    def depth(self) -> int:
        """Turns answered and waiting in memory: queued, and the batch being written."""
        return self.queue.qsize() + len(self.in_flight)

    def oldest_unstored_s(self) -> float:
        """Seconds since the oldest turn not yet in the pool (in memory or in the spool) was
        answered; 0 when every turn is stored."""
        # /metrics reads this from a worker thread while the loop changes the queue: local
        # references, and a head that went between two reads is simply not counted
        in_flight, queued, spooled = self.in_flight, self.queue._queue, self.spool.oldest  # type: ignore[attr-defined]
        times = [spooled] if spooled is not None else []
        for records in (in_flight, queued):
            try:
                head = records[0]
            except IndexError:
                continue
            if head is not None:  # the stop sentinel
                times.append(as_utc(head.created_at))
        return max(0.0, (utcnow() - min(times)).total_seconds()) if times else 0.0

    def start(self) -> None:
        # The writer's thread runs pure-Python ORM code. With CPython's default 5 ms switch
        # interval, every wake-up of the event loop waits up to 5 ms for that thread to yield
        # the GIL, several times per proxied request; 0.5 ms keeps the loop responsive.
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._task = asyncio.create_task(self._run(), name="capture-writer")

    async def stop(self) -> None:
        """Write (or spool) everything submitted so far, then stop."""
        if self._task is None:
            return
        self._sizes.append(0)
        self.queue.put_nowait(None)
        self._filled.set()
        await self._task
        self._task = None
        self.spool.close()

    async def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = await self._collect()
            shed = not stopping and self.behind()
            if shed:
                # the pool is slower than the traffic: the backlog goes to disk in one append
                stopping = self._drain(batch)
                if self.on_shed:
                    self.on_shed(len(batch))
            self.in_flight = batch
            if self.redactor is not None and batch:
                await self._redact(batch, self.redactor)  # before the pool, the spool or a log
            try:
                await asyncio.to_thread(self._persist, batch, shed)
            except Exception as exc:  # the writer must outlive any one bad batch
                log.exception("capture writer failed on a batch of %d; spooling it", len(batch))
                self._failed(exc)  # and waits a retry interval before it tries the pool again
                await asyncio.to_thread(self.spool.append, batch)
            self.in_flight = []
            self.processed += len(batch)

    def behind(self) -> bool:
        """Whether the backlog in memory reached its bound (turns or bytes): it goes to the spool.
        Below it a burst waits in memory, where writing it costs least: at saturation a writer
        that spooled at 1,024 turns wrote from disk what it would have caught up with, and the
        gateway answered up to a third fewer requests (benchmarks/gateway/README.md)."""
        return self.queue.qsize() >= self.max_queue or self.queued_bytes >= self.max_queue_bytes

    def _got(self, item: TurnRecord | None) -> TurnRecord | None:
        """*item*, just taken from the queue, its bytes no longer counted."""
        self.queued_bytes -= self._sizes.popleft()
        return item

    async def _redact(self, batch: list[TurnRecord], redactor: Redactor) -> None:
        """Redact the batch in place: text in a thread (CPU), then the token ids of the turns
        where something was found (the tokenizer is a server)."""
        def text() -> list[Found]:
            out = []
            for record in batch:
                try:
                    out.append(redact_text(record, redactor))
                except Exception:  # fail closed: a turn that could not be redacted keeps no content
                    log.exception("turn %s: redaction failed; storing its metadata only", record.id)
                    blank(record)
                    out.append(Found())
            return out

        found = await asyncio.to_thread(text)
        total: Counter[str] = Counter()
        for record, f in zip(batch, found):
            if not f:
                continue
            total.update(f.counts)
            try:
                await mask_ids(record, f, redactor, self.decoder_for)
            except Exception:
                log.exception("turn %s: masking its token ids failed; storing its metadata only", record.id)
                blank(record)
        if total and self.on_redacted:
            self.on_redacted(total)

    def _drain(self, batch: list[TurnRecord]) -> bool:
        """Move everything queued into ``batch``; True if the stop sentinel was among it."""
        while True:
            try:
                item = self._got(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                return False
            if item is None:
                return True
            batch.append(item)

    async def _collect(self) -> tuple[list[TurnRecord], bool]:
        """The next batch: waits for a first record (or, with a spool to replay, a retry tick;
        no wait at all while the pool answers and the spool still holds turns), then takes
        what arrives within flush_interval_s, up to batch_size."""
        batch: list[TurnRecord] = []
        try:
            if not self.spool.pending:
                first = self._got(await self.queue.get())
            elif self.last_db_error is None:
                first = self._got(self.queue.get_nowait())
            else:
                first = self._got(await asyncio.wait_for(self.queue.get(), self.retry_interval_s))
        except (TimeoutError, asyncio.QueueEmpty):
            return batch, False
        if first is None:
            return batch, True
        batch.append(first)
        deadline = time.monotonic() + self.flush_interval_s
        # behind the traffic (more queued than a batch): everything queued, up to max_batch
        size = min(self.max_batch, max(self.batch_size, self.queue.qsize() + 1))
        while True:
            if self._take(batch, size):
                return batch, True
            remaining = deadline - time.monotonic()
            if len(batch) >= size or remaining <= 0:
                return batch, False
            # one wake-up when the batch is full or at the deadline, not one per record
            self._filled.clear()
            self._want = size - len(batch)
            try:
                await asyncio.wait_for(self._filled.wait(), remaining)
            except TimeoutError:
                pass
            finally:
                self._want = 0

    def _take(self, batch: list[TurnRecord], size: int) -> bool:
        """Move queued records into *batch* up to *size*; True if the stop sentinel came."""
        while len(batch) < size:
            try:
                item = self._got(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                return False
            if item is None:
                return True
            batch.append(item)
        return False

    def _persist(self, batch: list[TurnRecord], shed: bool = False) -> None:
        if shed and not self.spool.pending:
            log.warning("capture writer behind by %d turns: spooling the backlog, writing it from disk",
                        len(batch))
        if self.spool.pending or shed:
            # while anything waits in the spool, new turns queue up behind it: order is kept
            if batch:
                self.spool.append(batch)
                self.in_flight = []  # on disk now: the spool counts them
            if time.monotonic() - self._last_failure >= self.retry_interval_s:
                self._replay()
            return
        if not batch:
            return
        try:
            self._write(batch)
        except SQLAlchemyError as exc:
            self._failed(exc)
            self.spool.append(batch)
            self.in_flight = []

    def _write(self, batch: Sequence[TurnRecord]) -> None:
        """Write a batch; raises only when the database is unreachable. A batch the database
        rejects for its content is split, and a record rejected on its own is parked in the
        spool's rejects file instead of blocking every turn behind it."""
        try:
            self._transaction(batch)
        except SQLAlchemyError as exc:
            if _unreachable(exc):
                raise
            if len(batch) == 1:
                self.spool.reject(batch[0], exc)
                return
            for record in batch:
                self._write([record])

    def _transaction(self, batch: Sequence[TurnRecord]) -> None:
        with OrmSession(self.engine) as db, db.begin():
            stitcher = Stitcher(db)
            written = stitcher.write(batch)
        self.last_db_error = None
        if self.on_written:
            self.on_written(written)
        if self.on_ready and stitcher.ready:
            self.on_ready(stitcher.ready)
        if self.on_stored and stitcher.sessions:
            try:
                self.on_stored(batch, stitcher.sessions)
            except Exception:
                log.exception("exporting the spans of %d stored turns failed", len(stitcher.sessions))

    def _failed(self, exc: Exception) -> None:
        self._last_failure = time.monotonic()
        first = self.last_db_error is None
        self.last_db_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if first:
            log.warning("pool unreachable, spooling captured turns: %s", self.last_db_error)

    def _replay(self) -> None:
        """Write the next chunk of the spool to the pool."""
        chunk = self.spool.chunk(self.replay_chunk)
        try:
            for batch in chunked(chunk.records, self.max_batch):
                self._write(batch)
        except SQLAlchemyError as exc:
            self._failed(exc)
            return
        self.spool.advance(chunk)
        if not self.spool.pending:
            log.info("capture spool drained: every spooled turn is in the pool")
