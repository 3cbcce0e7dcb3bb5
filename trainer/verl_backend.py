"""The veRL backend: train on many GPUs and nodes (Ray + FSDP) from the pool.

Built on veRL 0.9.1's own classes, patched nowhere:

- :class:`PoolPPOTrainer` is veRL's separation-style ``SeparateRayPPOTrainer`` with its
  generation step replaced: a step's batch is leased from the pool (``datapool.leases``) and
  turned into veRL's ``DataProto`` by :func:`samples_to_batch` — prompts, responses, masks,
  behaviour logprobs, teacher logprobs and the turn rewards as ``token_level_scores``.
  Everything after that is veRL's own step: the actor recomputes the current policy's
  log-probs, the driver computes advantages with our estimators (``nextstate_binary`` /
  ``nextstate_opd`` / ``nextstate_combined``, registered in veRL's registry by
  ``trainer.objectives``), and veRL's actor update runs its PPO loss (``ppo_loss`` with the
  ``vanilla`` clipped surrogate, our ε_low/ε_high/dual clip and loss aggregation) on FSDP.
  Top-k OPD (``opd_topk``) goes through veRL's top-k distillation hook: the batch carries the
  teacher's top-k in veRL's ``teacher_ids``/``teacher_logprobs`` layout, and the actor's loss
  function is :func:`topk_opd_loss`, which the FSDP engine hands the logits (it needs them:
  not with veRL's fused kernels, which ``build_config`` refuses with it).
- Weight push: :class:`PoolCheckpointEngine` is a checkpoint engine registered with veRL's
  ``CheckpointEngineRegistry`` as ``"nextstate"``; instead of streaming weights into a rollout
  engine veRL started, it writes them — the LoRA adapter in PEFT layout, or the full model in
  Hugging Face layout — to a new directory. :class:`PoolCheckpointManager` (the trainer's
  ``checkpoint_manager``, loadable through ``rollout.checkpoint_manager_class``) then
  hot-loads that directory into the serving vLLM through ``publishing.publish``, the same
  policy-version bookkeeping the local backend uses.

The batch maths is the local backend's (``trainer.local``) to the token: the same samples
give the same tensors, advantages and loss (tests/trainer/test_verl_backend.py, on the CPU). What
needs a GPU is only the Ray workers (veRL places them on GPU bundles).

veRL pins ``transformers<5.11`` and vLLM needs ``>=5.16``: the trainer runs from the ``train``
extra's environment, vLLM from its own (docs/trainer-verl.md).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from verl import DataProto
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, ResourcePoolManager
from verl.trainer.ppo.ray_trainer import compute_response_mask
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from trainer import objectives
from trainer.config import RunLimits, VerlConfig
from trainer.samples import Sample
from base.vocab import VersionKind

log = logging.getLogger("nextstate.trainer.verl")

#: The checkpoint-engine backend name of :class:`PoolCheckpointEngine`.
BACKEND = "nextstate"
#: Non-tensor keys a batch carries besides veRL's.
META_KEYS = ("uid", "turn_id", "session_id", "step_index", "has_behaviour", "has_teacher", "has_topk")
#: A top-k entry that is no token (a position with fewer than K, or none): its teacher log-prob.
TOPK_ABSENT = -1e9


# --------------------------------------------------------------------------------- the batch


def samples_to_batch(samples: Sequence[Sample], pad_token_id: int) -> DataProto:
    """veRL's batch for these samples, in its left/right padding layout.

    Tensors (``B`` samples, ``P`` the longest prompt, ``R`` the longest response):
    ``prompts`` (B, P) left-padded, ``responses`` (B, R) right-padded, ``input_ids`` =
    prompts ‖ responses, ``attention_mask`` and ``position_ids`` over it, ``response_mask``
    (B, R), ``rollout_log_probs`` (B, R: vLLM's captured behaviour logprobs, 0 where a turn has
    none), ``teacher_log_probs`` (B, R: 0 where none) and ``token_level_scores`` (B, R: the
    reward on the last response token, :func:`objectives.scores_to_token_rewards`).
    Non-tensors: ``uid`` (the GRPO group: the session's task group, else the turn), ``turn_id``,
    ``session_id``, ``step_index``, ``has_behaviour``, ``has_teacher``, ``has_topk``.

    When any sample carries the teacher's top-k (top-k OPD), also ``teacher_ids`` and
    ``teacher_logprobs`` (B, P + R, K: the largest k) in veRL's distillation layout — over the
    whole padded sequence, column j holding the top-k for the token at j + 1, so the response
    token t of a prompt of P columns is at P − 1 + t; entries that are no token have log-prob
    :data:`TOPK_ABSENT` — and ``topk_mask`` (B, R: the response mask of the samples that have
    them). ``left_right_2_no_padding`` packs the first two as veRL's FSDP engine expects.
    """
    if not samples:
        raise ValueError("an empty batch")
    for s in samples:
        if not s.prompt_ids or not s.response_ids:
            raise ValueError(f"turn {s.turn_id} has an empty prompt or response")
    n = len(samples)
    p_len = max(len(s.prompt_ids) for s in samples)
    r_len = max(len(s.response_ids) for s in samples)
    prompts = torch.full((n, p_len), pad_token_id, dtype=torch.long)
    responses = torch.full((n, r_len), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, p_len + r_len), dtype=torch.long)
    response_mask = torch.zeros((n, r_len), dtype=torch.float32)
    behaviour = torch.zeros((n, r_len), dtype=torch.float32)
    teacher = torch.zeros((n, r_len), dtype=torch.float32)
    for i, s in enumerate(samples):
        lp, lr = len(s.prompt_ids), len(s.response_ids)
        prompts[i, p_len - lp:] = torch.tensor(s.prompt_ids)
        responses[i, :lr] = torch.tensor(s.response_ids)
        attention[i, p_len - lp: p_len + lr] = 1
        response_mask[i, :lr] = torch.tensor(s.loss_weights())
        if s.behaviour_logprobs is not None:
            behaviour[i, :lr] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if s.teacher_logprobs is not None:
            teacher[i, :lr] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    position_ids = torch.clamp(torch.cumsum(attention, dim=-1) - 1, min=0)
    scores = objectives.scores_to_token_rewards(objectives.sample_rewards(samples), response_mask)
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention, "position_ids": position_ids, "response_mask": response_mask,
        "rollout_log_probs": behaviour, "teacher_log_probs": teacher, "token_level_scores": scores,
    }
    has_topk = [s.teacher_topk_ids is not None and s.teacher_topk_logprobs is not None for s in samples]
    if any(has_topk):
        k = max(len(x) for s, h in zip(samples, has_topk, strict=True) if h for x in s.teacher_topk_ids or [[]])
        top_ids = torch.zeros((n, p_len + r_len, max(k, 1)), dtype=torch.long)
        top_lps = torch.full((n, p_len + r_len, max(k, 1)), TOPK_ABSENT, dtype=torch.float32)
        for i, s in enumerate(samples):
            if not has_topk[i]:
                continue
            for t, (tok, lp) in enumerate(zip(s.teacher_topk_ids or [], s.teacher_topk_logprobs or [], strict=True)):
                if t >= len(s.response_ids):
                    break
                top_ids[i, p_len - 1 + t, : len(tok)] = torch.tensor(tok, dtype=torch.long)
                top_lps[i, p_len - 1 + t, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        tensors |= {"teacher_ids": top_ids, "teacher_logprobs": top_lps,
                    "topk_mask": response_mask * torch.tensor(has_topk, dtype=torch.float32)[:, None]}
    uid = np.array([s.group_id if s.group_id is not None else f"turn:{s.turn_id}" for s in samples], dtype=object)
    non_tensors = {
        "uid": uid,
        "turn_id": np.array([s.turn_id for s in samples], dtype=object),
        "session_id": np.array([s.session_id for s in samples], dtype=object),
        "step_index": np.array([s.step_index for s in samples], dtype=np.int64),
        "has_behaviour": np.array([s.behaviour_logprobs is not None for s in samples], dtype=bool),
        "has_teacher": np.array([s.teacher_logprobs is not None for s in samples], dtype=bool),
        "has_group": np.array([s.group_id is not None for s in samples], dtype=bool),
        "has_topk": np.array(has_topk, dtype=bool),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors,
                               meta_info={"global_token_num": attention.sum(-1).tolist()})


def add_advantages(batch: DataProto, cfg: objectives.ObjectiveConfig) -> DataProto:
    """Advantages for a batch whose ``old_log_probs`` hold the current policy's log-probs
    (veRL's actor recomputes them), exactly as ``LocalTrainer.step`` computes them.

    Then ``old_log_probs`` becomes π_behaviour, what veRL's PPO ratio divides by: vLLM's
    captured logprobs where the turn has them (the exact importance ratio), else the current
    policy's (black-box turns: ratio 1). Adds ``advantages``, ``returns`` and
    ``token_level_rewards`` (= ``token_level_scores``; no KL in the reward)."""
    t = batch.batch
    mask = t["response_mask"].to(torch.float32)
    student = t["old_log_probs"].to(torch.float32)
    has_behaviour = torch.as_tensor(batch.non_tensor_batch["has_behaviour"], device=student.device)
    t["current_log_probs"] = student
    t["old_log_probs"] = torch.where(has_behaviour[:, None], t["rollout_log_probs"].to(torch.float32), student)
    teacher = teacher_mask = None
    if cfg.objective != "rl":
        has_teacher = torch.as_tensor(batch.non_tensor_batch["has_teacher"], device=student.device)
        teacher = torch.where(has_teacher[:, None], t["teacher_log_probs"].to(torch.float32), student)
        if cfg.opd_topk:  # a sample distilled on the teacher's top-k takes no sampled-token OPD advantage
            has_teacher = has_teacher & ~torch.as_tensor(batch.non_tensor_batch["has_topk"], device=student.device)
        teacher_mask = has_teacher.to(torch.float32)[:, None] * mask
    t["token_level_rewards"] = t["token_level_scores"]
    has_group = batch.non_tensor_batch["has_group"]
    index = ([g if h else None for g, h in zip(batch.non_tensor_batch["uid"], has_group, strict=True)]
             if cfg.grpo and bool(np.any(has_group)) else None)
    adv = objectives.compute_advantages(cfg, response_mask=mask, token_level_rewards=t["token_level_scores"],
                                        index=index, teacher_log_prob=teacher, student_log_prob=student,
                                        teacher_mask=teacher_mask)
    t["advantages"] = adv
    t["returns"] = adv
    return batch


# ------------------------------------------------------------------------- top-k OPD's loss


def topk_batch_info(batch: Any) -> dict[str, int]:
    """What the top-k term is averaged over, counted over a whole step's batch (one mini-batch:
    ``build_config``), as the local backend averages it: ``topk_num_tokens`` (its positions:
    ``topk_mask``) and ``topk_num_seqs`` (the samples that have any). veRL's own counts are of
    every response token and sample, which would shrink the term when some samples lack top-k."""
    mask = batch["topk_mask"]
    return {"topk_num_tokens": int(mask.sum()), "topk_num_seqs": int((mask.sum(-1) > 0).sum())}


def _topk_kl_from_logits(student_logits: torch.Tensor, data: Any, tail: bool) -> torch.Tensor:
    """Per packed position, :func:`objectives.topk_opd_kl` of the student's log-probs of the
    teacher's top-k tokens (gathered from *student_logits*, ``(1, nnz, V)``, already divided by
    the temperature) against the teacher's: ``(1, nnz)``, 0 where the position has none."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    ids, lps = data["teacher_ids"], data["teacher_logprobs"]
    ids = ids.values().unsqueeze(0) if ids.is_nested else ids
    lps = lps.values().unsqueeze(0) if lps.is_nested else lps
    if get_ulysses_sequence_parallel_world_size() > 1:  # this rank's slice of the sequence, as veRL's own
        ids, lps = slice_input_tensor(ids, dim=1), slice_input_tensor(lps, dim=1)
    if ids.shape[:2] != student_logits.shape[:2]:
        raise ValueError(f"top-k OPD: teacher top-k for {ids.shape[1]} positions, logits for {student_logits.shape[1]}")
    logits = student_logits.float()
    logp = logits.gather(-1, ids.to(logits.device)) - torch.logsumexp(logits, -1, keepdim=True)
    lps = lps.to(logits.device)
    return objectives.topk_opd_kl(logp, lps, lps > TOPK_ABSENT / 2, tail=tail)


