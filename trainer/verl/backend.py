"""The veRL backend behind the local backend's calls (:class:`VerlTrainer`) and the offline
run on it (:func:`train_verl`, ``nextstate train --backend verl``)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from verl import DataProto

from base.vocab import VersionKind
from trainer import objectives
from trainer.config import RunLimits, VerlConfig
from trainer.samples import Sample
from trainer.verl.batch import samples_to_batch
from trainer.verl.config import build_config
from trainer.verl.ppo import PoolPPOTrainer, ray_init


@dataclass
class VerlTrainer:
    """The veRL backend behind the same two calls as ``LocalTrainer``: ``step(samples)`` and
    ``save(out_dir)``."""

    cfg: VerlConfig
    objective: objectives.ObjectiveConfig
    batch_size: int
    total_steps: int
    publish: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
    step_count: int = 0
    trainer: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_dir)
        conf = build_config(self.cfg, self.objective, batch_size=self.batch_size, total_steps=self.total_steps)
        ray_init(self.cfg.ray_address)
        self.trainer = PoolPPOTrainer(conf, self.tokenizer, self.objective, publish=self.publish,
                                      old_logprob_pass=self.cfg.old_logprob_pass)
        self.trainer.init_workers()

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def _batch(self, samples: Sequence[Sample], size: int) -> DataProto:
        """The samples' batch padded to ``size`` rows with copies whose response mask is 0 (they
        add nothing to a token-mean loss): veRL splits a batch evenly over the actor's ranks and
        its mini-batches, so the last, short batch of a pass must still fill them."""
        samples = list(samples)
        if len(samples) > size:
            raise ValueError(f"{len(samples)} samples for a batch of {size}")
        extra = size - len(samples)
        batch = samples_to_batch(samples + [samples[0]] * extra, self.pad_token_id)
        if extra:
            for key in ("response_mask", "token_level_scores"):
                batch.batch[key][-extra:] = 0
            nt = batch.non_tensor_batch
            nt["has_group"][-extra:] = False
            nt["has_teacher"][-extra:] = False
            nt["has_topk"][-extra:] = False
            if "topk_mask" in batch.batch.keys():
                batch.batch["topk_mask"][-extra:] = 0
            for k in range(len(samples), size):
                nt["uid"][k] = nt["turn_id"][k] = f"pad:{k}"
        return batch

    def step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step over ``samples`` on the Ray/FSDP actor; returns its metrics in the
        local backend's names (``pg_loss``, ``pg_clipfrac``, ``advantage_mean``, ``tokens_per_s``
        ...) plus veRL's own (``actor/...``, ``perf/...``, ``timing_s/...``)."""
        started = time.perf_counter()
        batch = self._batch(samples, self.batch_size)
        metrics = self.trainer.train_step(batch)
        self.step_count += 1
        elapsed = time.perf_counter() - started
        done = self.trainer.last_batch
        mask, adv = done.batch["response_mask"], done.batch["advantages"]
        tokens = float(mask.sum())
        out = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}
        out.update({
            "pg_loss": out.get("actor/pg_loss", float("nan")),
            "pg_clipfrac": out.get("actor/pg_clipfrac", 0.0),
            **({"topk_kl": out["actor/topk_kl"]} if "actor/topk_kl" in out else {}),
            "ppo_kl": out.get("actor/ppo_kl", 0.0),
            "advantage_mean": float((adv * mask).sum() / mask.sum()),
            "tokens": tokens, "tokens_per_s": tokens / elapsed, "samples": float(len(samples)),
            "seconds": elapsed,
        })
        return out

    def response_logprobs(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(a_t | prefix) of each response token under the current policy, response mask),
        both (batch, longest response), computed by the actor workers — no update."""
        world = self.cfg.n_gpus_per_node * self.cfg.nnodes
        batch = self._batch(samples, -(-len(samples) // world) * world)
        batch.meta_info["temperature"] = self.trainer.config.actor_rollout_ref.rollout.temperature
        out, _ = self.trainer._compute_old_log_prob(batch)
        n = len(samples)
        return out.batch["old_log_probs"][:n], batch.batch["response_mask"][:n]

    def push(self, *, publish: bool = True) -> dict[str, Any]:
        """Write the current weights to a new directory and, with ``publish`` and a publisher,
        hot-load them into vLLM. Returns what was written (``path``, ``kind``, ``version`` ...)."""
        manager = self.trainer.checkpoint_manager
        metrics = manager.update_weights(self.trainer.global_steps, publish=publish)
        return manager.written[-1] | metrics

    def save(self, out_dir: Path) -> Path:
        """The adapter (LoRA) or the full model in ``out_dir``, with the tokenizer (no publish)."""
        src = Path(self.push(publish=False)["path"])
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, out_dir, dirs_exist_ok=True)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()


def config_summary(cfg: VerlConfig) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}


# ------------------------------------------------------------------------- the offline run


def train_verl(
    engine: Any,
    *,
    objective: objectives.ObjectiveConfig,
    verl: VerlConfig,
    filters: Any,
    batch_size: int = RunLimits.batch_size,
    max_steps: int | None = None,
    epochs: int = RunLimits.epochs,
    lease_s: float = RunLimits.lease_s,
    output_root: Path,
    resume: str | None = None,
    publish: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    push_every: int = RunLimits.push_every,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> Any:
    """``trainer.offline.train_offline`` on the veRL backend: lease scored turns, one veRL step
    per batch, record and ack each step, and push the weights through the checkpoint engine
    every ``push_every`` steps (0: only at the end) and at the end; with ``publish`` each push
    is hot-loaded into vLLM and registered as the active policy version (``publishing.publish.publish``).
    A LoRA run continues from the active version's adapter, as the local backend does."""
    from sqlalchemy.orm import Session as OrmSession

    from datapool.queries import active_policy_version
    from trainer.offline import RunResult, run_epochs

    with OrmSession(engine) as db:
        parent = active_policy_version(db)
        parent_name = parent.name if parent else None
        parent_adapter = parent.path if parent is not None and parent.kind == VersionKind.LORA else None
    if verl.lora and parent_adapter:
        verl.overrides = (*verl.overrides, f"actor_rollout_ref.model.lora_adapter_path={parent_adapter}")
    verl.output_dir = output_root
    total = max_steps if max_steps is not None else 10**9
    trainer = VerlTrainer(verl, objective, batch_size=batch_size, total_steps=total, publish=publish)
    config = {"backend": "verl", "objective": asdict(objective), "batch_size": batch_size,
              "verl": config_summary(verl), "filters": {k: str(v) for k, v in asdict(filters).items() if v}}
    last_push: dict[str, Any] | None = None

    def push_when_due(step: dict[str, float]) -> dict[str, Any]:
        nonlocal last_push
        if not push_every or trainer.step_count % push_every:
            return {}
        last_push = trainer.push(publish=publish is not None)
        step["pushed_step"] = float(trainer.step_count)
        return {"version": last_push.get("version")} if last_push else {}

    try:
        run_id, metrics, turns = run_epochs(
            engine, trainer, backend="verl", config=config, objective=objective.objective, parent_name=parent_name,
            filters=filters, batch_size=batch_size, max_steps=max_steps, epochs=epochs, lease_s=lease_s,
            resume=resume, after_step=push_when_due, on_step=on_step)
        if not metrics:
            return RunResult(run_id, 0, 0, None, None, [], parent_name)
        if last_push is None or last_push.get("step") != trainer.step_count:
            last_push = trainer.push(publish=publish is not None)
        out = output_root / f"run-{run_id}"
        shutil.copytree(last_push["path"], out, dirs_exist_ok=True)
        trainer.tokenizer.save_pretrained(out)
        return RunResult(run_id, len(metrics), turns, out, last_push.get("version"), metrics, parent_name)
    finally:
        trainer.shutdown()
