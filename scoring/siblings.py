"""Resampling shadow siblings when the policy server has room (``datapool.siblings`` says what
they are and how they are kept).

:func:`resample_siblings` asks the policy server's ``/metrics`` first: with a request waiting,
or more than ``max_running`` running, it does nothing (live traffic comes first; the next sweep
tries again). Otherwise, for up to ``per_sweep`` candidate turns, it asks ``/v1/completions``
for ``k`` replies to the turn's exact prompt ids, from the version that served the turn (the
active one when that one is no longer loaded), with the turn's own sampling settings, and
stores them as siblings pending a score. The worker's sweep runs it (``siblings_k`` > 0) and
sends the scoring tasks; the learning benchmark calls it after each round's interactions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool import queries, siblings
from datapool.models import Turn
from base.errors import CallError
from vllm_client.sampling import Reply, sample_from_ids, server_load

log = logging.getLogger("nextstate.siblings")


@dataclass(frozen=True)
class SiblingConfig:
    api_base: str  # the policy vLLM (…/v1)
    k: int  # replies per turn
    #: resample only while the server runs at most this many requests and has none waiting;
    #: None: do not ask (the learning benchmark, which needs them every round)
    max_running: int | None = 2
    per_sweep: int = 4  # turns per call
    api_key: str | None = None
    timeout_s: float = 120.0


def resample_siblings(engine: Engine, cfg: SiblingConfig, *, turn_ids: Sequence[str] | None = None,
                      since: datetime | None = None, transport: httpx.AsyncBaseTransport | None = None) -> list[str]:
    """Resample up to ``cfg.per_sweep`` candidate turns (among *turn_ids* when given) ``cfg.k``
    times each; returns the new siblings' ids (pending a score). Nothing when the server is busy
    or unreachable, or no turn qualifies. *transport*: httpx's (tests)."""
    if cfg.k < 1:
        return []
    return asyncio.run(_resample(engine, cfg, turn_ids, since, transport))


async def _resample(engine: Engine, cfg: SiblingConfig, turn_ids: Sequence[str] | None,
                    since: datetime | None, transport: httpx.AsyncBaseTransport | None) -> list[str]:
    async with httpx.AsyncClient(timeout=cfg.timeout_s, transport=transport) as http:
        if cfg.max_running is not None:
            try:
                load = await server_load(http, cfg.api_base, api_key=cfg.api_key)
            except CallError as exc:
                log.info("siblings: no load from %s (%s); not resampling", cfg.api_base, exc.detail)
                return []
            if load.waiting > 0 or load.running > cfg.max_running:
                log.debug("siblings: the policy server is busy (%s running, %s waiting)", load.running, load.waiting)
                return []
        with OrmSession(engine) as db:
            ids = siblings.candidates(db, limit=cfg.per_sweep, turn_ids=turn_ids, since=since)
            active = queries.active_policy_version(db)
            fallback = active.name if active is not None else None
            jobs = []
            for tid in ids:
                t = db.get(Turn, tid)
                assert t is not None
                jobs.append((tid, t.upstream_model, t.policy_version, list(t.prompt_token_ids or []),
                             siblings.sampling_of(t)))

        async def one(job: tuple[str, str | None, str | None, list[int], dict]) -> tuple[str, str, str | None,
                                                                                          list[Reply]] | None:
            tid, model, version, prompt, params = job
            for name, ver in ((model, version), (fallback, fallback)):
                if not name:
                    continue
                try:
                    replies = await sample_from_ids(http, cfg.api_base, name, prompt, n=cfg.k, api_key=cfg.api_key,
                                                    **params)
                    return tid, name, ver, replies
                except CallError as exc:
                    if exc.status_code != 404:  # not a version the server lost: give up on this turn for now
                        log.warning("siblings of turn %s: %s", tid, exc)
                        return None
            return None

        sampled = [r for r in await asyncio.gather(*(one(j) for j in jobs)) if r is not None]
    out: list[str] = []
    with OrmSession(engine) as db, db.begin():
        taken = siblings.siblings_of(db, [tid for tid, *_ in sampled])
        for tid, model, version, replies in sampled:
            original = db.get(Turn, tid)
            if original is None or tid in taken:  # forgotten, or resampled meanwhile
                continue
            out += siblings.add_siblings(db, original, replies, model=model, policy_version=version)
    if out:
        log.info("siblings: %d replies for %d turns", len(out), len(sampled))
    return out
