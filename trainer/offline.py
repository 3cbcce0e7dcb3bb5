"""Offline training: lease scored turns from the pool, optimise, publish the new version."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool.queries import active_policy_version
from datapool import leases
from base.vocab import VersionKind
from trainer.config import RunLimits
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.samples import Sample, load_samples

log = logging.getLogger("nextstate.trainer")


class StepTrainer(Protocol):
    """What :func:`run_epochs` drives: the local trainer and the veRL one."""

    tokenizer: Any
    step_count: int

    def step(self, samples: list[Sample]) -> dict[str, float]: ...


@dataclass
class RunResult:
    run_id: str
    steps: int
    turns: int
    output_dir: Path | None
    version: str | None
    metrics: list[dict[str, float]]
    parent: str | None  # the version the run started from (None: the base model)
    # the local backend's trainer, holding the trained policy (trainer.agreement checks that a
    # published version serves it); None for the veRL backend
    trainer: Any = None


def train_offline(
    engine: Engine,
    *,
    objective: ObjectiveConfig,
    local: LocalConfig,
    filters: leases.Filters,
    batch_size: int = RunLimits.batch_size,
    max_steps: int | None = None,
    epochs: int = RunLimits.epochs,
    lease_s: float = RunLimits.lease_s,
    output_root: Path,
    resume: str | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    mini_batch_size: int | None = None,
) -> RunResult:
    """Train until ``max_steps`` or the pool has no untrained scored turn left (``epochs``
    passes: each pass is a run of its own, so a turn is trained once per pass).

    *mini_batch_size*: each leased batch (``batch_size`` turns) gets its advantages as a whole,
    then one optimizer step per mini-batch of about this many of its turns
    (:func:`mini_batches`): lease every turn of an iteration's rollouts at once and a task's
    GRPO group is whole when its baseline is taken, however the turns' order cuts it."""
    with OrmSession(engine) as db:  # a new run continues from the version being served
        parent = active_policy_version(db)
        parent_name = parent.name if parent else None
        parent_adapter = parent.path if parent is not None and parent.kind == VersionKind.LORA else None
        parent_full = parent.path if parent is not None and parent.kind == "full" else None
    if local.lora and parent_adapter and local.init_adapter is None:
        local.init_adapter = Path(parent_adapter)
    # full fine-tuning continues from the full version being served; a LoRA run trains an
    # adapter of the original base (publishing it restores the base weights under it)
    if not local.lora and parent_full:
        local.model_dir = Path(parent_full)
    trainer = LocalTrainer(local, objective)
    config = {"objective": asdict(objective), "batch_size": batch_size, "mini_batch_size": mini_batch_size,
              "lr": local.lr, "warmup_steps": local.warmup_steps, "lora": local.lora,
              "lora_rank": local.lora_rank, "filters": {k: str(v) for k, v in asdict(filters).items() if v}}
    run_id, metrics, turns = run_epochs(
        engine, trainer, backend="local", config=config, objective=objective.objective, parent_name=parent_name,
        filters=filters, batch_size=batch_size, max_steps=max_steps, epochs=epochs, lease_s=lease_s,
        resume=resume, on_step=on_step, mini_batch_size=mini_batch_size)
    if not metrics:
        return RunResult(run_id, 0, 0, None, None, [], parent_name)
    out = trainer.save(output_root / f"run-{run_id}")
    return RunResult(run_id, len(metrics), turns, out, None, metrics, parent_name, trainer)


