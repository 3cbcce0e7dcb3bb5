"""Each vLLM upstream followed through its restarts.

A vLLM that died (and is restarted by `nextstate vllm serve`, `nextstate up`, Kubernetes ...)
comes back without the runtime LoRA adapters it served. The gateway polls every vLLM
deployment's ``/v1/models`` (every ``interval_s``). A request that finds its server gone
(connection refused or dropped before an answer) is answered 503 with ``Retry-After`` (in the
client's dialect, by the routes). Once the server answers again without the active policy
version, that version is loaded into it (``vllm_client.adapters.ensure_loaded``); until then a
request for it is answered the same 503 instead of vLLM's 404 (one that reaches the server
first, before the watch looked, marks it so).

A full version's weights are not reloaded here: a fresh vLLM serves the base weights under the
same name, which its ``/v1/models`` cannot tell apart; `nextstate up` reloads them when it
restarts its vLLM, elsewhere `nextstate policy promote VERSION` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import StrEnum

import aiohttp
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from datapool import versions
from gateway.errors import unavailable
from gateway.metrics import Metrics
from gateway.upstream import ActiveVersion, Upstreams, base_of, is_vllm
from vllm_client.adapters import ensure_loaded
from base.errors import AdminError

log = logging.getLogger("nextstate.gateway")

class State(StrEnum):
    OK = "ok"
    DOWN = "down"  # does not answer
    LOADING = "loading"  # answers, the active version is being loaded into it


class VLLMWatch:
    """The state of each vLLM base URL (``…/v1``), kept by :meth:`run` (see the module docstring)."""

    def __init__(self, engine: Engine, http: aiohttp.ClientSession, metrics: Metrics, *,
                 bases: Callable[[], dict[str, bool]], active: Callable[[], ActiveVersion | None],
                 interval_s: float = 1.0):
        self.engine = engine
        self.http = http
        self.metrics = metrics
        self.bases = bases
        self.active = active
        self.interval_s = interval_s
        self.states: dict[str, State] = {}
        self.loading: dict[str, str] = {}  # base -> the version being loaded into it (while LOADING)

    def state(self, base: str | None) -> State:
        return self.states.get((base or "").rstrip("/"), State.OK)

    def out_of_service(self, base: str) -> bool:
        """Whether *base* is down or loading the active version (Upstreams routes around it)."""
        return self.state(base) != State.OK

    def refuse(self, base: str | None, served_name: str, group: str) -> None:
        """Raise the 503 for a request for the active version to *base* while it is loading it
        (one to a server that is down fails to connect at once and gets the same)."""
        active = self.active()
        # a version in self.loading means its base is LOADING (_set keeps them together)
        if active is not None and served_name == active.name and self.loading.get((base or "").rstrip("/")) == served_name:
            # only the version the watch is loading: one activated meanwhile was loaded by its
            # activation (a request that finds it missing after all gets vLLM's 404 -> mark_loading)
            raise unavailable(group, f"restarted and is loading the active version {served_name}")

    def mark_down(self, base: str | None) -> None:
        """A request found *base* gone (for /readyz and /metrics until the watch sees it answer)."""
        if base:
            self._set(base.rstrip("/"), State.DOWN, "does not answer")

    def mark_loading(self, base: str | None) -> None:
        """A request found *base* without the active version: refuse `policy` there until the
        watch loaded it."""
        active = self.active()
        if base and active is not None and self.loading.get(base.rstrip("/")) != active.name:
            self._set(base.rstrip("/"), State.LOADING, "answers without the active version", active.name)

    def _set(self, base: str, state: State, why: str, loading: str | None = None) -> None:
        before = self.states.get(base, State.OK)
        if loading is not None:
            self.loading[base] = loading
        elif state != State.LOADING:
            self.loading.pop(base, None)
        if before == state:
            return
        self.states[base] = state
        self.metrics.upstream_up.labels(base).set(1.0 if state == State.OK else 0.0)
        if before == State.DOWN:
            self.metrics.upstream_restarts.labels(base).inc()
        (log.info if state == State.OK else log.warning)("vLLM %s: %s (%s)", base, state.value, why)

    async def run(self) -> None:
        while True:
            for base, policy in sorted(self.bases().items()):
                await self.check(base.rstrip("/"), policy)
            await asyncio.sleep(self.interval_s)

    async def check(self, base: str, policy: bool = True) -> None:
        """One look at *base*: down, back (and, where it serves the `policy` group, the active
        version loaded into it), or fine."""
        try:
            async with self.http.get(f"{base}/models", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                served = {m["id"] for m in (await resp.json(content_type=None))["data"]}
        except (TimeoutError, aiohttp.ClientError, KeyError, TypeError, ValueError) as exc:
            self._set(base, State.DOWN, f"{type(exc).__name__}: {exc}")
            return
        active = self.active()
        if not policy or active is None or active.full or active.name in served:
            self._set(base, State.OK, "serving")
            return
        self._set(base, State.LOADING, f"the active version {active.name} is not loaded", active.name)
        try:
            await asyncio.to_thread(self._load, active.name, base)
        except (AdminError, SQLAlchemyError, OSError) as exc:
            log.error("vLLM %s: could not load the active version %s (tried again in %.0f s): %s", base,
                      active.name, self.interval_s, exc)
            return
        self.metrics.upstream_reloads.labels(base).inc()
        self._set(base, State.OK, f"the active version {active.name} loaded")

    def _load(self, name: str, base: str) -> None:
        row = versions.active_row(self.engine)
        if row is None or row.name != name or not row.path:
            return  # switched meanwhile: the next look decides
        ensure_loaded(row.name, row.path, [base], base_model=row.base_model, rollback_on_error=False)


def vllm_bases(upstreams: Upstreams) -> dict[str, bool]:
    """The base URLs of the vLLM deployments (``hosted_vllm/...``) among *upstreams*, each with
    whether it serves the `policy` alias's model group (the one the active version is loaded into)."""
    deployments = upstreams.deployments
    if deployments is None:  # discovered at the first request; until then the one --upstream
        return {upstreams.upstream_url: True} if upstreams.upstream_url else {}
    bases: dict[str, bool] = {}
    for d in deployments:
        if is_vllm(d) and (base := base_of(d)):
            bases[base] = bases.get(base, False) or d["model_name"] == upstreams.policy_model
    return bases
