"""`nextstate`: the command line. Each subcommand's --help is its manual."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from nextstate.settings import Settings


def _settings(**overrides: Any) -> Settings:
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except (ValidationError, ValueError) as exc:
        raise click.UsageError(f"invalid settings: {exc}") from exc


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "LiteLLM", "LiteLLM Router", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="nextstate")
def main() -> None:
    """nextstate: an OpenAI-compatible proxy that turns every agent call into training signal.

    Point an agent's base_url at the gateway; every call is served by the upstream model
    server (vLLM, or any LiteLLM provider) and captured, with its next state, into the
    datapool.

    Every option can also be set in the environment as NEXTSTATE_<OPTION> (e.g.
    NEXTSTATE_DATABASE_URL) or in a YAML/TOML file named by NEXTSTATE_CONFIG.
    """


def _serve_gateway(settings: Settings, migrate: bool) -> None:
    """Serve until interrupted; prints `base_url: ...` once the socket accepts connections."""
    import uvicorn

    from datapool.db import upgrade
    from gateway.app import create_app

    if migrate:
        upgrade(settings.resolved_database_url)
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=10)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                click.echo(f"base_url: http://{settings.host}:{settings.port}/v1")

    Server(config).run()


@main.command()
@click.option("--upstream", "upstream_url", metavar="URL",
              help="Base URL (…/v1) of one OpenAI-compatible vLLM server. [env NEXTSTATE_UPSTREAM_URL]")
@click.option("--model-list", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="LiteLLM-style model list (YAML) for several upstreams. [env NEXTSTATE_MODEL_LIST]")
@click.option("--port", type=int, help="Port to listen on (default 8400). [env NEXTSTATE_PORT]")
@click.option("--host", help="Address to bind (default 127.0.0.1). [env NEXTSTATE_HOST]")
@click.option("--database-url", metavar="DSN",
              help="SQLAlchemy URL of the pool (default: SQLite in the data dir). [env NEXTSTATE_DATABASE_URL]")
@click.option("--migrate/--no-migrate", default=False, show_default=True,
              help="Upgrade the pool's schema before serving.")
@click.option("--log-level", default="info", show_default=True)
def gateway(upstream_url: str | None, model_list: Path | None, port: int | None, host: str | None,
            database_url: str | None, migrate: bool, log_level: str) -> None:
    """Run the gateway alone, in front of running upstreams.

    \b
    Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
    the same under /s/{session_id}/v1/..., GET /api/sessions[/{id}],
    GET /healthz, /readyz, /metrics.

    \b
    Example:
      nextstate gateway --upstream http://127.0.0.1:8401/v1 --port 8400 \\
          --database-url postgresql+psycopg://postgres@127.0.0.1/nextstate
    """
    _logging(log_level)
    settings = _settings(upstream_url=upstream_url, model_list=model_list, port=port, host=host,
                         database_url=database_url)
    if not settings.upstream_url and not settings.model_list:
        raise click.UsageError("give --upstream URL or --model-list FILE (or NEXTSTATE_UPSTREAM_URL)")
    _serve_gateway(settings, migrate)


@main.command()
@click.option("--database-url", metavar="DSN", help="The pool. [env NEXTSTATE_DATABASE_URL]")
@click.option("--broker-url", metavar="URL",
              help="Celery broker (default: SQLite file in the data dir). [env NEXTSTATE_BROKER_URL]")
@click.option("--concurrency", type=int, help="Scoring tasks at once (default 4). [env NEXTSTATE_WORKER_CONCURRENCY]")
@click.option("--beat/--no-beat", default=True, show_default=True,
              help="Also run the periodic sweep (re-queues lost tasks, ends idle sessions). "
                   "Run it in one worker of a fleet.")
@click.option("--log-level", default="info", show_default=True)
def worker(database_url: str | None, broker_url: str | None, concurrency: int | None, beat: bool,
           log_level: str) -> None:
    """Run a Celery worker that scores turns: m judge votes per turn given its next state,
    the majority reward, hints, and teacher logprobs for hinted turns.

    \b
    The judge is set in the environment: NEXTSTATE_JUDGE_BACKEND=llm (default; NEXTSTATE_JUDGE_MODEL,
    default the local vLLM) or =python with NEXTSTATE_JUDGE_PYTHON=module:function.
    NEXTSTATE_JUDGE_VOTES sets m (default 3).
    """
    from datapool.worker import build_worker_app

    _logging(log_level)
    settings = _settings(database_url=database_url, broker_url=broker_url, worker_concurrency=concurrency)
    try:
        app = build_worker_app(settings)
    except (ValueError, ImportError, AttributeError) as exc:
        raise click.UsageError(f"cannot set up the judge: {exc}") from exc
    argv = ["worker", "--pool", "threads", "--concurrency", str(settings.worker_concurrency),
            "--loglevel", log_level.upper(), "--without-gossip", "--without-mingle",
            "--queues", settings.queue]
    if beat:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        argv += ["--beat", "--schedule", str(settings.data_dir / f"beat-{settings.queue}")]
    app.worker_main(argv)


@main.group()
def db() -> None:
    """The pool's schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--database-url", metavar="DSN", help="[env NEXTSTATE_DATABASE_URL]")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(database_url: str | None, revision: str) -> None:
    """Apply migrations up to REVISION (works on PostgreSQL and SQLite)."""
    from datapool.db import current_revision, upgrade

    url = _settings(database_url=database_url).resolved_database_url
    upgrade(url, revision)
    click.echo(f"pool at revision {current_revision(url)}")


