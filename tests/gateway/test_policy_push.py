"""The `policy` alias switch is pushed to the gateways (datapool.policy_signal): PostgreSQL
LISTEN/NOTIFY, SQLite in-process or through the file's data_version. The gateways' fallback
poll is set to an hour here, so only a pushed switch can make these tests pass; nothing is
timed (a stuck wait fails on its guard instead)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from datapool import versions
from datapool.db import make_engine
from base.settings import Settings
from gateway.state import Gateway, running
from publishing.publish import rollback
from tests.support import REPO
from tests.support.versions import register_lora

HANG_GUARD_S = 120  # not a latency bound: only stops a test that would otherwise wait forever
ROOT = REPO


async def _until(gw: Gateway, want: str | None) -> None:
    """Wait until the gateway's alias serves *want* (None: the base), woken by its reads."""
    assert gw.policy_read is not None

    def serves() -> bool:
        active = gw.upstreams.active_version
        return (active.name if active else None) == want

    async with gw.policy_read:
        await asyncio.wait_for(gw.policy_read.wait_for(serves), HANG_GUARD_S)


def _settings(url: str, tmp: Path) -> Settings:
    return Settings(upstream_url="http://127.0.0.1:9/v1", upstream_model="smollm2", database_url=url,
                    data_dir=tmp / "data", policy_fallback_s=3600)


async def test_switches_reach_the_gateway_in_process(database_url: str, tmp_path: Path) -> None:
    """Publish-and-activate (twice, a candidate between), rollback to the base: each switch
    reaches the gateway's alias."""
    engine = make_engine(database_url)
    try:
        async with running(_settings(database_url, tmp_path), None, None) as gw:
            await _until(gw, None)
            await asyncio.to_thread(register_lora, database_url, "v1", tmp_path)
            await _until(gw, "v1")
            await asyncio.to_thread(register_lora, database_url, "cand", tmp_path, activate=False)
            await asyncio.to_thread(register_lora, database_url, "v2", tmp_path)
            await _until(gw, "v2")
            await asyncio.to_thread(rollback, engine, [], "base")
            await _until(gw, None)
    finally:
        engine.dispose()


async def test_a_switch_from_another_process_reaches_the_gateway(database_url: str, tmp_path: Path) -> None:
    """The trainer is another process (another host, on PostgreSQL): its activation is pushed
    too (NOTIFY; SQLite: the file's data_version)."""
    async with running(_settings(database_url, tmp_path), None, None) as gw:
        await _until(gw, None)
        code = ("import sys; from pathlib import Path; from tests.support.versions import register_lora; "
                "register_lora(sys.argv[1], 'other', Path(sys.argv[2]))")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, database_url, str(tmp_path),
                                                    cwd=ROOT, env=env, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        await _until(gw, "other")