def topk_opd_loss(config: Any, model_output: dict[str, Any] | None = None, data: Any = None, dp_group: Any = None,
                  *, w_opd: float, tail: bool = True, student_logits: torch.Tensor | None = None,
                  data_format: str = "thd") -> Any:
    """The actor's loss function for top-k OPD (``PoolActorWorker`` sets it in place of veRL's
    ``ppo_loss``), called the two ways veRL's FSDP engine calls a distillation loss:

    - with ``student_logits`` (the micro-batch's logits, ``(1, nnz, V)``, when the batch is marked
      ``distillation_use_topk``): as its logits processor, returning ``{"topk_opd_kl": (1, nnz)}``,
      the per-position KL(q ‖ p) of :func:`objectives.topk_opd_kl`, which the engine hands back in
      ``model_output``;
    - otherwise as the loss: veRL's ``ppo_loss`` (the clipped surrogate on the advantages) plus
      ``w_opd · agg(topk_opd_kl)`` over ``topk_mask``, aggregated by the actor's
      ``loss_agg_mode`` over the step's top-k positions (:func:`topk_batch_info`) — the local
      backend's ``objectives.compute_loss`` with its ``topk_*`` arguments, term for term. Adds
      the metric ``actor/topk_kl`` (the aggregated term, before w_opd).
    """
    if student_logits is not None:
        return {"topk_opd_kl": _topk_kl_from_logits(student_logits, data, tail)}
    assert model_output is not None and data is not None
    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    if "topk_opd_kl" not in model_output or "topk_mask" not in data.keys():
        return loss, metrics
    kl = no_padding_2_padding(model_output["topk_opd_kl"], data)
    mask = data["topk_mask"]
    if mask.is_nested:
        mask = mask.to_padded_tensor(0.0)
    mask = mask[:, : kl.shape[1]].to(device=kl.device, dtype=torch.bool)
    info = dict(config.global_batch_info)
    tokens = tu.get_non_tensor_data(data=data, key="topk_num_tokens", default=None)
    seqs = tu.get_non_tensor_data(data=data, key="topk_num_seqs", default=None)
    if tokens is not None:
        info["batch_num_tokens"] = max(int(tokens), 1)
    if seqs is not None:
        info["global_batch_size"] = max(int(seqs), 1)
    topk = agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info)
    metrics["actor/topk_kl"] = Metric(value=topk, aggregation=metrics["actor/pg_loss"].aggregation)
    return loss + w_opd * topk, metrics


