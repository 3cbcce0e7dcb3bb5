"""Secure by default: a gateway bound beyond loopback with no admin credentials refuses to start,
whichever way it is started (`nextstate gateway`, `nextstate up`, the app factory, the deploy
images' entry point), unless the admin surface is explicitly meant to be open."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from base.errors import AdminExposed
from base.settings import Settings, check_admin_exposure, loopback
from gateway.app import create_app
from tests.support.processes import GatewayProcess
from tests.support.upstreams import SilentUpstream
from tests.support import REPO

ROOT = REPO
DEPLOY = ROOT / "deploy"
REFUSAL = "refusing to serve the admin API and UI"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    return {**env, **extra}


def _cli(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nextstate.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**env, "NEXTSTATE_DATA_DIR": str(tmp_path)})


@given(st.ip_addresses())
def test_only_loopback_addresses_count_as_loopback(address: Any) -> None:
    assert loopback(str(address)) == address.is_loopback
    assert loopback(f"[{address}]") == address.is_loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.internal", "", "127.0.0.1.example.com"])
def test_beyond_loopback_without_credentials_is_refused(host: str) -> None:
    settings = Settings(host=host, upstream_url="http://127.0.0.1:9/v1")
    with pytest.raises(AdminExposed, match=r"NEXTSTATE_ADMIN_TOKEN.*--admin-open"):
        check_admin_exposure(settings)
    with pytest.raises(AdminExposed):
        create_app(settings)  # `uvicorn --factory gateway.app:create_app` meets the same check


@pytest.mark.parametrize("given_", [{"host": "127.0.0.1"}, {"host": "localhost"}, {"host": "::1"},
                                    {"host": "127.8.9.10"},
                                    {"host": "0.0.0.0", "admin_token": "t"},
                                    {"host": "0.0.0.0", "admin_password": "p"},
                                    {"host": "0.0.0.0", "admin_open": True}])
def test_loopback_credentials_or_the_explicit_flag_start(given_: dict[str, Any]) -> None:
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", **given_)
    check_admin_exposure(settings)
    create_app(settings)


def test_nextstate_gateway_refuses_before_serving(tmp_path: Path) -> None:
    done = _cli(["gateway", "--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9/v1"], _clean_env(), tmp_path)
    assert done.returncode == 2, done.stderr
    assert REFUSAL in done.stderr and "NEXTSTATE_ADMIN_TOKEN" in done.stderr and "--admin-open" in done.stderr
    assert "base_url" not in done.stdout


def test_nextstate_up_refuses_before_starting_vllm(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _cli(["up", "--no-scoring"], _clean_env(NEXTSTATE_HOST="0.0.0.0"), tmp_path)
    assert done.returncode == 2, done.stderr
    assert REFUSAL in done.stderr
    assert "starting vLLM" not in done.stdout and not (tmp_path / "logs").exists()
    assert time.monotonic() - started < 120  # no vLLM install or start was tried


def test_help_explains_the_flag(tmp_path: Path) -> None:
    for command in ("gateway", "up"):
        done = _cli([command, "--help"], _clean_env(), tmp_path)
        assert "--admin-open" in done.stdout and "127.0.0.1" in done.stdout


def _dockerfile_gateway_env() -> dict[str, str]:
    """The ENV and CMD of the Dockerfile's gateway stage."""
    stage = (DEPLOY / "Dockerfile").read_text().split("AS gateway", 1)[1]
    env = dict(re.findall(r"(NEXTSTATE_[A-Z_]+)=(\S+)", re.search(r"^ENV (.+)$", stage, re.M).group(1)))
    assert re.search(r'^ENTRYPOINT \["nextstate"\]$', stage, re.M) and re.search(r'^CMD \["gateway"\]$', stage, re.M)
    return env


def _compose_gateway_env() -> dict[str, str]:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    service = compose["services"]["gateway"]
    assert service["command"] == ["gateway"]
    return {k: str(v) for k, v in service["environment"].items() if k == "NEXTSTATE_HOST"}


def _k8s_secrets() -> dict[str, str]:
    lines = (DEPLOY / "k8s" / "secrets.env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.startswith("NEXTSTATE_") and "=" in line)


@pytest.mark.parametrize("manifest", ["dockerfile", "compose"])
def test_deploy_entry_points_refuse_without_the_admin_token(manifest: str, tmp_path: Path) -> None:
    """The images run `nextstate gateway` on 0.0.0.0; without the secret's admin token it stops with the
    message instead of serving every conversation to the network."""
    env = _dockerfile_gateway_env() if manifest == "dockerfile" else _compose_gateway_env()
    assert env["NEXTSTATE_HOST"] == "0.0.0.0"
    done = _cli(["gateway"], _clean_env(**env, NEXTSTATE_UPSTREAM_URL="http://127.0.0.1:9/v1"), tmp_path)
    assert done.returncode == 2 and REFUSAL in done.stderr, done.stderr
    assert "NEXTSTATE_ADMIN_TOKEN" in _k8s_secrets()  # what the Kubernetes overlays give it


@pytest.mark.parametrize("how", ["token", "admin-open"])
def test_a_gateway_beyond_loopback_starts_with_a_token_or_the_flag(how: str, tmp_path: Path) -> None:
    upstream = SilentUpstream()
    env = {**_dockerfile_gateway_env(), "NEXTSTATE_UPSTREAM_MODEL": "m"}
    env.pop("NEXTSTATE_PORT")
    if how == "token":
        env["NEXTSTATE_ADMIN_TOKEN"] = "s3cret-admin"
    gw = GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", upstream_url=upstream.base_url,
                        env=env)
    gw.env = {k: v for k, v in gw.env.items() if k not in ("NEXTSTATE_ADMIN_TOKEN", "NEXTSTATE_ADMIN_PASSWORD",
                                                              "NEXTSTATE_ADMIN_OPEN") or k in env}
    if how == "admin-open":
        gw.args.append("--admin-open")
    try:
        gw.start(timeout=240)
        sessions = httpx.get(f"{gw.url}/api/sessions", timeout=30)
        assert sessions.status_code == (401 if how == "token" else 200), sessions.text
        if how == "token":
            authed = httpx.get(f"{gw.url}/api/sessions", headers={"Authorization": "Bearer s3cret-admin"}, timeout=30)
            assert authed.status_code == 200
    finally:
        gw.stop()
        upstream.close()
