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


@main.command()
@click.option("--objective", type=click.Choice(["rl", "opd", "combined"]), required=True,
              help="rl: binary RL (PPO clip on r, GRPO within task groups); opd: hindsight OPD toward "
                   "the teacher logprobs of hinted turns; combined: w_rl·r + w_opd·(teacher − student).")
@click.option("--steps", type=int, help="Stop after this many optimizer steps.")
@click.option("--epochs", type=int, default=1, show_default=True,
              help="Passes over the pool; each pass trains every matching turn once.")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Turns per optimizer step.")
@click.option("--micro-batch-size", type=int, default=4, show_default=True, help="Turns per forward pass.")
@click.option("--lr", type=float, default=5e-5, show_default=True)
@click.option("--full", is_flag=True, help="Full fine-tuning instead of LoRA.")
@click.option("--lora-rank", type=int, default=8, show_default=True)
@click.option("--kl-coef", type=float, default=0.0, show_default=True, help="k3 KL to the base policy (LoRA only).")
@click.option("--w-rl", type=float, default=1.0, show_default=True, help="combined: weight of the reward term.")
@click.option("--w-opd", type=float, default=1.0, show_default=True, help="combined: weight of the OPD term.")
@click.option("--loss-agg-mode", default="token-mean", show_default=True,
              help="veRL's loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, ...")
@click.option("--since", type=click.DateTime(), help="Only turns captured at or after this time (UTC).")
@click.option("--until", type=click.DateTime(), help="Only turns captured before this time (UTC).")
@click.option("--min-abs-reward", type=float, help="Only turns with |reward| at least this.")
@click.option("--capture", type=click.Choice(["white-box", "black-box"]), help="Only this capture kind.")
@click.option("--task-id", help="Only sessions of this task.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["online", "offline"]),
              help="Only sessions of this mode (repeatable; default both). Eval sessions are never trained on.")
@click.option("--labels", "label_filters", multiple=True, metavar="LABEL",
              callback=lambda _ctx, _param, value: _label_filters(value),
              help="Only turns carrying this label (repeatable; all must hold): labeled, unlabeled, "
                   "thumb-up, thumb-down, override, correction, or tag:NAME. Turns a person excluded "
                   "are never trained on.")
@click.option("--lease-s", type=float, default=600.0, show_default=True,
              help="A leased batch not acked this long goes back to the pool (the trainer died).")
@click.option("--resume", metavar="RUN_ID", help="Continue a run whose trainer died (releases its leases).")
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The base model (default: the converted SmolLM2 in the cache dir).")
@click.option("--publish/--no-publish", default=True, show_default=True,
              help="Hot-load the new version into vLLM and make it the active `policy`.")
@click.option("--vllm-url", "vllm_urls", multiple=True, metavar="URL",
              help="vLLM servers (…/v1) to load the version into. Default: the upstream and the teacher replica.")