# ------------------------------------------------------------------------------- the config


def build_config(cfg: VerlConfig, objective: objectives.ObjectiveConfig, *, batch_size: int,
                 total_steps: int) -> Any:
    """veRL's own ``ppo_trainer`` config (Hydra) with our settings: no rollout, no critic, no
    reference worker, the actor on ``n_gpus_per_node × nnodes`` GPUs, our loss settings."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import verl.trainer.config as verl_config

    if objective.opd_topk and cfg.fused_kernels:
        raise ValueError("top-k OPD (opd_topk) needs the actor's logits, which veRL's fused kernels never "
                         "materialise: turn them off (--no-verl-fused-kernels, VerlConfig.fused_kernels=False) or use the local backend")
    if objective.kl_coef > 0:
        raise ValueError("kl_coef > 0 is not supported on the veRL backend yet (it needs a reference worker); "
                         "use the local backend or kl_coef 0")
    world = cfg.n_gpus_per_node * cfg.nnodes
    if batch_size % world:
        raise ValueError(f"batch size {batch_size} must be a multiple of the GPU count {world}")
    micro = max(1, min(cfg.micro_batch_size, batch_size // world))
    dtype = "bfloat16" if cfg.bf16 else "float32"
    attn = cfg.attn_implementation or (
        "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa")
    remove_padding = attn.startswith("flash_attention") if cfg.remove_padding is None else cfg.remove_padding
    dynamic = cfg.max_tokens_per_gpu > 0
    lora = {
        "actor_rollout_ref.model.lora_rank": cfg.lora_rank if cfg.lora else 0,
        "actor_rollout_ref.model.lora_alpha": cfg.lora_alpha,
        "actor_rollout_ref.model.target_modules": list(cfg.lora_targets),
    }
    values: dict[str, Any] = {
        "actor_rollout_ref.model.path": str(cfg.model_dir),
        "actor_rollout_ref.model.enable_gradient_checkpointing": cfg.gradient_checkpointing,
        "actor_rollout_ref.model.use_remove_padding": remove_padding,
        "actor_rollout_ref.model.override_config.attn_implementation": attn,
        "actor_rollout_ref.model.use_fused_kernels": cfg.fused_kernels,
        "actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch",
        **lora,
        "actor_rollout_ref.actor.strategy": cfg.strategy,
        "actor_rollout_ref.actor.optim.lr": cfg.lr,
        "actor_rollout_ref.actor.optim.weight_decay": 0.01,
        "actor_rollout_ref.actor.optim.clip_grad": cfg.clip_grad,  # torch AdamW's default, as the local backend
        "actor_rollout_ref.actor.ppo_mini_batch_size": batch_size,  # one optimizer step per leased batch
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.shuffle": False,
        "actor_rollout_ref.actor.use_dynamic_bsz": dynamic,
        "actor_rollout_ref.actor.clip_ratio": objective.clip_low,
        "actor_rollout_ref.actor.clip_ratio_low": objective.clip_low,
        "actor_rollout_ref.actor.clip_ratio_high": objective.clip_high,
        "actor_rollout_ref.actor.clip_ratio_c": objective.clip_ratio_c,
        "actor_rollout_ref.actor.loss_agg_mode": objective.loss_agg_mode,
        "actor_rollout_ref.actor.policy_loss.loss_mode": objective.policy_loss,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.fsdp_config.param_offload": cfg.param_offload,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": cfg.optimizer_offload,
        "actor_rollout_ref.actor.fsdp_config.dtype": dtype,
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        "actor_rollout_ref.actor.fsdp_config.seed": cfg.seed,
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": dynamic,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": BACKEND,
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": __name__,
        "actor_rollout_ref.rollout.checkpoint_manager_class": f"{__name__}.PoolCheckpointManager",
        "algorithm.adv_estimator": objectives.ADV_ESTIMATOR_FOR_OBJECTIVE[objective.objective],
        "algorithm.use_kl_in_reward": False,
        "algorithm.norm_adv_by_std_in_grpo": objective.grpo_norm_by_std,
        "trainer.n_gpus_per_node": cfg.n_gpus_per_node,
        "trainer.nnodes": cfg.nnodes,
        "trainer.total_training_steps": total_steps,
        "trainer.logger": ["console"],
        "trainer.project_name": "nextstate",
        "trainer.experiment_name": "verl",
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": -1,
        "trainer.balance_batch": True,
        "trainer.critic_warmup": 0,
        "trainer.default_local_dir": str(cfg.output_dir / "checkpoints"),
        "trainer.device": "cuda",
        "data.train_batch_size": batch_size,
    }
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(verl_config.__file__).parent), version_base=None):
        conf = compose(config_name="ppo_trainer")
    OmegaConf.set_struct(conf, False)
    if dynamic:  # the token budget per GPU, for the update and the log-prob pass alike
        values["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] = cfg.max_tokens_per_gpu
        values["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] = cfg.max_tokens_per_gpu
    for key, value in values.items():
        OmegaConf.update(conf, key, value, force_add=True)
    OmegaConf.update(conf, f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{BACKEND}",
                     {"out_dir": str(cfg.output_dir / "weights"), "model_dir": str(cfg.model_dir)}, force_add=True)
    # ``critic.enable`` None means "use one if the estimator needs it" (GAE); ours never do
    OmegaConf.update(conf, "critic.enable", False, force_add=True)
    if cfg.overrides:
        conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(list(cfg.overrides)))
    return conf


# ----------------------------------------------------------------------------- weight push


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@CheckpointEngineRegistry.register(BACKEND)
class PoolCheckpointEngine(CheckpointEngine):
    """Writes the actor's weights to a new directory instead of sending them to a rollout
    engine veRL started (the serving vLLM is not veRL's; ``PoolCheckpointManager`` loads it).

    Every rank consumes the weight generator (gathering a sharded tensor is collective); rank 0
    writes. LoRA (``peft_config`` given): ``adapter_model.safetensors`` + ``adapter_config.json``
    in PEFT's layout, which vLLM's ``/v1/load_lora_adapter`` reads. Full weights:
    ``model.safetensors`` in Hugging Face layout with the base model's config and tokenizer.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, out_dir: str = "verl-weights",
                 model_dir: str | None = None) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.out_dir = Path(out_dir)
        self.model_dir = Path(model_dir) if model_dir else None

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        pass

    def finalize(self) -> None:
        pass

    def write(self, weights: Iterator[tuple[str, torch.Tensor]], *, global_steps: int | None,
              peft_config: Any = None) -> dict[str, Any]:
        """Consume ``weights``; on rank 0 write them to ``<out_dir>/step-<n>-<random>``.
        Returns ``{"path", "kind", "tensors", "bytes", "seconds"}`` on rank 0, ``{}`` elsewhere."""
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if self.is_master:
                tensors[name] = tensor.detach().to("cpu")
        if not self.is_master:
            return {}
        out = self.out_dir / f"step-{global_steps or 0:06d}-{uuid.uuid4().hex[:6]}"
        tmp = out.with_name(f".tmp-{out.name}")
        tmp.mkdir(parents=True, exist_ok=False)
        if peft_config is not None:
            kind = "lora"
            # PEFT's own layout: keys "base_model.model.<module>.lora_A.weight", no adapter name
            _write_safetensors(tmp / "adapter_model.safetensors", tensors)
            # veRL's FSDP engine hands the LoraConfig over as a plain dict
            adapter_cfg = dict(peft_config) if isinstance(peft_config, dict) else peft_config.to_dict()
            adapter_cfg.setdefault("peft_type", "LORA")
            if self.model_dir is not None:  # vLLM and PEFT read base_model_name_or_path
                adapter_cfg["base_model_name_or_path"] = str(self.model_dir)
            (tmp / "adapter_config.json").write_text(json.dumps(
                adapter_cfg, indent=2, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))
        else:
            kind = "full"
            _write_safetensors(tmp / "model.safetensors", tensors)
            if self.model_dir is not None:
                for f in self.model_dir.iterdir():
                    if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) \
                            and f.name != "model.safetensors.index.json":
                        shutil.copy2(f, tmp / f.name)
        tmp.rename(out)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"path": str(out.resolve()), "kind": kind, "tensors": len(tensors), "bytes": size,
                "seconds": time.perf_counter() - started}

    async def send_weights(self, weights: Any, global_steps: int | None = None, peft_config: Any = None
                           ) -> dict[str, Any]:
        return self.write(iter(weights), global_steps=global_steps, peft_config=peft_config)

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError("the serving vLLM loads the written directory over HTTP (publishing.publish)")


