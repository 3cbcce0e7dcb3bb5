"""`nextstate`: the command line. Each subcommand's --help is its manual."""

from __future__ import annotations

import json
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
@click.option("--full", is_flag=True,
              help="Full fine-tuning instead of LoRA. Publishing it reloads the weights in place: the vLLM "
                   "servers need VLLM_SERVER_DEV_MODE=1 (`nextstate vllm serve --dev-mode`).")
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
@click.option("--new-only", is_flag=True,
              help="Only turns no earlier run trained on: for periodic runs (e.g. a Kubernetes CronJob of "
                   "--backend verl), each training on what arrived since the last.")
@click.option("--repeat-every", type=click.FloatRange(min=1), metavar="SECONDS",
              help="Periodic mode (either backend): run, sleep SECONDS, run again, each run with --new-only. "
                   "For continual training with an eval gate and rollback use --online (local backend).")
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
@click.option("--online", is_flag=True,
              help="Continual mode: wait for --k new scored turns, train, publish, gate, repeat (until Ctrl-C).")
@click.option("--k", "online_k", type=int, default=16, show_default=True,
              help="online: newly scored turns per round (the batch size of a round).")
@click.option("--max-wait-s", type=float, default=600.0, show_default=True,
              help="online: train on fewer than --k turns once this long has passed.")
@click.option("--updates-per-round", type=int, default=1, show_default=True,
              help="online: optimizer steps over each round's batch.")
@click.option("--staleness", type=int, default=2, show_default=True,
              help="online: turns more than this many versions behind are stale.")
@click.option("--stale", "stale_policy", type=click.Choice(["correct", "drop"]), default="correct",
              show_default=True,
              help="online: correct stale turns with the capped importance ratio from their logprobs, or drop them.")
@click.option("--ratio-cap", type=float, default=2.0, show_default=True,
              help="online: cap of a stale turn's importance ratio.")
