"""`nextstate train`: offline runs (local or veRL backend), periodic runs, and the online loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from vllm_client.http import policy_servers
from datapool.db import as_utc
from datapool.leases import Filters
from base.settings import Settings
from base.vocab import Objective, PauseMode, TrainBackend, VersionKind
from nextstate.cli import options as opt
from trainer.config import (
    COMPUTE_DTYPES,
    INTEGRATED_NORMS,
    RL_BASELINES,
    SIBLINGS_WAIT_S,
    LocalConfig,
    ObjectiveConfig,
    OnlineConfig,
    RunLimits,
    VerlConfig,
)


def _oc(name: str) -> Any:
    return opt.field_default(OnlineConfig, name)


def _rl(name: str) -> Any:
    return opt.field_default(RunLimits, name)


def optimisation_options() -> Any:
    """What a run optimises and how (``ObjectiveConfig``, ``LocalConfig``, the run's loop)."""
    return opt.group(
        opt.objective(required=True, help=opt.OBJECTIVE_HELP),
        click.option("--steps", type=int, help="Stop after this many optimizer steps."),
        click.option("--epochs", type=int, default=_rl("epochs"), show_default=True,
                     help="Passes over the pool; each pass trains every matching turn once."),
        click.option("--batch-size", type=int, default=_rl("batch_size"), show_default=True,
                     help="Turns per optimizer step."),
        click.option("--micro-batch-size", type=click.IntRange(min=1),
                     default=opt.field_default(LocalConfig, "micro_batch_size"),
                     help="Turns per forward pass (gradients accumulate over the micro-batches of a step). On a "
                          "GPU larger is faster while it fits: one H100 trains a 1.7 B model fastest with the whole "
                          "batch of 8 turns × 768 tokens in one micro-batch (benchmarks/trainer/README.md). "
                          "Default: local backend 4 on the CPU, on a GPU the largest power of two up to 8 that its "
                          "free memory holds (8 on an H100); veRL backend 4 per GPU."),
        click.option("--max-tokens-per-micro-batch", type=click.IntRange(min=0),
                     default=opt.field_default(LocalConfig, "max_tokens_per_micro_batch"),
                     help="Local backend: the most tokens (turns × the longest) one forward pass takes: a round of "
                          "long agent turns is split into more micro-batches, a longer turn trains alone. A step's "
                          "peak memory follows it, not the round. Default: 8192 on the CPU (SmolLM2-135M peaks "
                          "at ~2 GB, benchmarks/trainer/README.md), on a GPU --micro-batch-size × 1024; 0: none."),
        click.option("--lr", type=float, default=opt.field_default(LocalConfig, "lr"), show_default=True),
        click.option("--full", is_flag=True,
                     help="Full fine-tuning instead of LoRA. Publishing it reloads the weights in place: the vLLM "
                          "servers need VLLM_SERVER_DEV_MODE=1 (`nextstate vllm serve --dev-mode`)."),
        click.option("--lora-rank", type=int, default=opt.field_default(LocalConfig, "lora_rank"), show_default=True),
        click.option("--kl-coef", type=float, default=opt.field_default(ObjectiveConfig, "kl_coef"),
                     show_default=True, help="k3 KL to the base policy (LoRA only)."),
        click.option("--w-rl", type=float, default=opt.field_default(ObjectiveConfig, "w_rl"), show_default=True,
                     help="combined: weight of the reward term."),
        click.option("--w-opd", type=float, default=opt.field_default(ObjectiveConfig, "w_opd"), show_default=True,
                     help="combined: weight of the OPD term."),
        click.option("--opd-topk/--no-opd-topk", default=opt.field_default(ObjectiveConfig, "opd_topk"),
                     show_default=True,
                     help="opd, combined: distil the teacher's top-k tokens and the tail mass at each position "
                          "(KL over the k+1 outcomes) on turns whose teacher pass kept them (the workers' "
                          "teacher_top_k setting), instead of the sampled token's log-prob alone."),
        click.option("--rl-baseline", type=click.Choice(RL_BASELINES),
                     default=opt.field_default(ObjectiveConfig, "rl_baseline"), show_default=True,
                     help="rl, combined: the baseline of the reward of turns outside a task group (online: every "
                          "turn). batch: standardize r within the batch (a batch where every reply failed gives "
                          "no RL signal); none: A = r on every token."),
        click.option("--integrated-norm", type=click.Choice(INTEGRATED_NORMS),
                     default=opt.field_default(ObjectiveConfig, "integrated_norm"), show_default=True,
                     help="rl, combined, turns of a task group with an outcome (R_t = O + votes): step: R_t "
                          "standardized per step index across the batch, then the group's baseline; group: only the "
                          "group's baseline (a group whose episodes all failed is then trained on its votes alone); "
                          "dense: the outcome's group advantage + --vote-weight x the turn's vote less the group's "
                          "mean vote (needs --mini-batch-size)."),
        click.option("--vote-weight", type=float, default=opt.field_default(ObjectiveConfig, "vote_weight"),
                     show_default=True, help="The votes' weight under --integrated-norm dense."),
        click.option("--mini-batch-size", type=click.IntRange(min=1),
                     help="Local backend, offline: take the advantages of each leased --batch-size turns at once "
                          "(a task's group whole), then one optimizer step per this many of them."),
        click.option("--loss-agg-mode", default=opt.field_default(ObjectiveConfig, "loss_agg_mode"),
                     show_default=True,
                     help="veRL's loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, ..."),
    )


def local_speed_options() -> Any:
    """The local backend's speed and memory settings (``LocalConfig``): compiling, packing,
    chunking, precision, activation memory and tokens per micro-batch."""
    return opt.group(
        click.option("--compile/--no-compile", "compile_layers", default=opt.field_default(LocalConfig, "compile"),
                     help="Local backend: torch.compile each decoder layer (fused kernels; the first step compiles: "
                          "10-20 s longer for a 1.7 B model on an H100). On an H100 it doubles a 1.7 B model's "
                          "tokens/s; on the CPU it rarely pays. Default: on with CUDA, off on the CPU."),
        click.option("--compile-mode", type=click.Choice(["default", "reduce-overhead", "max-autotune",
                                                          "max-autotune-no-cudagraphs"]),
                     help="Local backend, with --compile: torch.compile's mode; reduce-overhead adds CUDA graphs "
                          "(helps small models, whose steps wait on kernel launches). Default: torch's."),
        click.option("--packing", type=click.Choice(["auto", "on", "off"]),
                     default=opt.field_default(LocalConfig, "packing"), show_default=True,
                     help="Local backend: pack a micro-batch's turns into one row instead of padding them; auto "
                          "packs when padding would be at least a quarter of its tokens."),
        click.option("--logprob-chunk", type=click.IntRange(min=1),
                     help="Local backend: tokens per chunk of the LM head when computing the replies' log-probs "
                          "(memory against launches). Default: 256 MiB of fp32 logits per chunk."),
        click.option("--compute-dtype", type=click.Choice(list(COMPUTE_DTYPES)), default="auto", show_default=True,
                     help="Local backend: the dtype of the forward and backward passes. auto: bf16 on a GPU that "
                          "has it, fp32 on the CPU. LoRA adapters keep fp32 master copies either way; what fp32 "
                          "did to learning on a GPU: docs/trainer.md."),
        click.option("--fp32-master/--bf16-master", default=True, show_default=True,
                     help="Local backend, --full on a bf16 GPU: keep fp32 master weights and AdamW states (+12 bytes "
                          "a parameter, a ~15 % slower step). --bf16-master updates the bf16 weights directly: "
                          "updates smaller than a weight's bf16 spacing are then lost."),
        click.option("--activation-memory-budget", type=click.FloatRange(0.0, 1.0),
                     help="Local backend, with --compile: the share of activations backward may keep; under 1, "
                          "cheap ops are recomputed instead (less memory, a slower step)."),
    )


def run_options() -> Any:
    """Periodic runs, leases, resuming, the base model and publishing."""
    return opt.group(
        click.option("--repeat-every", type=click.FloatRange(min=1), metavar="SECONDS",
                     help="Periodic mode (either backend): run, sleep SECONDS, run again, each run with "
                          "--new-only. For continual training with an eval gate and rollback use --online "
                          "(local backend)."),
        click.option("--lease-s", type=float, default=_rl("lease_s"), show_default=True,
                     help="A leased batch not acked this long goes back to the pool (the trainer died)."),
        click.option("--resume", metavar="RUN_ID", help="Continue a run whose trainer died (releases its leases)."),
        opt.model_dir("The base model (default: the converted SmolLM2 in the cache dir)."),
        click.option("--publish/--no-publish", default=True, show_default=True,
                     help="Hot-load the new version into vLLM and make it the active `policy`."),
        opt.vllm_urls("vLLM servers (…/v1) to load the version into. Default: the upstream and the teacher "
                      "replica."),
        opt.pause_mode,
        click.option("--weight-transfer", type=click.Choice(["disk", "nccl"]), default="disk", show_default=True,
                     help="--full: how the servers get each version: disk reloads the checkpoint in place; nccl sends "
                          "its tensors from a GPU of this process over vLLM's weight-transfer engine (servers "
                          "started with `nextstate vllm serve --weight-transfer nccl`, on other GPUs of this host; "
                          "docs/trainer.md, \"Over NCCL instead of from disk\")."),
        opt.database_url(),
    )


def online_options() -> Any:
    """``--online``: the continual loop (``OnlineConfig``)."""
    return opt.group(
        click.option("--online", is_flag=True,
                     help="Continual mode: wait for --k new scored turns, train, publish, gate, repeat (until "
                          "Ctrl-C)."),
        click.option("--k", "online_k", type=int, default=_oc("k"), show_default=True,
                     help="online: newly scored turns per round (the batch size of a round)."),
        click.option("--max-wait-s", type=float, default=_oc("max_wait_s"), show_default=True,
                     help="online: train on fewer than --k turns once this long has passed."),
        click.option("--updates-per-round", type=int, default=_oc("updates_per_round"), show_default=True,
                     help="online: optimizer steps over each round's batch."),
        click.option("--replay-rounds", type=click.IntRange(min=0), default=_oc("replay_rounds"), show_default=True,
                     help="online: also train each round on the turns of the last N rounds (kept in memory, "
                          "corrected with the capped importance ratio as stale turns are); 0: only the new ones."),
        click.option("--siblings-wait-s", type=click.FloatRange(min=0), default=None,
                     help="online: after leasing a round, wait up to this long for its turns' shadow siblings "
                          "(NEXTSTATE_SIBLINGS_K, resampled and scored by the worker) so they train in their "
                          f"turn's group. Default: {SIBLINGS_WAIT_S:.0f} s when NEXTSTATE_SIBLINGS_K > 0, else 0."),
        click.option("--kl-target", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="online, with --kl-coef > 0: adapt the KL anchor each round toward this KL(candidate || "
                          "base) per reply token (at most 20 % a round); default: the coefficient stays fixed."),
        click.option("--staleness", type=int, default=_oc("staleness"), show_default=True,
                     help="online: turns more than this many versions behind are stale."),
        click.option("--stale", "stale_policy", type=click.Choice(["correct", "drop"]), default=_oc("stale_policy"),
                     show_default=True,
                     help="online: correct stale turns with the capped importance ratio from their logprobs, or "
                          "drop them."),
        click.option("--ratio-cap", type=float, default=_oc("ratio_cap"), show_default=True,
                     help="online: cap of a stale turn's importance ratio."),
        click.option("--eval-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="online: held-out prompts for the eval gate (JSONL of {\"messages\": [...]} or one "
                          "prompt a line)."),
        click.option("--eval-sessions", type=int, default=_oc("eval_sessions"), show_default=True,
                     help="online: also use the first prompts of the newest N eval sessions (mode \"eval\")."),
        click.option("--eval-scorer", metavar="MODULE:FN",
                     help="online: (reply, messages) -> score in [0, 1]; without it candidates are promoted "
                          "ungated."),
        click.option("--eval-threshold", type=float, default=_oc("eval_threshold"), show_default=True,
                     help="online: refuse a candidate scoring more than this below the active version."),
        click.option("--eval-samples", type=click.IntRange(min=1), default=_oc("eval_samples"), show_default=True,
                     help="online: replies per held-out prompt, sampled at --eval-temperature with the same seeds "
                          "for every version (1: the greedy reply). Users get sampled replies, which leave the "
                          "topic before the greedy ones do."),
        click.option("--eval-temperature", type=click.FloatRange(min=0), default=_oc("eval_temperature"),
                     show_default=True, help="online, with --eval-samples > 1: the held-out replies' temperature."),
        click.option("--topic-scorer", metavar="MODULE:FN",
                     help="online: (reply, messages) -> 1 when the reply is on topic, else 0; the eval gate then "
                          "holds back a candidate whose on-topic share on the held-out prompts is more than "
                          "--topic-margin below the reference's, whatever its score (needs --eval-prompts or "
                          "--eval-sessions)."),
        click.option("--topic-margin", type=click.FloatRange(min=0), default=_oc("topic_margin"), show_default=True,
                     help="online, with --topic-scorer: how far below the reference's on-topic share a candidate "
                          "may fall."),
        click.option("--topic-reference", metavar="SERVED_NAME",
                     help="online, with --topic-scorer: the version whose on-topic share is the reference "
                          "(evaluated once); default: the base model."),
        click.option("--refused-update", type=click.Choice(["drop", "keep"]), default=_oc("refused_update"),
                     show_default=True,
                     help="online: a candidate the eval gate refused: drop its update (the next round starts again "
                          "from the version serving) or keep training on top of it while the last promoted "
                          "version serves on (the gate then only decides what serves)."),
        click.option("--rollback-window", type=int, default=_oc("rollback_window"), show_default=True,
                     help="online: live scored turns of a version before the monitor judges it (0: off)."),
        click.option("--rollback-threshold", type=float, default=_oc("rollback_threshold"), show_default=True,
                     help="online: roll back when a version's mean live reward is this far below its parent's."),
        click.option("--rounds", type=int, help="online: stop after this many rounds."),
    )


def verl_options() -> Any:
    """``--backend verl``: veRL's Ray trainer (``VerlConfig``)."""
    def vc(name: str) -> Any:
        return opt.field_default(VerlConfig, name)

    return opt.group(
        opt.backend(),
        click.option("--gpus", type=int, default=vc("n_gpus_per_node"), show_default=True, help="verl: GPUs per node."),
        click.option("--nnodes", type=int, default=vc("nnodes"), show_default=True,
                     help="verl: nodes of the Ray cluster."),
        click.option("--ray-address", metavar="ADDR",
                     help="verl: join this Ray cluster ('auto', or ray://head:10001); default: start a local one."),
        click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None,
                     help="Recompute each decoder layer's activations in the backward pass instead of keeping "
                          "them (about a third more compute, a fraction of the memory for long turns). Default: "
                          "verl on; local backend on on the CPU, off on a GPU."),
        click.option("--fsdp", "fsdp_strategy", type=click.Choice(["fsdp2", "fsdp"]), default=vc("strategy"),
                     show_default=True, help="verl: FSDP2 (per-parameter sharding) or FSDP1."),
        click.option("--verl-fused-kernels/--no-verl-fused-kernels", "verl_fused_kernels",
                     default=vc("fused_kernels"), show_default=True,
                     help="verl: veRL's fused log-prob kernels (log-probs from the hidden states in chunks, no "
                          "full logits); off: veRL's plain path, ~3.6x slower per step on the 1.7 B model."),
        click.option("--offload/--no-offload", default=vc("param_offload"), show_default=True,
                     help="verl: keep parameters and optimizer state in CPU memory between uses."),
        click.option("--push-every", type=int, default=_rl("push_every"),
                     show_default=True,
                     help="verl: push (and with --publish, hot-load) the weights every N steps; 0: at the end only."),
        click.option("--verl-override", "verl_overrides", multiple=True, metavar="KEY=VALUE",
                     help="verl: any key of veRL's ppo_trainer config, e.g. "
                          "actor_rollout_ref.actor.optim.clip_grad=0.5."),
    )


@dataclass(frozen=True)
class TrainOptions:
    """`nextstate train`'s parameters, typed: one field a parameter, named as click names it from
    its flag (the option groups above). Made from the command's parameters, so a field missing
    here, or one the command lacks, fails at once."""

    # optimisation_options
    objective: str
    steps: int | None
    epochs: int
    batch_size: int
    micro_batch_size: int | None
    lr: float
    full: bool
    lora_rank: int
    kl_coef: float
    w_rl: float
    w_opd: float
    opd_topk: bool
    rl_baseline: str
    integrated_norm: str
    vote_weight: float
    mini_batch_size: int | None
    loss_agg_mode: str
    # local_speed_options
    compile_layers: bool | None
    compile_mode: str | None
    packing: str
    logprob_chunk: int | None
    compute_dtype: str
    fp32_master: bool
    activation_memory_budget: float | None
    max_tokens_per_micro_batch: int
    # opt.turn_filters
    since: datetime | None
    until: datetime | None
    min_abs_reward: float | None
    capture: str | None
    task_id: str | None
    modes: tuple[str, ...]
    label_filters: tuple[str, ...]
    new_only: bool
    # run_options
    repeat_every: float | None
    lease_s: float
    resume: str | None
    model_dir: Path | None
    publish: bool
    vllm_urls: tuple[str, ...]
    pause_mode: str
    weight_transfer: str
    database_url: str | None
    # online_options
    online: bool
    online_k: int
    max_wait_s: float
    updates_per_round: int
    replay_rounds: int
    siblings_wait_s: float | None
    kl_target: float | None
    staleness: int
    stale_policy: str
    ratio_cap: float
    eval_prompts: Path | None
    eval_sessions: int
    eval_scorer: str | None
    eval_threshold: float
    eval_samples: int
    eval_temperature: float
    topic_scorer: str | None
    topic_margin: float
    topic_reference: str | None
    refused_update: str
    rollback_window: int
    rollback_threshold: float
    rounds: int | None
    log_level: str
    # verl_options
    backend: str
    gpus: int
    nnodes: int
    ray_address: str | None
    gradient_checkpointing: bool | None  # None: the backend's default
    fsdp_strategy: str
    verl_fused_kernels: bool
    offload: bool
    push_every: int
    verl_overrides: tuple[str, ...]


@click.command()
@optimisation_options()
@local_speed_options()
@opt.turn_filters()
@run_options()
@online_options()
@opt.log_level()
@verl_options()
def train(**params: Any) -> None:
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
    o = TrainOptions(**params)
    if o.weight_transfer == "nccl" and not (o.full and o.publish and not o.online):
        raise click.UsageError("--weight-transfer nccl sends full weights: it needs --full and --publish, offline")
    if o.repeat_every is not None:
        if o.online or o.resume:
            raise click.UsageError("--repeat-every starts new runs; it does not combine with --online or --resume")
        import time

        ctx = click.get_current_context()
        while True:  # each run trains only what no earlier run trained on
            ctx.invoke(train, **{**ctx.params, "repeat_every": None, "new_only": True})
            time.sleep(o.repeat_every)
    opt.setup_logging(o.log_level)
    settings = opt.settings(database_url=o.database_url)
    model_dir = o.model_dir
    if model_dir is None:
        from nextstate.modelserver import ensure_model, ensure_vllm_env

        model_dir = ensure_model(settings.cache_dir, ensure_vllm_env(settings.cache_dir))
    from datapool.db import make_engine

    if o.mini_batch_size and (o.online or o.backend != TrainBackend.LOCAL):
        raise click.UsageError("--mini-batch-size splits the leased batches of the local backend's offline training")
    if o.integrated_norm == "dense" and not o.mini_batch_size:
        raise click.UsageError("--integrated-norm dense takes a leased batch's advantages at once: add --mini-batch-size")
    engine = make_engine(settings.resolved_database_url)
    filters = _filters(o)
    cfg = ObjectiveConfig(objective=o.objective, w_rl=o.w_rl, w_opd=o.w_opd, kl_coef=o.kl_coef,
                          loss_agg_mode=o.loss_agg_mode, rl_baseline=o.rl_baseline,
                          integrated_norm=o.integrated_norm, vote_weight=o.vote_weight,
                          opd_topk=o.opd_topk and o.objective != "rl")
    local = local_config(o, model_dir)
    urls = list(o.vllm_urls) or policy_servers(settings)
    base_model = settings.upstream_model or settings.vllm_served_name
    if o.online:
        _train_online(o, settings, engine, cfg, local, filters, urls, base_model)
        return
    _train_offline(o, settings, engine, cfg, local, filters, urls, base_model, model_dir)


def local_config(o: TrainOptions, model_dir: Path) -> LocalConfig:
    """The local backend's settings from the command line's."""
    return LocalConfig(model_dir=model_dir, lora=not o.full, lora_rank=o.lora_rank,
                       lora_alpha=2 * o.lora_rank, lr=o.lr, micro_batch_size=o.micro_batch_size,
                       compile=o.compile_layers, compile_mode=o.compile_mode, packing=o.packing,
                       logprob_chunk=o.logprob_chunk, fp32_master=o.fp32_master,
                       activation_memory_budget=o.activation_memory_budget,
                       max_tokens_per_micro_batch=o.max_tokens_per_micro_batch,
                       gradient_checkpointing=o.gradient_checkpointing, bf16=COMPUTE_DTYPES[o.compute_dtype])


def _filters(o: TrainOptions) -> Filters:
    utc = (lambda d: as_utc(d) if d is not None else None)
    return Filters(since=utc(o.since), until=utc(o.until), min_abs_reward=o.min_abs_reward,
                   capture=o.capture, task_id=o.task_id, needs_teacher=o.objective == Objective.OPD,
                   modes=o.modes or opt.field_default(Filters, "modes"),
                   labels=opt.label_filters(o.label_filters), new_only=o.new_only)


def _train_online(o: TrainOptions, settings: Settings, engine: Any, cfg: ObjectiveConfig, local: LocalConfig,
                  filters: Filters, urls: list[str], base_model: str) -> None:
    from trainer.online import load_prompts, load_scorer, run_online

    if o.full:
        raise click.UsageError("--online trains LoRA versions; drop --full")
    if o.backend != TrainBackend.LOCAL:
        raise click.UsageError("--online runs the local backend; the veRL backend trains offline (for now)")
    if o.kl_target is not None and cfg.kl_coef <= 0:
        raise click.UsageError("--kl-target adapts the KL anchor from --kl-coef: set --kl-coef > 0 as its start")
    def scorer_of(option: str, path: str | None) -> Any:
        try:
            return load_scorer(path) if path else None
        except (ValueError, ImportError, AttributeError) as exc:
            raise click.UsageError(f"{option}: {exc}") from exc

    scorer = scorer_of("--eval-scorer", o.eval_scorer)
    if o.topic_scorer and not (o.eval_prompts or o.eval_sessions):
        raise click.UsageError("--topic-scorer scores the replies to the held-out prompts: give --eval-prompts "
                               "or --eval-sessions")
    topic_scorer = scorer_of("--topic-scorer", o.topic_scorer)
    if o.eval_samples > 1 and o.eval_temperature == 0:
        raise click.UsageError("--eval-samples > 1 samples each held-out prompt: give --eval-temperature > 0 "
                               "(at 0 every sample is the greedy reply)")
    online_cfg = OnlineConfig(
        k=o.online_k, max_wait_s=o.max_wait_s, updates_per_round=o.updates_per_round,
        replay_rounds=o.replay_rounds, kl_target=o.kl_target, lease_s=o.lease_s,
        siblings_wait_s=(o.siblings_wait_s if o.siblings_wait_s is not None
                         else SIBLINGS_WAIT_S if settings.siblings_k else 0.0),
        staleness=o.staleness, stale_policy=o.stale_policy, ratio_cap=o.ratio_cap,
        eval_prompts=load_prompts(o.eval_prompts) if o.eval_prompts else [],
        eval_sessions=o.eval_sessions, eval_scorer=scorer, eval_threshold=o.eval_threshold,
        eval_samples=o.eval_samples, eval_temperature=o.eval_temperature,
        topic_scorer=topic_scorer, topic_margin=o.topic_margin, topic_reference=o.topic_reference,
        refused_update=o.refused_update, rollback_window=o.rollback_window,
        rollback_threshold=o.rollback_threshold, max_rounds=o.rounds)
    run_online(engine, objective=cfg, local=local, filters=filters, config=online_cfg, vllm_urls=urls,
               base_model=base_model, output_root=settings.data_dir / "runs", echo=click.echo)


def _train_offline(o: TrainOptions, settings: Settings, engine: Any, cfg: ObjectiveConfig, local: LocalConfig,
                   filters: Filters, urls: list[str], base_model: str, model_dir: Path) -> None:
    from trainer.offline import train_offline
    from base.errors import PublishError
    from publishing.publish import PublishRequest, publish

    board_dir = settings.data_dir / "tensorboard"
    writer = None
    try:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(board_dir))
    except ImportError:
        click.echo("tensorboard not installed: metrics go to the pool only", err=True)

    from tqdm import tqdm

    bar = tqdm(total=o.steps, unit="step", desc=f"train {o.objective}", dynamic_ncols=True)

    def on_step(step: int, m: dict[str, float]) -> None:
        bar.set_postfix(loss=f"{m.get('pg_loss', float('nan')):.4f}", adv=f"{m['advantage_mean']:+.3f}",
                        clip=f"{m.get('pg_clipfrac', 0.0):.3f}", kl=f"{m.get('kl', 0.0):.4f}",
                        tok_s=f"{m['tokens_per_s']:.0f}", turns=int(m["samples"]))
        bar.update(1)
        if writer is not None:
            for key, value in m.items():
                writer.add_scalar(f"train/{key}", value, step)

    if o.backend == TrainBackend.VERL:
        result = _train_verl(o, settings, engine, cfg, filters, model_dir=model_dir, urls=urls,
                             base_model=base_model, on_step=on_step)
    else:
        result = train_offline(engine, objective=cfg, local=local, filters=filters, batch_size=o.batch_size,
                               max_steps=o.steps, epochs=o.epochs, lease_s=o.lease_s, mini_batch_size=o.mini_batch_size,
                               output_root=settings.data_dir / "runs", resume=o.resume, on_step=on_step)
    bar.close()
    if writer is not None:
        writer.close()
    if result.output_dir is None:
        click.echo("nothing to train on: no scored turn matches (see `GET /api/judgements`)")
        return
    click.echo(f"run {result.run_id}: {result.steps} steps over {result.turns} turns; saved {result.output_dir}")
    if o.publish and result.version is not None:  # the veRL backend's checkpoint manager published it
        click.echo(f"published {result.version}: the `policy` alias serves it now")
    elif o.publish:
        stats = {"run_id": result.run_id, "steps": result.steps, "turns": result.turns, "objective": o.objective}
        try:
            # full weights are reloaded in place: every vLLM in urls needs VLLM_SERVER_DEV_MODE=1
            version = publish(engine, PublishRequest(
                result.output_dir, base_model=base_model, vllm_urls=urls, parent=result.parent, stats=stats,
                kind=VersionKind.FULL if o.full else VersionKind.LORA, pause_mode=PauseMode(o.pause_mode),
                transfer=_transfer(o, urls, result.output_dir)))
        except PublishError as exc:
            raise click.ClickException(f"trained {result.output_dir} but could not publish it: {exc}") from exc
        click.echo(f"published {version['name']}: the `policy` alias serves it now")


@functools.cache
def _transfer_group(urls: tuple[str, ...]) -> Any:
    """The NCCL group with *urls*, made at the first publish and kept for the process's later ones."""
    from vllm_client.transfer import TransferGroup

    return TransferGroup(urls).connect()


def _transfer(o: TrainOptions, urls: list[str], checkpoint: Path) -> Any:
    """With ``--weight-transfer nccl``: the checkpoint's tensors on this process's GPU, sent over the
    NCCL group with *urls*; else None."""
    if o.weight_transfer != "nccl" or not o.full:
        return None
    from vllm_client.transfer import NcclWeights, checkpoint_tensors

    return NcclWeights(_transfer_group(tuple(urls)), lambda: checkpoint_tensors(checkpoint, device="cuda"))


def _train_verl(o: TrainOptions, settings: Settings, engine: Any, cfg: ObjectiveConfig, filters: Filters, *,
                model_dir: Path, urls: list[str], base_model: str, on_step: Any) -> Any:
    """`train --backend verl`: trainer.verl.backend, publishing each push through publishing.publish."""
    from trainer.verl.backend import train_verl

    gpus, nnodes, batch_size = o.gpus, o.nnodes, o.batch_size
    if cfg.kl_coef > 0:
        raise click.UsageError("--kl-coef is not supported on the veRL backend yet (it needs veRL's reference worker)")
    if batch_size % (gpus * nnodes):
        raise click.UsageError(f"--batch-size {batch_size} must be a multiple of the GPU count {gpus * nnodes}")

    def publish_written(written: dict[str, Any]) -> dict[str, Any]:
        from datapool.versions import active_version
        from publishing.publish import PublishRequest, publish

        current = active_version(engine)
        # full weights are reloaded in place: every vLLM in urls needs VLLM_SERVER_DEV_MODE=1
        version = publish(engine, PublishRequest(
            Path(written["path"]), base_model=base_model, vllm_urls=urls,
            kind=VersionKind.FULL if o.full else VersionKind.LORA, pause_mode=PauseMode(o.pause_mode),
            transfer=_transfer(o, urls, Path(written["path"])),
            parent=current["name"] if current else None, stats={"backend": "verl", "step": written.get("step")}))
        click.echo(f"published {version['name']}: the `policy` alias serves it now")
        return version

    verl = VerlConfig(model_dir=model_dir, n_gpus_per_node=gpus, nnodes=nnodes, lora=not o.full,
                      lora_rank=o.lora_rank, lora_alpha=2 * o.lora_rank, lr=o.lr,
                      micro_batch_size=o.micro_batch_size or opt.field_default(VerlConfig, "micro_batch_size"),
                      gradient_checkpointing=(opt.field_default(VerlConfig, "gradient_checkpointing")
                                              if o.gradient_checkpointing is None else o.gradient_checkpointing),
                      strategy=o.fsdp_strategy, param_offload=o.offload, optimizer_offload=o.offload,
                      fused_kernels=o.verl_fused_kernels, ray_address=o.ray_address, overrides=o.verl_overrides)
    return train_verl(engine, objective=cfg, verl=verl, filters=filters, batch_size=batch_size, max_steps=o.steps,
                      epochs=o.epochs, lease_s=o.lease_s, output_root=settings.data_dir / "runs",
                      resume=o.resume, publish=publish_written if o.publish else None,
                      push_every=o.push_every, on_step=on_step)