class PoolActorWorker(ActorRolloutRefWorker):
    """veRL's ``ActorRolloutRefWorker`` (role ``actor``: no rollout engine on the trainer's
    GPUs) whose ``update_weights`` hands the actor's weights — the adapter alone for LoRA — to
    our checkpoint engine. With ``opd_topk`` (``{"w_opd", "tail"}``) its actor's loss function is
    :func:`topk_opd_loss` instead of veRL's ``ppo_loss``."""

    def __init__(self, config: Any, role: str, opd_topk: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(config, role, **kwargs)
        self.opd_topk = opd_topk

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        super().init_model()
        if self.opd_topk and self.actor is not None:
            self.loss_fn = partial(topk_opd_loss, config=self.loss_fn.keywords["config"], **self.opd_topk)
            self.actor.set_loss_fn(self.loss_fn)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        if mode not in ("auto", BACKEND) or not isinstance(self.checkpoint_engine, PoolCheckpointEngine):
            return await super().update_weights(global_steps=global_steps, mode=mode)
        # base_sync_done=True: for a LoRA model, the adapter's tensors, not the base weights
        weights, peft_config = self.actor.engine.get_per_tensor_param(base_sync_done=True)
        return self.checkpoint_engine.write(iter(weights), global_steps=global_steps, peft_config=peft_config)


class PoolCheckpointManager:
    """The trainer's ``checkpoint_manager`` (veRL's ``CheckpointEngineManager`` interface):
    ``update_weights`` makes the actor write its weights through :class:`PoolCheckpointEngine`,
    then hands the directory to ``publish`` (hot-load into vLLM + register the policy version;
    None: only write). There are no rollout replicas to sleep or wake."""

    def __init__(self, config: Any, actor_wg: Any, replicas: Sequence[Any] = (),
                 publish: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> None:
        self.config = config
        self.actor_wg = actor_wg
        self.replicas = list(replicas)
        self.publish = publish
        self.written: list[dict[str, Any]] = []

    def update_weights(self, global_steps: int | None = None, *, publish: bool = True) -> dict[str, Any]:
        """Write the actor's weights (all ranks take part; rank 0 writes) and, with a publisher
        and ``publish``, hot-load them. Returns metrics; ``written[-1]`` describes the directory."""
        results = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=BACKEND))
        written = next((r for r in results if isinstance(r, dict) and r.get("path")), None)
        if written is None:
            raise RuntimeError("no actor rank wrote the weights")
        written["step"] = global_steps
        self.written.append(written)
        metrics = {"weights/write_s": written["seconds"], "weights/bytes": float(written["bytes"])}
        if self.publish is not None and publish:
            started = time.perf_counter()
            version = self.publish(written)
            metrics["weights/publish_s"] = time.perf_counter() - started
            if version:
                written["version"] = version.get("name")
        return metrics

    def sleep_replicas(self) -> None:
        pass

    def wake_up_replicas(self) -> None:
        pass


