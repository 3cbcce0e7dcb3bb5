"""Where a request goes: the LiteLLM Router picks a deployment of the requested model group.

Deployments whose LiteLLM model is ``hosted_vllm/...`` are vLLM servers: the gateway speaks
OpenAI's wire format to them itself (so a stream is relayed chunk for chunk and the exact token
ids come back) and captures white-box. Every other deployment is an opaque provider reached
through the Router's own ``acompletion`` (provider translation, retries), captured black-box.

The Router (LiteLLM, seconds of CPU to import) is built only where it has work: a model list
with a provider other than vLLM or a group of several deployments. A gateway in front of vLLM
alone, one deployment per group (``--upstream URL``), never imports LiteLLM for its routing.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yaml

from base.errors import RequestError
from gateway.errors import unavailable
from base.vocab import VersionKind

if TYPE_CHECKING:
    from litellm import Router

POLICY_ALIAS = "policy"
VLLM_PREFIX = "hosted_vllm/"


@dataclass(frozen=True)
class Target:
    """A resolved request destination."""

    group: str  # the model group the Router picked from
    white_box: bool
    served_name: str  # the model name sent upstream
    api_base: str | None
    api_key: str | None
    policy_version: str | None


@dataclass(frozen=True)
class ActiveVersion:
    name: str  # the version's name: vLLM serves a LoRA version under it
    kind: str = VersionKind.LORA  # "full": its weights replaced the base's in place, served under the base's name

    @property
    def full(self) -> bool:
        return self.kind == VersionKind.FULL


def load_model_list(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """Read a LiteLLM-style model list file: ``model_list:`` and an optional ``policy_model:``."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read model list {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("model_list"), list) or not doc["model_list"]:
        raise ValueError(f"{path}: expected a mapping with a non-empty `model_list`")
    for i, entry in enumerate(doc["model_list"]):
        if not isinstance(entry, dict) or "model_name" not in entry or "model" not in entry.get(
            "litellm_params", {}
        ):
            raise ValueError(f"{path}: model_list[{i}] needs model_name and litellm_params.model")
    return doc["model_list"], doc.get("policy_model")


def base_of(deployment: dict[str, Any]) -> str:
    """A deployment's ``api_base`` without a trailing slash ('' for none)."""
    return str(deployment["litellm_params"].get("api_base") or "").rstrip("/")


def is_vllm(deployment: dict[str, Any]) -> bool:
    """A vLLM deployment (``hosted_vllm/...``): white-box capture."""
    return str(deployment["litellm_params"]["model"]).startswith(VLLM_PREFIX)


def _secret(value: str | None) -> str | None:
    # LiteLLM's convention: "os.environ/NAME" reads the key from the environment at call time
    if value and value.startswith("os.environ/"):
        return os.environ.get(value.removeprefix("os.environ/"))
    return value


