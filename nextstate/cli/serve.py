"""Commands that run nextstate's processes and look after the pool: gateway, worker, up, db, config."""

from __future__ import annotations

from pathlib import Path

import click

from base.errors import AdminExposed
from base.settings import Settings, check_admin_exposure
from base.vocab import Objective
from nextstate.cli import options as opt


ADMIN_OPEN = click.option(
    "--admin-open", is_flag=True, default=None,
    help="Serve the admin API and UI without credentials although the gateway listens beyond "
         "127.0.0.1. Without it (or an admin token or password) such a gateway refuses to start. "
         "[env NEXTSTATE_ADMIN_OPEN]")


def _check_admin_exposure(settings: Settings) -> None:
    try:
        check_admin_exposure(settings)
    except AdminExposed as exc:
        raise click.UsageError(str(exc)) from exc


@click.command()
@click.option("--upstream", "upstream_url", metavar="URL",
              help="Base URL (…/v1) of one OpenAI-compatible vLLM server. [env NEXTSTATE_UPSTREAM_URL]")
@click.option("--model-list", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="LiteLLM-style model list (YAML) for several upstreams. [env NEXTSTATE_MODEL_LIST]")
@click.option("--port", type=int, help="Port to listen on (default 8400). [env NEXTSTATE_PORT]")
@click.option("--host", help="Address to bind (default 127.0.0.1). [env NEXTSTATE_HOST]")
@opt.database_url(opt.DB_HELP)
@click.option("--migrate/--no-migrate", default=False, show_default=True,
              help="Upgrade the pool's schema before serving.")
@ADMIN_OPEN
@opt.log_level()
def gateway(upstream_url: str | None, model_list: Path | None, port: int | None, host: str | None,
            database_url: str | None, migrate: bool, admin_open: bool | None, log_level: str) -> None:
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
    opt.setup_logging(log_level)
    settings = opt.settings(upstream_url=upstream_url, model_list=model_list, port=port, host=host,
                         database_url=database_url, admin_open=admin_open)
    if not settings.upstream_url and not settings.model_list:
        raise click.UsageError("give --upstream URL or --model-list FILE (or NEXTSTATE_UPSTREAM_URL)")
    _check_admin_exposure(settings)  # create_app checks too; here before the slow imports
    if migrate:
        from datapool.db import upgrade

        upgrade(settings.resolved_database_url)
    from nextstate.gateway_server import gateway_server

    gateway_server(settings).run()


@click.command()
@opt.database_url("The pool. [env NEXTSTATE_DATABASE_URL]")
@click.option("--broker-url", metavar="URL",
              help="Celery broker (default: SQLite file in the data dir). [env NEXTSTATE_BROKER_URL]")
@click.option("--concurrency", type=int, help="Scoring tasks at once (default 4). [env NEXTSTATE_WORKER_CONCURRENCY]")
@click.option("--beat/--no-beat", default=True, show_default=True,
              help="Also run the periodic sweep (re-queues lost tasks, ends idle sessions). "
                   "Run it in one worker of a fleet.")
@opt.log_level()
def worker(database_url: str | None, broker_url: str | None, concurrency: int | None, beat: bool,
           log_level: str) -> None:
    """Run a Celery worker that scores turns: m judge votes per turn given its next state,
    the majority reward, hints, and teacher logprobs for hinted turns.

    \b
    The judge is set in the environment: NEXTSTATE_JUDGE_BACKEND=llm (default; NEXTSTATE_JUDGE_MODEL,
    default the local vLLM) or =python with NEXTSTATE_JUDGE_PYTHON=module:function.
    NEXTSTATE_JUDGE_VOTES sets m (default 3).
    """
    from scoring.worker import build_worker_app

    opt.setup_logging(log_level)
    settings = opt.settings(database_url=database_url, broker_url=broker_url, worker_concurrency=concurrency)
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


@click.group()
def db() -> None:
    """The pool's schema (Alembic migrations)."""


@db.command("upgrade")
@opt.database_url()
@click.option("--revision", default="head", show_default=True)
def db_upgrade(database_url: str | None, revision: str) -> None:
    """Apply migrations up to REVISION (works on PostgreSQL and SQLite)."""
    from datapool.db import current_revision, upgrade

    url = opt.settings(database_url=database_url).resolved_database_url
    upgrade(url, revision)
    click.echo(f"pool at revision {current_revision(url)}")


@db.command("current")
@opt.database_url()
def db_current(database_url: str | None) -> None:
    """Print the pool's schema revision."""
    from datapool.db import current_revision

    click.echo(current_revision(opt.settings(database_url=database_url).resolved_database_url) or "empty")


@db.command("expire")
@opt.database_url()
@click.option("--days", type=click.FloatRange(min=0, min_open=True),
              help="Expire content older than this. Default: NEXTSTATE_RETENTION_DAYS.")
@click.option("--dry-run", is_flag=True, help="Count what would expire; change nothing.")
def db_expire(database_url: str | None, days: float | None, dry_run: bool) -> None:
    """Expire the raw content of turns older than the retention period (docs/security.md):
    requests, replies, next states, token ids, hints and tool-call arguments go; the rows, their
    rewards, usage and timestamps stay, and no training batch takes an expired turn again. The
    eval gate's stored replies older than that are deleted. Each chunk is one transaction with
    its audit entry. The worker's sweep does the same periodically when retention_days is set."""
    from datapool import audit, retention
    from datapool.db import make_engine

    settings = opt.settings(database_url=database_url)
    days = days or settings.retention_days
    if not days:
        raise click.UsageError("no retention period: pass --days or set NEXTSTATE_RETENTION_DAYS")
    engine = make_engine(settings.resolved_database_url)
    try:
        done = retention.expire(engine, days, actor=audit.cli_actor(), dry_run=dry_run)
    finally:
        engine.dispose()
    verb = "would expire" if dry_run else "expired"
    click.echo(f"{verb} {done['turns']} turn(s) and {done['eval_replies']} eval reply(ies) created before {done['cutoff']}")