# ------------------------------------------------------------------------------ the trainer


class PoolPPOTrainer(SeparateRayPPOTrainer):
    """veRL's separation-style PPO trainer whose batches come from the pool, not a rollout."""

    def __init__(self, config: Any, tokenizer: Any, objective: objectives.ObjectiveConfig,
                 publish: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None, **kwargs: Any):
        pool = "global_pool"
        manager = ResourcePoolManager(
            resource_pool_spec={pool: [config.trainer.n_gpus_per_node] * config.trainer.nnodes},
            mapping={Role.ActorRollout: pool})
        self.objective = objective
        self._publish = publish
        super().__init__(config, tokenizer, role_worker_mapping={Role.ActorRollout: ray.remote(PoolActorWorker)},
                         resource_pool_manager=manager, **kwargs)

    # no dataset: the pool is the data
    def _create_dataloader(self, *args: Any, **kwargs: Any) -> None:
        self.train_dataset = self.val_dataset = None
        self.train_dataloader = self.val_dataloader = None
        self.total_training_steps = int(self.config.trainer.total_training_steps)

    def _create_actor_rollout_classes(self) -> None:
        pool = self.resource_pool_manager.get_resource_pool(Role.ActorRollout)
        topk = ({"w_opd": self.objective.w_opd, "tail": self.objective.opd_topk_tail}
                if self.objective.opd_topk else None)
        cls = RayClassWithInitArgs(cls=self.role_worker_mapping[Role.ActorRollout],
                                   config=self.config.actor_rollout_ref, role="actor", opd_topk=topk)
        self.resource_pool_to_cls[pool][str(Role.ActorRollout)] = cls

    def init_workers(self) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        self._init_resource_pools()
        self._create_worker_classes()
        self._init_worker_groups()
        self._init_models()
        self.checkpoint_manager = PoolCheckpointManager(
            omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine),
            self.actor_rollout_wg, publish=self._publish)

    # -- one step: veRL's fit_step, the generation replaced by the leased batch -----------

    def _fit_get_batch(self, batch_dict: Any) -> DataProto:
        # the temperature the actor divides logits by; 1.0: the behaviour logprobs vLLM returns
        # are of the sampled distribution only when the turn was sampled at temperature 1
        batch_dict.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        return batch_dict

    def _fit_generate(self, batch: DataProto = None) -> DataProto:
        if "response_mask" not in batch.batch.keys():
            batch.batch["response_mask"] = compute_response_mask(batch)
        if self.config.trainer.balance_batch:
            self._balance_batch(batch, metrics=self.metrics)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        batch.meta_info["images_seqlens"] = []
        return batch

    def _fit_compute_reward(self, batch: DataProto) -> DataProto:
        self.reward_tensor = batch.batch["token_level_scores"]
        self.reward_extra_infos_dict = {}
        return batch

    def _fit_compute_advantage(self, batch: DataProto) -> DataProto:
        from verl.utils.debug import marked_timer

        with marked_timer("adv", self.timing_raw, color="brown"):
            self.last_batch = add_advantages(batch, self.objective)
        return self.last_batch

    def _update_actor(self, batch: DataProto) -> DataProto:
        """With top-k OPD, veRL's ``_update_actor`` (0.9.1) marking a batch with the teacher's top-k
        ``distillation_use_topk`` (so the engine hands the logits to :func:`topk_opd_loss`) with
        the counts the top-k term is averaged over (:func:`topk_batch_info`)."""
        from verl.utils.py_functional import rename_dict

        if not self.objective.opd_topk:
            return super()._update_actor(batch)
        batch.meta_info["multi_turn"] = self.config.actor_rollout_ref.rollout.multi_turn.enable
        batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        batch_td = update_actor_batch(batch, self.config, self.objective)
        actor_output = tu.get(self.actor_rollout_wg.update_actor(batch_td), "metrics")
        actor_output = rename_dict(actor_output, "actor/")
        actor_output["perf/mfu/actor"] = actor_output.pop("actor/mfu")
        return DataProto.from_single_dict(data={}, meta_info={"metrics": actor_output})

    def _fit_update_weights(self) -> None:
        pass  # the caller pushes weights when it chooses (push_every)

    def _fit_postprocess_step(self) -> None:
        self.global_steps += 1

    def train_step(self, batch: DataProto) -> dict[str, Any]:
        """veRL's ``fit_step`` on a leased batch; returns its metrics."""
        self.is_last_step = False
        self.fit_step(batch)
        return dict(self.metrics)

    def push_weights(self) -> dict[str, Any]:
        return self.checkpoint_manager.update_weights(self.global_steps)