class Upstreams:
    """The configured model groups, the Router over them, and the ``policy`` alias."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        *,
        model_list: list[dict[str, Any]] | None = None,
        upstream_url: str | None = None,
        upstream_model: str | None = None,
        policy_model: str | None = None,
    ):
        if not model_list and not upstream_url:
            raise ValueError("no upstream: give --upstream URL or --model-list FILE")
        self.http = http
        self.upstream_url = upstream_url.rstrip("/") if upstream_url else None
        self.upstream_model = upstream_model
        self._policy_model = policy_model
        self._model_list: list[dict[str, Any]] | None = None  # once built: every deployment
        self._router: Router | None = None
        self._groups: dict[str, bool] = {}  # group -> white-box
        self._single: dict[str, dict[str, Any]] = {}  # group -> its only deployment
        self._by_group: dict[str, list[dict[str, Any]]] = {}  # group -> its deployments
        self._lock = asyncio.Lock()
        self.active_version: ActiveVersion | None = None
        #: whether a vLLM base URL (``…/v1``) is out of service now (the gateway's VLLMWatch: down,
        #: or loading the active version after a restart); a group of several deployments sends
        #: its requests to the others meanwhile
        self.out_of_service: Callable[[str], bool] | None = None
        if model_list:
            self._build(model_list)

    def _build(self, model_list: list[dict[str, Any]]) -> None:
        self._groups = {}
        by_group: dict[str, list[dict[str, Any]]] = {}
        for entry in model_list:
            white = is_vllm(entry)
            self._groups[entry["model_name"]] = self._groups.get(entry["model_name"], True) and white
            by_group.setdefault(entry["model_name"], []).append(entry)
        # A group of one deployment has nothing to choose: skip the Router's selection (its
        # cooldown and tracing bookkeeping cost more than the rest of the request path).
        self._single = {g: d[0] for g, d in by_group.items() if len(d) == 1}
        self._by_group = by_group
        # The Router where it has work, built (and its config checked) now: a group to choose
        # from, or a provider reached through its acompletion. vLLM alone needs none.
        if len(self._single) < len(by_group) or not all(self._groups.values()):
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost-map download at import
            from litellm import Router

            self._router = Router(model_list=model_list, num_retries=0)
        self._model_list = model_list
        if self._policy_model is None:
            self._policy_model = next((g for g, white in self._groups.items() if white), None)
        elif self._policy_model not in self._groups:
            raise ValueError(f"policy_model {self._policy_model!r} is not a model group in the list")

    async def _ensure(self) -> list[dict[str, Any]]:
        if self._model_list is not None:
            return self._model_list
        async with self._lock:
            if self._model_list is None:
                names = [self.upstream_model] if self.upstream_model else await self._discover()
                self._build(
                    [
                        {
                            "model_name": name,
                            "litellm_params": {"model": VLLM_PREFIX + name, "api_base": self.upstream_url},
                        }
                        for name in names
                    ]
                )
        assert self._model_list is not None
        return self._model_list

    async def _discover(self) -> list[str]:
        url = f"{self.upstream_url}/models"
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=5.0),
                                     raise_for_status=True) as resp:
                names = [m["id"] for m in (await resp.json(content_type=None))["data"]]
        except (TimeoutError, aiohttp.ClientError, KeyError, TypeError, ValueError) as exc:
            raise unavailable(str(self.upstream_url), f"is unreachable ({type(exc).__name__}: {exc})") from exc
        if not names:
            raise RequestError(502, f"upstream {self.upstream_url} serves no models")
        return names

    @property
    def router(self) -> Router | None:
        """The LiteLLM Router, where the model list needs one (see the module's doc)."""
        return self._router

    @property
    def deployments(self) -> list[dict[str, Any]] | None:
        """Every deployment (LiteLLM model-list entries); None until the first request has
        discovered what ``--upstream`` serves."""
        return self._model_list

    @property
    def policy_model(self) -> str | None:
        return self._policy_model

    async def groups(self) -> dict[str, bool]:
        await self._ensure()
        return dict(self._groups)

    async def resolve(self, model: str, *, avoid: str | None = None) -> Target:
        """The deployment that serves ``model`` now; 404 for a model nobody serves. *avoid*: a
        vLLM base URL not to pick where the group has another (a replica that just failed)."""
        await self._ensure()
        group = model
        served: str | None = None
        version: str | None = None
        if model == POLICY_ALIAS:
            if self._policy_model is None:
                raise RequestError(404, "no vLLM model is configured to serve the `policy` alias",
                                  code="model_not_found", param="model")
            group = self._policy_model
            if self.active_version is not None:
                version = self.active_version.name
                served = None if self.active_version.full else version
        if group not in self._groups:
            raise RequestError(404, f"the model `{model}` does not exist", code="model_not_found",
                              param="model")
        deployment = self._single.get(group)
        if deployment is None:
            assert self._router is not None  # built for every group of several deployments
            deployment = await self._router.select(group, {})
            skip, out = (avoid or "").rstrip("/"), self.out_of_service

            def usable(d: dict[str, Any]) -> bool:
                return (base := base_of(d)) != skip and not (out is not None and out(base))

            if not usable(deployment):
                # a replica that died or is loading the active version again: the others serve
                # (a warm standby); with none left, the picked one answers 503 + Retry-After
                serving = [d for d in self._by_group[group] if usable(d)]
                deployment = random.choice(serving) if serving else deployment
        params = deployment["litellm_params"]
        white = is_vllm(deployment)
        upstream_name = str(params["model"]).removeprefix(VLLM_PREFIX)
        served = served or upstream_name
        if white and version is None:
            # naming the policy's base directly reaches a full version's weights all the same
            active = self.active_version
            version = active.name if active is not None and active.full and group == self._policy_model else served
        return Target(
            group=group,
            white_box=white,
            served_name=served,
            api_base=base_of(deployment) or None,
            api_key=_secret(params.get("api_key")),
            policy_version=version if white else None,
        )

    async def check(self) -> dict[str, str]:
        """Reachability of each vLLM deployment, for /readyz."""
        try:
            deployments = await self._ensure()
        except RequestError as exc:
            return {self.upstream_url or "upstream": exc.message}
        bases = {base_of(d) for d in deployments if is_vllm(d)}
        results: dict[str, str] = {}
        for base in sorted(b for b in bases if b):
            try:
                async with self.http.get(f"{base}/models",
                                         timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                    results[base] = "ok" if r.status == 200 else f"HTTP {r.status}"
            except (TimeoutError, aiohttp.ClientError) as exc:
                results[base] = f"unreachable: {type(exc).__name__}"
        return results

    def groups_without_replica(self, checked: dict[str, str]) -> list[str]:
        """The model groups none of whose vLLM deployments answered in *checked* (:meth:`check`'s
        result): a group of replicas keeps serving while one of them is down, so only these
        make the gateway unready."""
        if self._model_list is None:  # nothing discovered: the one --upstream (its URL) is the group
            return [] if all(v == "ok" for v in checked.values()) else list(checked)
        unserved = []
        for group, deployments in self._by_group.items():
            bases = [base_of(d) for d in deployments if is_vllm(d) and base_of(d)]
            if bases and not any(checked.get(base) == "ok" for base in bases):
                unserved.append(group)
        return sorted(unserved)