@click.option("--eval-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="online: held-out prompts for the eval gate (JSONL of {\"messages\": [...]} or one prompt a line).")
@click.option("--eval-sessions", type=int, default=0, show_default=True,
              help="online: also use the first prompts of the newest N eval sessions (mode \"eval\").")
@click.option("--eval-scorer", metavar="MODULE:FN",
              help="online: (reply, messages) -> score in [0, 1]; without it candidates are promoted ungated.")
@click.option("--eval-threshold", type=float, default=0.05, show_default=True,
              help="online: refuse a candidate scoring more than this below the active version.")
@click.option("--rollback-window", type=int, default=16, show_default=True,
              help="online: live scored turns of a version before the monitor judges it (0: off).")
@click.option("--rollback-threshold", type=float, default=0.5, show_default=True,
              help="online: roll back when a version's mean live reward is this far below its parent's.")
@click.option("--rounds", type=int, help="online: stop after this many rounds.")
@click.option("--log-level", default="info", show_default=True)
@click.option("--backend", type=click.Choice(["local", "verl"]), default="local", show_default=True,
              help="local: torch + peft on the CPU or one GPU. verl: veRL's Ray trainer, FSDP over --gpus GPUs "
                   "on each of --nnodes nodes (docs/trainer-verl.md).")
@click.option("--gpus", type=int, default=1, show_default=True, help="verl: GPUs per node.")
@click.option("--nnodes", type=int, default=1, show_default=True, help="verl: nodes of the Ray cluster.")
@click.option("--ray-address", metavar="ADDR",
              help="verl: join this Ray cluster ('auto', or ray://head:10001); default: start a local one.")
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=True, show_default=True,
              help="verl: recompute activations in the backward pass.")
@click.option("--fsdp", "fsdp_strategy", type=click.Choice(["fsdp2", "fsdp"]), default="fsdp2", show_default=True,
              help="verl: FSDP2 (per-parameter sharding) or FSDP1.")
@click.option("--offload/--no-offload", default=False, show_default=True,
              help="verl: keep parameters and optimizer state in CPU memory between uses.")
@click.option("--push-every", type=int, default=0, show_default=True,
              help="verl: push (and with --publish, hot-load) the weights every N steps; 0: at the end only.")
@click.option("--verl-override", "verl_overrides", multiple=True, metavar="KEY=VALUE",
              help="verl: any key of veRL's ppo_trainer config, e.g. actor_rollout_ref.actor.optim.clip_grad=0.5.")
def train(objective: str, steps: int | None, epochs: int, batch_size: int, micro_batch_size: int, lr: float,
          full: bool, lora_rank: int, kl_coef: float, w_rl: float, w_opd: float, loss_agg_mode: str,
          since: Any, until: Any, min_abs_reward: float | None, capture: str | None, task_id: str | None,
          modes: tuple[str, ...], new_only: bool, repeat_every: float | None, lease_s: float, resume: str | None, model_dir: Path | None, publish: bool, vllm_urls: tuple[str, ...],
          database_url: str | None, online: bool, online_k: int, max_wait_s: float, updates_per_round: int,
          staleness: int, stale_policy: str, ratio_cap: float, eval_prompts: Path | None, eval_sessions: int,
          eval_scorer: str | None, eval_threshold: float, rollback_window: int, rollback_threshold: float,
          rounds: int | None, log_level: str, backend: str = "local", gpus: int = 1, nnodes: int = 1,
          ray_address: str | None = None, gradient_checkpointing: bool = True, fsdp_strategy: str = "fsdp2",
          offload: bool = False, push_every: int = 0, verl_overrides: tuple[str, ...] = (),
          label_filters: tuple[str, ...] = ()) -> None:
    """Train the policy offline from the scored turns in the pool, then publish it.

    \b
    With --online: the continual loop. It waits for --k newly scored turns, trains on them
    (stale turns corrected or dropped), publishes a candidate, scores it on the held-out set
    (--eval-prompts/--eval-sessions with --eval-scorer) against the active version, promotes
    or refuses it, and rolls an active version back when its live rewards regress. Every
    decision is in GET /api/policy/events. Kill and restart it at any time: it continues its
    run, and trains every turn once.

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

    if repeat_every is not None:
        if online or resume:
            raise click.UsageError("--repeat-every starts new runs; it does not combine with --online or --resume")
        import time

        ctx = click.get_current_context()
        while True:  # each run trains only what no earlier run trained on
            ctx.invoke(train, **{**ctx.params, "repeat_every": None, "new_only": True})
            time.sleep(repeat_every)
    _logging(log_level)
    settings = _settings(database_url=database_url)
    if model_dir is None:
        from nextstate.modelserver import ensure_model, ensure_vllm_env

        model_dir = ensure_model(settings.cache_dir, ensure_vllm_env(settings.cache_dir))
    engine = make_engine(settings.resolved_database_url)
    utc = (lambda d: d.replace(tzinfo=timezone.utc) if d is not None else None)
    filters = Filters(since=utc(since), until=utc(until), min_abs_reward=min_abs_reward, capture=capture,
                      task_id=task_id, needs_teacher=objective == "opd", modes=modes or ("online", "offline"),
                      labels=_label_filters(label_filters), new_only=new_only)
    cfg = ObjectiveConfig(objective=objective, w_rl=w_rl, w_opd=w_opd, kl_coef=kl_coef, loss_agg_mode=loss_agg_mode)
    local = LocalConfig(model_dir=model_dir, lora=not full, lora_rank=lora_rank, lora_alpha=2 * lora_rank,
                        lr=lr, micro_batch_size=micro_batch_size)
    if online:
        from trainer.online import OnlineConfig, load_prompts, load_scorer, run_online

        if full:
            raise click.UsageError("--online trains LoRA versions; drop --full")
        if backend != "local":
            raise click.UsageError("--online runs the local backend; the veRL backend trains offline (for now)")
        try:
            scorer = load_scorer(eval_scorer) if eval_scorer else None
        except (ValueError, ImportError, AttributeError) as exc:
            raise click.UsageError(f"--eval-scorer: {exc}") from exc
        online_cfg = OnlineConfig(
            k=online_k, max_wait_s=max_wait_s, updates_per_round=updates_per_round, lease_s=lease_s,
            staleness=staleness, stale_policy=stale_policy, ratio_cap=ratio_cap,  # type: ignore[arg-type]
            eval_prompts=load_prompts(eval_prompts) if eval_prompts else [], eval_sessions=eval_sessions,
            eval_scorer=scorer, eval_threshold=eval_threshold, rollback_window=rollback_window,
            rollback_threshold=rollback_threshold, max_rounds=rounds)
        urls = list(vllm_urls) or [settings.local_vllm_url, *([settings.teacher_url] if settings.teacher_url else [])]
        run_online(engine, objective=cfg, local=local, filters=filters, config=online_cfg, vllm_urls=urls,
                   base_model=settings.upstream_model or settings.vllm_served_name,
                   output_root=settings.data_dir / "runs", echo=click.echo)
        return
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

    if backend == "verl":
        result = _train_verl(settings, engine, cfg, filters, model_dir=model_dir, full=full, lora_rank=lora_rank,
                             lr=lr, micro_batch_size=micro_batch_size, batch_size=batch_size, steps=steps,
                             epochs=epochs, lease_s=lease_s, resume=resume, publish=publish, vllm_urls=vllm_urls,
                             gpus=gpus, nnodes=nnodes, ray_address=ray_address,
                             gradient_checkpointing=gradient_checkpointing, fsdp_strategy=fsdp_strategy,
                             offload=offload, push_every=push_every, overrides=verl_overrides, on_step=on_step)
    else:
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
    if publish and result.version is not None:  # the veRL backend's checkpoint manager published it
        click.echo(f"published {result.version}: the `policy` alias serves it now")
    elif publish:
        from trainer.publish import PublishError, publish_adapter, publish_full

        urls = list(vllm_urls) or [settings.local_vllm_url, *([settings.teacher_url] if settings.teacher_url else [])]
        stats = {"run_id": result.run_id, "steps": result.steps, "turns": result.turns, "objective": objective}
        base_model = settings.upstream_model or settings.vllm_served_name
        try:
            if full:  # reloaded in place: every vLLM in urls needs VLLM_SERVER_DEV_MODE=1
                version = publish_full(engine, result.output_dir, base_model=base_model, vllm_urls=urls,
                                       parent=result.parent, stats=stats)
            else:
                version = publish_adapter(engine, result.output_dir, base_model=base_model, vllm_urls=urls,
                                          parent=result.parent, stats=stats)
        except PublishError as exc:
            raise click.ClickException(f"trained {result.output_dir} but could not publish it: {exc}") from exc
        click.echo(f"published {version['name']}: the `policy` alias serves it now")


def _train_verl(settings: Settings, engine: Any, cfg: Any, filters: Any, *, model_dir: Path, full: bool,
                lora_rank: int, lr: float, micro_batch_size: int, batch_size: int, steps: int | None, epochs: int,
                lease_s: float, resume: str | None, publish: bool, vllm_urls: tuple[str, ...], gpus: int,
                nnodes: int, ray_address: str | None, gradient_checkpointing: bool, fsdp_strategy: str,
                offload: bool, push_every: int, overrides: tuple[str, ...], on_step: Any) -> Any:
    """`train --backend verl`: trainer.verl_backend, publishing each push through trainer.publish."""
    from trainer.verl_backend import VerlConfig, train_verl

    if cfg.kl_coef > 0:
        raise click.UsageError("--kl-coef is not supported on the veRL backend yet (it needs veRL's reference worker)")
    if batch_size % (gpus * nnodes):
        raise click.UsageError(f"--batch-size {batch_size} must be a multiple of the GPU count {gpus * nnodes}")
    base_model = settings.upstream_model or settings.vllm_served_name
    urls = list(vllm_urls) or [settings.local_vllm_url, *([settings.teacher_url] if settings.teacher_url else [])]

    def publish_written(written: dict[str, Any]) -> dict[str, Any]:
        from trainer.publish import active_version, publish_adapter, publish_full

        current = active_version(engine)
        # full weights are reloaded in place: every vLLM in urls needs VLLM_SERVER_DEV_MODE=1
        version = (publish_full if full else publish_adapter)(
            engine, Path(written["path"]), base_model=base_model, vllm_urls=urls,
            parent=current["name"] if current else None, stats={"backend": "verl", "step": written.get("step")})
        click.echo(f"published {version['name']}: the `policy` alias serves it now")
        return version

    verl = VerlConfig(model_dir=model_dir, n_gpus_per_node=gpus, nnodes=nnodes, lora=not full, lora_rank=lora_rank,
                      lora_alpha=2 * lora_rank, lr=lr, micro_batch_size=micro_batch_size,
                      gradient_checkpointing=gradient_checkpointing, strategy=fsdp_strategy, param_offload=offload,
                      optimizer_offload=offload, ray_address=ray_address, overrides=overrides)
    return train_verl(engine, objective=cfg, verl=verl, filters=filters, batch_size=batch_size, max_steps=steps,
                      epochs=epochs, lease_s=lease_s, output_root=settings.data_dir / "runs", resume=resume,
                      publish=publish_written if publish else None, push_every=push_every, on_step=on_step)


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
            if current["kind"] == "full" and not settings.vllm_dev_mode:
                raise click.ClickException(
                    f"the active policy version {current['name']} is a full checkpoint: its weights can only "
                    "be loaded into a vLLM in dev mode; run with --vllm-dev-mode (NEXTSTATE_VLLM_DEV_MODE=1) "
                    "or `nextstate policy rollback` first")
            activate(engine, current["name"], vllm_urls, actor="up", reason="vLLM started")
            click.echo(f"policy: {current['name']} (reloaded into vLLM)")
    finally:
        engine.dispose()


@main.command()
@click.option("--port", type=int, help="Gateway port (default 8400). [env NEXTSTATE_PORT]")
@click.option("--vllm-port", type=int, help="Policy vLLM port (default 8401). [env NEXTSTATE_VLLM_PORT]")
@click.option("--database-url", metavar="DSN", help="Pool (default: SQLite in the data dir).")
@click.option("--scoring/--no-scoring", default=True, show_default=True,
              help="Also run a scoring worker (LLM judge on the local vLLM) and the teacher vLLM replica.")
@click.option("--vllm-dev-mode/--no-vllm-dev-mode", default=None,
              help="Start vLLM with its development endpoints (VLLM_SERVER_DEV_MODE=1), needed to publish "
                   "full fine-tuned weights (`train --full`). Unauthenticated: the servers listen on "
                   "127.0.0.1 only. [env NEXTSTATE_VLLM_DEV_MODE, default off]")
@click.option("--train", "train_objective", type=click.Choice(["rl", "opd", "combined"]),
              help="Also run the online trainer with this objective (`nextstate train --online`; "
                   "its log: <data dir>/logs/trainer.log).")
@click.option("--log-level", default="info", show_default=True)
def up(port: int | None, vllm_port: int | None, database_url: str | None, scoring: bool,
       vllm_dev_mode: bool | None, train_objective: str | None, log_level: str) -> None:
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
    if vllm_dev_mode is not None:
        settings = settings.model_copy(update={"vllm_dev_mode": vllm_dev_mode})
    python = ensure_vllm_env(settings.cache_dir)
    model_dir = ensure_model(settings.cache_dir, python)
    upgrade(settings.resolved_database_url)
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [VLLMServer(python, model_dir, served_name=settings.vllm_served_name, host="127.0.0.1",
                          port=settings.vllm_port, log_path=logs / "vllm.log", dev_mode=settings.vllm_dev_mode)]
    if scoring:
        servers.append(VLLMServer(python, model_dir, served_name=settings.vllm_served_name, host="127.0.0.1",
                                  port=settings.teacher_vllm_port, log_path=logs / "vllm-teacher.log",
                                  extra_args=TEACHER_ARGS, dev_mode=settings.vllm_dev_mode))
    if settings.vllm_dev_mode:
        click.echo("vLLM dev mode: /pause, /resume, /collective_rpc are open on 127.0.0.1 (full-weight publishing)")
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
        if train_objective:
            env = {**os.environ, "NEXTSTATE_UPSTREAM_URL": servers[0].base_url,
                   "NEXTSTATE_UPSTREAM_MODEL": settings.vllm_served_name,
                   "NEXTSTATE_DATABASE_URL": settings.resolved_database_url,
                   **({"NEXTSTATE_TEACHER_URL": servers[1].base_url} if scoring else {})}
            trainer_log = open(logs / "trainer.log", "ab")
            trainer = subprocess.Popen([sys.executable, "-m", "nextstate.cli", "train", "--online", "--objective",
                                        train_objective, "--model-dir", str(model_dir), "--log-level", log_level],
                                       env=env, stdout=trainer_log, stderr=subprocess.STDOUT)
            stack.callback(trainer.wait, 60)
            stack.callback(trainer.terminate)
            click.echo(f"trainer: online, {train_objective} (log: {logs / 'trainer.log'})")
        click.echo(f"pool: {settings.resolved_database_url}")
        click.echo(f"model: {settings.vllm_served_name} (also as `policy`)")
        _serve_gateway(settings, migrate=False)


@main.group("config")
def config_group() -> None:
    """The settings every process reads: print the reference and the compose .env.example,
    both generated from nextstate/settings.py."""


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

@main.command()
@click.option("--tasks", "tasks_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL (one JSON object a line) or Parquet file of tasks; each needs an `id`.")
@click.option("--n", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rollouts per task (a GRPO group: the sessions share group_id = the task id).")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="Rollouts running at once.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="Seconds per rollout; the agent is then stopped (a command's whole "
              "process group is killed) and the session is marked timed_out.")
@click.option("--agent", "agent_fn", metavar="MODULE:FN",
              help="White-box agent: an async function (task, client) -> result; client is an "
                   "openai.AsyncOpenAI pointed at the session's base_url. MODULE may be a file.py path.")
@click.option("--agent-cmd", metavar="TEMPLATE",
              help="Black-box agent: a shell command run once per rollout in its own working directory; "
                   "{base_url}, {session_id}, {task_file}, {model} are substituted (shell-quoted) and set "
                   "as OPENAI_BASE_URL, NEXTSTATE_SESSION_ID, NEXTSTATE_TASK_FILE, OPENAI_MODEL (plus "
                   "OPENAI_API_KEY). Its exit code, stdout, stderr and workdir are the result.")
@click.option("--verifier", "verifier_fn", metavar="MODULE:FN",
              help="(task, result, session) -> float, sync or async: the session's outcome, posted to the "
                   "gateway. `session` is GET /api/sessions/{id} (turns included).")
@click.option("--gateway", "gateway_url", metavar="URL",
              help="The gateway (http://host:port). [env NEXTSTATE_GATEWAY_URL; default http://<host>:<port>]")
@click.option("--model", default="policy", show_default=True,
              help="Model name the black-box agent is told to use ({model}, OPENAI_MODEL).")
@click.option("--eval", "evaluate", is_flag=True,
              help="Evaluation: sessions are tagged mode=eval (never trained on); reports pass@1 and "
                   "mean outcome per policy version.")
@click.option("--pass-threshold", type=float, default=1.0, show_default=True,
              help="A rollout passes when its outcome is at least this.")
@click.option("--run-name", metavar="NAME",
              help="Names the run's sessions (<run>:<task>:<index>). Default: from the task file, agent and "
                   "mode, so rerunning the same command resumes it; give a new name to roll out again.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where black-box agents run and report.json goes. Default: <data dir>/rollouts/<run>.")
@click.option("--retries", type=click.IntRange(min=0), default=3, show_default=True,
              help="Retries on infrastructure errors (gateway unreachable, 5xx); agent failures are not retried.")
@click.option("--then-train", is_flag=True, help="Afterwards, train on the new sessions (like `nextstate train "
              "--mode offline --since <run start>`) and publish the new version.")
@click.option("--objective", type=click.Choice(["rl", "opd", "combined"]), default="rl", show_default=True,
              help="--then-train: the objective.")
@click.option("--train-steps", type=int, help="--then-train: stop after this many optimizer steps.")
@click.option("--score-wait", type=float, default=600.0, show_default=True,
              help="--then-train: seconds to wait for the judges to score the new turns first.")
@click.option("--publish/--no-publish", default=True, show_default=True, help="--then-train: publish the version.")
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="--then-train: the base model (default: the converted SmolLM2 in the cache dir).")
@click.option("--database-url", metavar="DSN", help="--then-train: the pool. [env NEXTSTATE_DATABASE_URL]")
@click.option("--log-level", default="warning", show_default=True)
@click.pass_context
def rollout(ctx: click.Context, tasks_path: Path, n: int, concurrency: int, timeout_s: float, agent_fn: str | None,
            agent_cmd: str | None, verifier_fn: str | None, gateway_url: str | None, model: str, evaluate: bool,
            pass_threshold: float, run_name: str | None, workdir: Path | None, retries: int, then_train: bool,
            objective: str, train_steps: int | None, score_wait: float, publish: bool, model_dir: Path | None,
            database_url: str | None, log_level: str) -> None:
    """Run an agent over a task dataset through the gateway: N sessions per task, each tagged
    with its task and group, the verifier's outcome posted to each.

    \b
    Each rollout is one session, <run>:<task>:<index>, created through the gateway's admin API
    before the agent starts (mode offline, or eval with --eval), so the agent needs only its
    base_url (<gateway>/s/<session>/v1). Rerunning the same command skips finished rollouts; one
    an interruption left half-way is kept, marked cancelled, and run again. The runner talks to
    the gateway over HTTP only (NEXTSTATE_ADMIN_TOKEN for /api/*, the first NEXTSTATE_API_KEYS
    entry for the agents).

    \b
    Examples:
      nextstate rollout --tasks examples/arithmetic/tasks.jsonl --n 4 \\
          --agent examples/arithmetic/agent.py:solve --verifier examples/arithmetic/verify.py:verify
      nextstate rollout --tasks examples/terminal/tasks.jsonl --n 2 --timeout 120 \\
          --agent-cmd "python $PWD/examples/terminal/agent.py {task_file}" \\
          --verifier examples/terminal/verify.py:verify
    """
    import asyncio
    from datetime import datetime, timezone

    from nextstate import rollout as ro

    _logging(log_level)
    if (agent_fn is None) == (agent_cmd is None):
        raise click.UsageError("give exactly one of --agent MODULE:FN and --agent-cmd TEMPLATE")
    if evaluate and then_train:
        raise click.UsageError("--eval sessions are never trained on; drop --then-train or --eval")
    settings = _settings(database_url=database_url)
    url = (gateway_url or settings.gateway_url or f"http://{settings.host}:{settings.port}").rstrip("/")
    url = url[:-3] if url.endswith("/v1") else url
    mode = "eval" if evaluate else "offline"
    api_key = settings.api_keys[0] if settings.api_keys else None
    try:
        tasks = ro.load_tasks(tasks_path)
        agent: ro.PythonAgent | ro.CommandAgent = (
            ro.PythonAgent(agent_fn, api_key=api_key) if agent_fn
            else ro.CommandAgent(str(agent_cmd), api_key=api_key, model=model))
        verifier = ro.load_callable(verifier_fn) if verifier_fn else None
        run = run_name or ro.default_run_name(tasks_path, agent.spec, mode)
        cfg = ro.RolloutConfig(gateway_url=url, run=run, n=n, concurrency=concurrency, timeout_s=timeout_s,
                               mode=mode, retries=retries, admin_token=settings.admin_token,
                               pass_threshold=pass_threshold,
                               workdir=(workdir or settings.data_dir / "rollouts" / run).resolve())
        from tqdm import tqdm

        bar = tqdm(total=len(tasks) * n, unit="rollout", desc=f"{mode} {run}", dynamic_ncols=True)
        seen: dict[str, int] = {"done": 0, "passed": 0, "timed_out": 0, "failed": 0}

        def on_done(record: ro.RolloutRecord) -> None:
            seen["done"] += 1
            seen["passed"] += record.passed(pass_threshold)
            if record.status != "ok":
                seen[record.status] += 1
            bar.set_postfix(passed=f"{seen['passed']}/{seen['done']} ({seen['passed'] / seen['done']:.0%})",
                            timed_out=seen["timed_out"], failed=seen["failed"])
            bar.update(1)

        runner = ro.Runner(cfg, agent, verifier, verifier_fn, on_done=on_done)
        click.echo(f"run {run}: {len(tasks)} tasks x {n} through {url} (rerun the same command to resume)", err=True)
        try:
            summary = asyncio.run(runner.run(tasks))
        except KeyboardInterrupt:
            bar.close()
            click.echo(f"interrupted: rerun the same command (run {run}) to resume", err=True)
            sys.exit(130)
        bar.close()
    except ro.InfraError as exc:
        raise click.ClickException(f"{exc}\nNothing is lost: rerun the same command to resume run {run}.") from exc
    except ro.RolloutError as exc:
        raise click.UsageError(str(exc)) from exc
    report = summary.report()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    (cfg.workdir / "report.json").write_text(json.dumps(report, indent=1))
    click.echo(ro.format_report(report))
    click.echo(f"report: {cfg.workdir / 'report.json'}")
    if not then_train:
        return
    ids = [r.session_id for r in summary.records]
    finished, total = asyncio.run(ro.wait_for_scoring(url, ids, admin_token=settings.admin_token,
                                                      timeout_s=score_wait))
    click.echo(f"scored {finished}/{total} turns of the run" + ("" if finished == total else
               f" after waiting {score_wait:.0f}s (is a `nextstate worker` running?)"))
    starts = [datetime.fromisoformat(r.created_at) for r in summary.records if r.created_at]
    since = min(starts).astimezone(timezone.utc).replace(tzinfo=None) if starts else None
    ctx.invoke(train, objective=objective, steps=train_steps, since=since, modes=("offline",), publish=publish,
               model_dir=model_dir, database_url=database_url, log_level=log_level)


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