def update_actor_batch(batch: DataProto, config: Any, objective: objectives.ObjectiveConfig) -> Any:
    """The micro-batchable TensorDict veRL's ``_update_actor`` (0.9.1) sends the actor's
    ``update_actor``: the no-padding layout and its step settings, and for top-k OPD (a batch
    with ``teacher_ids``) the ``distillation_use_topk`` mark and :func:`topk_batch_info`."""
    actor = config.actor_rollout_ref.actor
    topk = bool(objective.opd_topk) and "teacher_ids" in batch.batch.keys()
    info = topk_batch_info(batch.batch) if topk else {}
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    mini = actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(batch_td, calculate_entropy=bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
                         distillation_use_topk=topk, distillation_only=False, global_batch_size=mini,
                         mini_batch_size=mini, epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                         dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True, **info)
    return batch_td


def ray_init(address: str | None, *, num_cpus: int | None = None) -> None:
    """Start or join Ray with the environment veRL's own entry point sets (tokenizers quiet,
    NCCL settings), and the repository on the workers' path."""
    if ray.is_initialized():
        return
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    runtime_env = get_ppo_ray_runtime_env()
    env = dict(runtime_env.get("env_vars", {}))
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    runtime_env["env_vars"] = env
    ray.init(address=address, runtime_env=runtime_env, num_cpus=num_cpus)


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
        self.trainer = PoolPPOTrainer(conf, self.tokenizer, self.objective, publish=self.publish)
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
