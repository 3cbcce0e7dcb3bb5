"""The Python agent's rollouts share one HTTP client per event loop, closed when the run ends.

A client per rollout built an SSL context and a connection pool each time (~18 ms of CPU on this
machine, ~50 ms under load: a large share of a rollout runner's own CPU at 128 environments)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout import runner as ro


def test_rollouts_of_one_loop_share_one_http_client_closed_at_the_end(tmp_path: Path) -> None:
    agent = ro.PythonAgent("tests.support.rollout_agents:http_client_of", api_key=None)

    async def two_runs() -> list[ro.AgentRun]:
        return [await agent.run({"id": "t"}, base_url=f"http://127.0.0.1:9/s/{sid}/v1", sid=sid,
                                workdir=tmp_path, timeout_s=5) for sid in ("a", "b")]

    first, second = asyncio.run(two_runs())
    assert first.status == second.status == "ok"
    assert first.result["http"] is second.result["http"]  # one client for both sessions ...
    assert first.result["base_url"] != second.result["base_url"]  # ... each at its own session's URL
    shared = first.result["http"]
    assert not shared.is_closed
    # a later run on another loop (the benchmarks call asyncio.run per evaluation) gets a client
    # of its own: one bound to a closed loop cannot send
    third = asyncio.run(agent.run({"id": "t"}, base_url="http://127.0.0.1:9/s/c/v1", sid="c", workdir=tmp_path,
                                  timeout_s=5))
    assert third.result["http"] is not shared
    asyncio.run(agent.close())
    assert third.result["http"].is_closed
