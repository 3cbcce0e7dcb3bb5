"""The process helpers of tests/support/processes.py own what they start."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.support.processes import GatewayProcess


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_with_start_runs_one_gateway_and_stops_it(tmp_path: Path) -> None:
    """`with gw.start(timeout=…):` (start with a longer wait, then the block) starts one process,
    not a second one over the first, and leaves nothing serving afterwards."""
    # an upstream nobody serves: the gateway starts without asking it
    gw = GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                        upstream_url="http://127.0.0.1:9/v1")
    with gw.start(timeout=120) as same:
        assert same is gw and gw.running
        first = gw.proc
    assert first is gw.proc and first is not None and first.poll() is not None
    assert not gw.running and _port_free(gw.port)
