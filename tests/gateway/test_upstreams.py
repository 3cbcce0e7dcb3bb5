"""gateway.upstream: the LiteLLM Router only where a model list needs one (a group of several
deployments, a provider other than vLLM); a gateway in front of vLLM alone never imports LiteLLM
(seconds of CPU at every gateway start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp

from gateway.upstream import POLICY_ALIAS, Upstreams
from tests.support import REPO


def _vllm(group: str, base: str, served: str = "smollm2") -> dict[str, object]:
    return {"model_name": group, "litellm_params": {"model": f"hosted_vllm/{served}", "api_base": base}}


async def test_vllm_alone_builds_no_router_and_resolves_each_group() -> None:
    async with aiohttp.ClientSession() as http:
        up = Upstreams(http, model_list=[_vllm("smollm2", "http://a:1/v1/"), _vllm("other", "http://b:2/v1", "m2")])
        assert up.router is None
        assert await up.groups() == {"smollm2": True, "other": True}
        target = await up.resolve(POLICY_ALIAS)
        assert (target.group, target.served_name, target.api_base, target.white_box) == (
            "smollm2", "smollm2", "http://a:1/v1", True)
        assert (await up.resolve("other")).api_base == "http://b:2/v1"
        assert [d["model_name"] for d in up.deployments or []] == ["smollm2", "other"]


async def test_a_group_of_several_deployments_is_chosen_by_the_router() -> None:
    bases = {"http://a:1/v1", "http://b:2/v1"}
    async with aiohttp.ClientSession() as http:
        up = Upstreams(http, model_list=[_vllm("smollm2", b) for b in sorted(bases)])
        assert up.router is not None
        picked = {(await up.resolve("smollm2")).api_base for _ in range(40)}
        assert picked <= bases and picked  # the Router's choice, from the group's own deployments


async def test_another_provider_is_reached_through_the_router() -> None:
    async with aiohttp.ClientSession() as http:
        up = Upstreams(http, model_list=[
            _vllm("smollm2", "http://a:1/v1"),
            {"model_name": "hosted", "litellm_params": {"model": "openai/gpt-x", "api_base": "http://c:3/v1"}}])
        assert up.router is not None
        target = await up.resolve("hosted")
        assert (target.white_box, target.served_name, target.policy_version) == (False, "openai/gpt-x", None)
        assert up.policy_model == "smollm2"


def test_a_gateway_in_front_of_vllm_imports_no_litellm(tmp_path: Path) -> None:
    """The app built, its lifespan run (the vLLM watch, /readyz's upstream check) and a vLLM-only
    model list resolved: LiteLLM stays unimported. A fresh interpreter, since this one has it."""
    code = textwrap.dedent(f"""
        import asyncio, sys
        import aiohttp
        from fastapi.testclient import TestClient
        from base.settings import Settings
        from gateway.app import create_app
        from gateway.upstream import Upstreams
        import nextstate.cli
        settings = Settings(database_url="sqlite:///{tmp_path / 'pool.db'}", upstream_url="http://127.0.0.1:9/v1",
                            data_dir="{tmp_path}")
        from datapool.db import upgrade
        upgrade(settings.resolved_database_url)
        with TestClient(create_app(settings)) as client:
            assert client.get("/healthz").status_code == 200
            client.get("/readyz")
        async def resolve():
            async with aiohttp.ClientSession() as http:
                up = Upstreams(http, model_list=[{{"model_name": "m", "litellm_params": {{
                    "model": "hosted_vllm/m", "api_base": "http://127.0.0.1:9/v1"}}}}])
                return (await up.resolve("policy")).served_name
        assert asyncio.run(resolve()) == "m"
        print(sorted(m for m in sys.modules if m.split(".")[0] == "litellm")[:5])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