@db.command("rehash")
@opt.database_url()
def db_rehash(database_url: str | None) -> None:
    """Recompute the hashes computed from messages with this version's canonical form of
    messages (docs/sessions.md): those that stitch sessions (each turn's link hash and
    continuations) and those that pair the eval gate's held-out prompts across versions.

    `db upgrade` does this once when the form changes (migrations 0007 and 0011); run it by hand
    only to repair a pool. One transaction; safe to repeat. Links already made stay as they are."""
    from datapool import evals, sessions
    from datapool.db import make_engine

    engine = make_engine(opt.settings(database_url=database_url).resolved_database_url)
    try:
        with engine.begin() as conn:
            seen, changed = sessions.rehash(conn)
            replies, rehashed = evals.rehash(conn)
    finally:
        engine.dispose()
    click.echo(f"{seen} turns read, {changed} rehashed; {replies} held-out replies read, {rehashed} rehashed")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", type=int, help="Gateway port (default 8400). [env NEXTSTATE_PORT]")
@click.option("--vllm-port", type=int, help="Policy vLLM port (default 8401). [env NEXTSTATE_VLLM_PORT]")
@opt.database_url("Pool (default: SQLite in the data dir).")
@click.option("--scoring/--no-scoring", default=True, show_default=True,
              help="Also run a scoring worker (LLM judge on the local vLLM) and the teacher vLLM replica.")
@click.option("--vllm-dev-mode/--no-vllm-dev-mode", default=None,
              help="Start vLLM with its development endpoints (VLLM_SERVER_DEV_MODE=1), needed to publish "
                   "full fine-tuned weights (`train --full`). Unauthenticated: the servers listen on "
                   "127.0.0.1 only. [env NEXTSTATE_VLLM_DEV_MODE, default off]")
@click.option("--train", "train_objective", type=opt.choice(Objective),
              help="Also run the online trainer with this objective (`nextstate train --online`; "
                   "its log: <data dir>/logs/trainer.log). Needs the `train` extra (`make up` installs it).")
@click.option("--restarts", default=5, show_default=True, type=click.IntRange(min=0),
              help="Restarts in a row of a child that exits before `up` gives up and exits 1.")
@ADMIN_OPEN
@opt.log_level()
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TRAIN OPTIONS]")
def up(port: int | None, vllm_port: int | None, database_url: str | None, scoring: bool,
       vllm_dev_mode: bool | None, train_objective: str | None, restarts: int, admin_open: bool | None,
       log_level: str, train_args: tuple[str, ...]) -> None:
    """Everything on this machine: vLLM serving SmolLM2-135M-Instruct, the pool, the gateway,
    and a scoring worker.

    \b
    The first run installs vLLM (the CPU build where there is no GPU) in its own virtualenv and
    converts the model once; both are cached in the cache dir. Processes:
      vLLM (policy, LoRA hot-loading)    127.0.0.1:8401
      vLLM (teacher replica, scoring)    127.0.0.1:8402   one request at a time
      worker (Celery, SQLite broker)     scores turns with the LLM judge: by default SmolLM2
                                         judging itself; NEXTSTATE_JUDGE_MODEL=<any LiteLLM
                                         model> (its key in the environment) for a stronger one
      trainer (with --train)             `nextstate train --online`; options after `--` go to it,
                                         e.g. `nextstate up --train combined -- --k 8`
      gateway                            127.0.0.1:8400   prints `base_url: ...` when ready

    \b
    Supervised: a process that exits is reported here and in the gateway's /readyz and
    /metrics, and started again after 1, 2, 4 ... 30 s (a vLLM gets the active policy
    version loaded before it serves `policy` again); after --restarts restarts in a row
    `up` stops everything and exits 1 with the reason. Ctrl-C, SIGTERM and SIGHUP stop
    every process.
    """
    from nextstate.up import Up

    if train_args and not train_objective:
        raise click.UsageError(f"got unexpected arguments {' '.join(train_args)} (options after `--` go to "
                               "the trainer: give --train OBJECTIVE)")
    if train_args and train_args[0] == "--":
        train_args = train_args[1:]
    opt.setup_logging(log_level)
    settings = opt.settings(port=port, vllm_port=vllm_port, database_url=database_url, admin_open=admin_open)
    _check_admin_exposure(settings)  # before minutes of starting vLLM
    if vllm_dev_mode is not None:
        settings = settings.model_copy(update={"vllm_dev_mode": vllm_dev_mode})
    Up(settings, scoring=scoring, train_objective=train_objective, train_args=train_args, log_level=log_level,
       restarts=restarts).run()


@click.group("config")
def config_group() -> None:
    """The settings every process reads: print the reference and the compose .env.example,
    both generated from base/settings.py."""


@config_group.command("reference")
def config_reference() -> None:
    """Print the configuration reference (Markdown), as committed in docs/configuration.md.

    \b
    nextstate config reference > docs/configuration.md
    """
    from nextstate.configref import reference_markdown

    click.echo(reference_markdown(), nl=False)


@config_group.command("env-example")
def config_env_example() -> None:
    """Print the documented environment file, as committed in deploy/compose/.env.example.

    \b
    nextstate config env-example > deploy/compose/.env.example
    """
    from nextstate.configref import env_example

    click.echo(env_example(), nl=False)
