"""The gateway's state: one upstream client, one capture queue, one pool engine per process,
built when the app starts and reached by handlers through :func:`gateway_of` (Starlette's
``request.app.state``), so no router imports the app."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import Request
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

from datapool.capture import CaptureWriter, Spool
from datapool.policy_signal import PolicyWatch
from datapool.db import make_engine
from datapool.queries import active_policy_version
from datapool.queue import Enqueuer
from base.redact import Redactor
from base.settings import ClientProfile, Settings
from datapool.traces import Traces, traces
from gateway.clients import profiles
from gateway.metrics import Metrics
from gateway.redaction import decoders
from gateway.tenants import KeyRing
from gateway.upstream import ActiveVersion, Upstreams
from gateway.vllm_watch import VLLMWatch, vllm_bases

log = logging.getLogger("nextstate.gateway")

# the collector's first generation runs after this many more objects allocated than freed (the
# interpreter's default is 700). A request's parsing and the capture writer's batch pass 700 many
# times over while they are alive, and each collection walked what they held: ~0.25 ms each,
# ~20 µs of CPU per request in all. At 10,000 a collection takes ~3 ms, 30 times less often;
# at 50,000 one took ~13 ms, a pause the added p99 would show (benchmarks/gateway/README.md)
GC_GEN0_THRESHOLD = 10_000


@dataclass
class Gateway:
    """Everything a request handler needs, built once per process."""

    settings: Settings
    engine: Engine
    http: aiohttp.ClientSession
    upstreams: Upstreams
    writer: CaptureWriter
    metrics: Metrics
    enqueuer: Enqueuer
    keys: KeyRing
    #: bumped after every read of the alias from the pool (tests wait on it; no timing)
    policy_reads: int = 0
    policy_read: asyncio.Condition | None = None
    #: each vLLM upstream through its restarts (503 while down, the active version reloaded)
    vllm_watch: VLLMWatch | None = None
    #: the span exporter, when otel_traces is on (datapool.traces)
    traces: Traces | None = None
    #: the client profiles a request is recognised by (gateway.clients.profiles of the settings),
    #: listed once rather than per request
    client_profiles: list[ClientProfile] = field(init=False)

    def __post_init__(self) -> None:
        self.client_profiles = profiles(self.settings)


def gateway_of(request: Request) -> Gateway:
    """The running gateway's state (set by :func:`running` on ``app.state``)."""
    return request.app.state.gateway


def _active_version(engine: Engine) -> ActiveVersion | None:
    with OrmSession(engine) as db:
        row = active_policy_version(db)
        return ActiveVersion(name=row.name, kind=row.kind) if row else None


async def _follow_policy(gw: Gateway, wake: asyncio.Event) -> None:
    """Keep ``gw.upstreams.active_version`` equal to the pool's: re-read when *wake* is set (a
    pushed switch, ``datapool.policy_signal``) or every ``policy_fallback_s`` (a missed one)."""
    # A version is made active only after every vLLM loaded it, so reading it late is safe; the
    # push only makes the switch prompt.
    assert gw.policy_read is not None
    while True:
        wake.clear()
        try:
            gw.upstreams.active_version = await asyncio.to_thread(_active_version, gw.engine)
        except SQLAlchemyError:
            pass  # the pool is down: keep serving the last known version
        async with gw.policy_read:
            gw.policy_reads += 1
            gw.policy_read.notify_all()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), gw.settings.policy_fallback_s)


@contextlib.asynccontextmanager
async def running(settings: Settings, model_list: list[dict[str, Any]] | None, policy_model: str | None
                  ) -> AsyncIterator[Gateway]:
    """Build the gateway's state, start its capture writer and policy follower; stop them on exit."""
    # aiohttp, not httpx: on this path httpx spent ~0.9 ms of CPU per request against
    # aiohttp's ~0.13 ms (benchmarks/gateway/README.md), most of the gateway's own cost.
    http = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=settings.upstream_timeout_s,
                                      connect=settings.upstream_connect_timeout_s),
        # keep-alive under the upstream's own idle timeout (uvicorn's, vLLM's server, is 5 s):
        # a pooled connection the server is closing at the moment it is reused fails the
        # request ("Server disconnected"); seen in CI as a 502
        connector=aiohttp.TCPConnector(limit=2000, limit_per_host=0, keepalive_timeout=2.0),
    )
    engine = make_engine(settings.resolved_database_url)
    metrics = Metrics()
    spool = Spool(settings.resolved_spool_dir)
    enqueuer = Enqueuer(settings)
    upstreams = Upstreams(
        http,
        model_list=model_list,
        upstream_url=settings.upstream_url,
        upstream_model=settings.upstream_model,
        policy_model=policy_model,
    )
    exporter = traces(settings, "gateway")
    writer = CaptureWriter(
        engine,
        spool,
        batch_size=settings.capture_batch_size,
        flush_interval_s=settings.capture_flush_interval_s,
        retry_interval_s=settings.spool_retry_interval_s,
        max_queue=settings.capture_queue_max,
        max_queue_bytes=int(settings.capture_queue_max_mb * (1 << 20)),
        on_written=metrics.captured.inc,
        on_ready=enqueuer.send,
        on_shed=metrics.shed.inc,
        redactor=Redactor(settings.redact, settings.redact_patterns),
        decoder_for=decoders(http, upstreams),
        on_redacted=metrics.count_redactions,
        on_stored=exporter.stored if exporter is not None else None,
    )
    metrics.watch(lambda: writer.depth, lambda: spool.waiting, lambda: spool.bytes, writer.oldest_unstored_s)
    metrics.watch_pool(engine)
    metrics.watch_spool_error(lambda: spool.error)
    gw = Gateway(settings, engine, http, upstreams, writer, metrics, enqueuer, KeyRing(settings, engine),
                 policy_read=asyncio.Condition(), traces=exporter)
    gw.vllm_watch = VLLMWatch(engine, http, metrics, bases=lambda: vllm_bases(upstreams),
                              active=lambda: upstreams.active_version)
    upstreams.out_of_service = gw.vllm_watch.out_of_service
    writer.start()
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    watch = PolicyWatch(engine, lambda: loop.call_soon_threadsafe(wake.set)).start()
    follower = asyncio.create_task(_follow_policy(gw, wake), name="policy-alias")
    watching = asyncio.create_task(gw.vllm_watch.run(), name="vllm-watch")
    # what the start imported and built lives as long as the process: out of the collector's
    # generations, so that a full collection under load walks only what requests allocate
    gc.freeze()
    threshold = gc.get_threshold()
    if 0 < threshold[0] < GC_GEN0_THRESHOLD:  # 0: the collector is off, leave it so
        gc.set_threshold(GC_GEN0_THRESHOLD, *threshold[1:])
    try:
        yield gw
    finally:
        gc.set_threshold(*threshold)
        follower.cancel()
        watching.cancel()
        await asyncio.to_thread(watch.stop)
        await writer.stop()
        if exporter is not None:
            await asyncio.to_thread(exporter.shutdown)  # sends what is still queued
        await http.close()
        engine.dispose()