@db.command("current")
@click.option("--database-url", metavar="DSN", help="[env NEXTSTATE_DATABASE_URL]")
def db_current(database_url: str | None) -> None:
    """Print the pool's schema revision."""
    from datapool.db import current_revision

    click.echo(current_revision(_settings(database_url=database_url).resolved_database_url) or "empty")


@main.command()
@click.option("--port", type=int, help="Gateway port (default 8400). [env NEXTSTATE_PORT]")
@click.option("--vllm-port", type=int, help="Policy vLLM port (default 8401). [env NEXTSTATE_VLLM_PORT]")
@click.option("--database-url", metavar="DSN", help="Pool (default: SQLite in the data dir).")
@click.option("--scoring/--no-scoring", default=True, show_default=True,
              help="Also run a scoring worker (LLM judge on the local vLLM) and the teacher vLLM replica.")
@click.option("--log-level", default="info", show_default=True)
def up(port: int | None, vllm_port: int | None, database_url: str | None, scoring: bool, log_level: str) -> None:
    """Everything on this machine: vLLM serving SmolLM2-135M-Instruct, the pool, the gateway,
    and a scoring worker.

    \b
    The first run installs vLLM (the CPU build where there is no GPU) in its own virtualenv and
    converts the model once; both are cached in the cache dir. Processes:
      vLLM (policy, LoRA hot-loading)    127.0.0.1:8401
      vLLM (teacher replica, scoring)    127.0.0.1:8402   one request at a time
      worker (Celery, SQLite broker)     scores turns with the LLM judge
      gateway                            127.0.0.1:8400   prints `base_url: ...` when ready
    Ctrl-C stops everything.
    """
    import contextlib
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from datapool.db import upgrade
    from nextstate.modelserver import TEACHER_ARGS, VLLMServer, ensure_model, ensure_vllm_env

    _logging(log_level)
    settings = _settings(port=port, vllm_port=vllm_port, database_url=database_url)
    python = ensure_vllm_env(settings.cache_dir)
    model_dir = ensure_model(settings.cache_dir, python)
    upgrade(settings.resolved_database_url)
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [VLLMServer(python, model_dir, served_name=settings.vllm_served_name, host="127.0.0.1",
                          port=settings.vllm_port, log_path=logs / "vllm.log")]
    if scoring:
        servers.append(VLLMServer(python, model_dir, served_name=settings.vllm_served_name, host="127.0.0.1",
                                  port=settings.teacher_vllm_port, log_path=logs / "vllm-teacher.log",
                                  extra_args=TEACHER_ARGS))
    click.echo(f"starting vLLM on 127.0.0.1:{settings.vllm_port}"
               + (f" and its teacher replica on :{settings.teacher_vllm_port}" if scoring else "")
               + f" (logs in {logs}) ...")
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            for started in [pool.submit(server.start) for server in servers]:
                started.result()
        settings = settings.model_copy(update={
            "upstream_url": servers[0].base_url, "upstream_model": settings.vllm_served_name,
            "teacher_url": servers[-1].base_url if scoring else None})
        if scoring:
            env = {**os.environ, "NEXTSTATE_UPSTREAM_URL": servers[0].base_url,
                   "NEXTSTATE_UPSTREAM_MODEL": settings.vllm_served_name,
                   "NEXTSTATE_TEACHER_URL": servers[1].base_url,
                   "NEXTSTATE_DATABASE_URL": settings.resolved_database_url}
            worker_log = open(logs / "worker.log", "ab")
            worker = subprocess.Popen([sys.executable, "-m", "nextstate.cli", "worker", "--log-level", log_level],
                                      env=env, stdout=worker_log, stderr=subprocess.STDOUT)
            stack.callback(worker.wait, 30)
            stack.callback(worker.terminate)
            click.echo(f"worker: LLM judge on {settings.vllm_served_name} (log: {logs / 'worker.log'})")
        click.echo(f"pool: {settings.resolved_database_url}")
        click.echo(f"model: {settings.vllm_served_name} (also as `policy`)")
        _serve_gateway(settings, migrate=False)


def _register_optional() -> None:
    from nextstate.modelserver import vllm_cli

    main.add_command(vllm_cli)


_register_optional()

if __name__ == "__main__":
    sys.exit(main())