@click.option("--database-url", metavar="DSN", help="[env NEXTSTATE_DATABASE_URL]")
@click.option("--log-level", default="info", show_default=True)
def train(objective: str, steps: int | None, epochs: int, batch_size: int, micro_batch_size: int, lr: float,
          full: bool, lora_rank: int, kl_coef: float, w_rl: float, w_opd: float, loss_agg_mode: str,
          since: Any, until: Any, min_abs_reward: float | None, capture: str | None, task_id: str | None,
          modes: tuple[str, ...], lease_s: float, resume: str | None, model_dir: Path | None, publish: bool, vllm_urls: tuple[str, ...],
          database_url: str | None, log_level: str, label_filters: tuple[str, ...] = ()) -> None:
    """Train the policy offline from the scored turns in the pool, then publish it.

    \b
    Leases scored turns in batches (each trained once per pass; a crashed run's batch returns
    to the pool), optimises the objective with the local backend (torch + peft, LoRA by
    default, CPU or one GPU), records per-step metrics in the pool and TensorBoard
    (<data dir>/tensorboard), writes the new version to a new directory and — with
    --publish — loads it into vLLM and switches the `policy` alias to it.
    """
    from datetime import timezone

    from datapool.db import make_engine
    from trainer.lease import Filters
    from trainer.local import LocalConfig
    from trainer.objectives import ObjectiveConfig
    from trainer.offline import train_offline

    _logging(log_level)
    settings = _settings(database_url=database_url)
    if model_dir is None:
        from nextstate.modelserver import ensure_model, ensure_vllm_env

        model_dir = ensure_model(settings.cache_dir, ensure_vllm_env(settings.cache_dir))
    engine = make_engine(settings.resolved_database_url)
    utc = (lambda d: d.replace(tzinfo=timezone.utc) if d is not None else None)
    filters = Filters(since=utc(since), until=utc(until), min_abs_reward=min_abs_reward, capture=capture,
                      task_id=task_id, needs_teacher=objective == "opd", modes=modes or ("online", "offline"),
                      labels=_label_filters(label_filters))
    cfg = ObjectiveConfig(objective=objective, w_rl=w_rl, w_opd=w_opd, kl_coef=kl_coef, loss_agg_mode=loss_agg_mode)
    local = LocalConfig(model_dir=model_dir, lora=not full, lora_rank=lora_rank, lora_alpha=2 * lora_rank,
                        lr=lr, micro_batch_size=micro_batch_size)
    board_dir = settings.data_dir / "tensorboard"
    writer = None
    try:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(board_dir))
    except ImportError:
        click.echo("tensorboard not installed: metrics go to the pool only", err=True)

    from tqdm import tqdm

    bar = tqdm(total=steps, unit="step", desc=f"train {objective}", dynamic_ncols=True)

    def on_step(step: int, m: dict[str, float]) -> None:
        bar.set_postfix(loss=f"{m.get('pg_loss', float('nan')):.4f}", adv=f"{m['advantage_mean']:+.3f}",
                        clip=f"{m.get('pg_clipfrac', 0.0):.3f}", kl=f"{m.get('kl', 0.0):.4f}",
                        tok_s=f"{m['tokens_per_s']:.0f}", turns=int(m["samples"]))
        bar.update(1)
        if writer is not None:
            for key, value in m.items():
                writer.add_scalar(f"train/{key}", value, step)

    result = train_offline(engine, objective=cfg, local=local, filters=filters, batch_size=batch_size,
                           max_steps=steps, epochs=epochs, lease_s=lease_s,
                           output_root=settings.data_dir / "runs", resume=resume, on_step=on_step)
    bar.close()
    if writer is not None:
        writer.close()
    if result.output_dir is None:
        click.echo("nothing to train on: no scored turn matches (see `GET /api/judgements`)")
        return
    click.echo(f"run {result.run_id}: {result.steps} steps over {result.turns} turns; saved {result.output_dir}")
    if publish:
        if full:
            raise click.UsageError("publishing full weights is not supported yet; use LoRA or --no-publish")
        from trainer.publish import publish_adapter

        urls = list(vllm_urls) or [settings.local_vllm_url, *([settings.teacher_url] if settings.teacher_url else [])]
        version = publish_adapter(engine, result.output_dir, base_model=settings.upstream_model
                                  or settings.vllm_served_name, vllm_urls=urls,
                                  parent=result.parent,
                                  stats={"run_id": result.run_id, "steps": result.steps, "turns": result.turns,
                                         "objective": objective})
        click.echo(f"published {version['name']}: the `policy` alias serves it now")


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


def _reload_active_version(settings: Settings, vllm_urls: list[str]) -> None:
    """A fresh vLLM has no runtime adapters: load the pool's active version again before the
    gateway's `policy` alias sends traffic to it."""
    try:
        from trainer.publish import active_version, activate
    except ImportError:
        return  # no trainer installed, so no versions
    from datapool.db import make_engine

    engine = make_engine(settings.resolved_database_url)
    try:
        current = active_version(engine)
        if current is not None:
            activate(engine, current["name"], vllm_urls)
            click.echo(f"policy: {current['name']} (reloaded into vLLM)")
    finally:
        engine.dispose()


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
        _reload_active_version(settings, [server.base_url for server in servers])
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


def _label_filters(specs: tuple[str, ...]) -> tuple[str, ...]:
    from datapool.labels import LabelError, check_filter

    try:
        return tuple(check_filter(s) for s in specs)
    except LabelError as exc:
        raise click.BadParameter(str(exc), param_hint="--labels") from exc


def _register_optional() -> None:
    from nextstate.modelserver import vllm_cli

    main.add_command(vllm_cli)
    try:
        from trainer.policy_cli import policy_cli
    except ImportError:  # the trainer's extra is not installed
        return
    main.add_command(policy_cli)


_register_optional()

if __name__ == "__main__":
    sys.exit(main())