def run_epochs(
    engine: Engine,
    trainer: StepTrainer,
    *,
    backend: str,
    config: dict[str, Any],
    objective: str,
    parent_name: str | None,
    filters: leases.Filters,
    batch_size: int,
    max_steps: int | None,
    epochs: int,
    lease_s: float,
    resume: str | None,
    after_step: Callable[[dict[str, float]], dict[str, Any]] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    mini_batch_size: int | None = None,
) -> tuple[str, list[dict[str, float]], int]:
    """The offline loop both backends share: per epoch one training run (the first one resumed
    when *resume* names a run); in it lease a batch of scored turns, one optimizer step, record
    the step and ack its turns (``datapool.leases``), until *max_steps* in all or nothing is left.

    *after_step* runs after each step, before it is recorded (the veRL backend pushes weights
    there); what it returns is recorded with the step. *mini_batch_size*: see
    :func:`train_offline` (a trainer with an ``objective``: the local one). Returns (last run id,
    step metrics, turns trained)."""
    metrics: list[dict[str, float]] = []
    turns = 0
    run_id = ""
    for epoch in range(epochs):
        if resume and epoch == 0:
            run_id = leases.resume_run(engine, resume).id
        else:
            run_id = leases.start_run(engine, objective=objective, backend=backend, config=config,
                                      base_version=parent_name)
        while max_steps is None or len(metrics) < max_steps:
            ids = leases.lease(engine, run_id, limit=batch_size, lease_s=lease_s, filters=filters)
            if not ids:
                break
            with OrmSession(engine) as db:
                samples = load_samples(db, ids, trainer.tokenizer)
            parts = ([samples] if not mini_batch_size
                     else mini_batches(samples, trainer.objective, mini_batch_size, seed=len(metrics)))
            for part in parts:
                if max_steps is not None and len(metrics) >= max_steps:
                    break  # the rest of the batch stays leased until it expires: trained by a later run
                with fixed_advantages(trainer, bool(mini_batch_size)):
                    step = trainer.step(part)
                step["epoch"] = float(epoch)
                extra = after_step(step) if after_step else {}
                part_ids = [s.turn_id for s in part if s.sibling_of is None]
                leases.record_step(engine, run_id, trainer.step_count, part_ids,
                                   step | {"turn_ids": part_ids, **extra})
                metrics.append(step)
                turns += len(part_ids)
                if on_step:
                    on_step(trainer.step_count, step)
        leases.finish_run(engine, run_id, status="done")
    return run_id, metrics, turns


def batch_advantages(samples: Sequence[Sample], cfg: ObjectiveConfig) -> list[float]:
    """Each sample's binary-RL advantage (one scalar: the same on each of its tokens) over the
    whole of *samples*, as the local trainer's step takes it (``trainer.objectives``)."""
    import torch

    from trainer import objectives
    from trainer.rewards import vote_credit, without_votes

    if not samples:
        return []
    if cfg.integrated_norm == "dense":
        # grouped turns with an outcome: the outcome's group advantage plus the votes' credit; the
        # rest as "group" takes them
        group = dataclasses.replace(cfg, integrated_norm="group")
        rest = batch_advantages(samples, group)
        outcome = batch_advantages([without_votes(s) for s in samples], group)
        credit = vote_credit(samples, cfg.vote_weight)
        return [r if c is None else o + c for r, o, c in zip(rest, outcome, credit, strict=True)]
    mask = torch.ones((len(samples), 1))
    rewards = objectives.sample_rewards(samples, by_group=cfg.integrated_norm == "group")
    groups = [s.group_id for s in samples]
    adv, _ = objectives.compute_binary_advantage(
        objectives.scores_to_token_rewards(rewards, mask), mask,
        index=groups if cfg.grpo and any(g is not None for g in groups) else None, config=cfg)
    return adv[:, 0].tolist()


def mini_batches(samples: Sequence[Sample], cfg: ObjectiveConfig, size: int, *, seed: int = 0) -> list[list[Sample]]:
    """*samples* with their advantages taken over all of them (:func:`batch_advantages`), each
    then carried as the sample's reward (no group, no outcome: under :func:`fixed_advantages` the
    step's advantage is that reward as it is), shuffled (*seed*) into ⌈n / size⌉ mini-batches of
    near-equal size. A shadow sibling goes with its original."""
    if size < 1:
        raise ValueError(f"mini_batch_size must be >= 1, got {size}")
    adv = batch_advantages(samples, cfg)
    fixed = [dataclasses.replace(s, reward=a, integrated_reward=None, group_id=None)
             for s, a in zip(samples, adv, strict=True)]
    units: dict[str, list[Sample]] = {}
    for s in fixed:
        units.setdefault(s.sibling_of or s.turn_id, []).append(s)
    order = list(units.values())
    random.Random(seed).shuffle(order)
    k = max(1, math.ceil(len(order) / size))
    return [[s for unit in order[i::k] for s in unit] for i in range(k)]


@contextlib.contextmanager
def fixed_advantages(trainer: Any, on: bool) -> Iterator[None]:
    """While *on*, the trainer's objective takes each sample's reward as its binary-RL advantage
    (no group, no baseline: what :func:`mini_batches` computed over the whole batch)."""
    if not on:
        yield
        return
    if not hasattr(trainer, "objective"):
        raise ValueError("mini-batches with whole-batch advantages need the local trainer")
    objective = trainer.objective
    trainer.objective = dataclasses.replace(objective, grpo=False, rl_baseline="none", integrated_norm="step")
    try:
        yield
    finally:
        trainer.objective = objective
