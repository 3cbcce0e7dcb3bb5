"""veRL's ``ppo_trainer`` config (Hydra) for a run of the veRL backend."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from trainer import objectives
from trainer.config import VerlConfig
from trainer.verl.weights import BACKEND, PoolCheckpointManager


#: VerlConfig.old_logprob_pass: when veRL's no-grad log-prob pass runs (trainer.verl.ppo.PoolPPOTrainer)
OLD_LOGPROB_PASS = ("auto", "always")


def build_config(cfg: VerlConfig, objective: objectives.ObjectiveConfig, *, batch_size: int,
                 total_steps: int) -> Any:
    """veRL's own ``ppo_trainer`` config (Hydra) with our settings: no rollout, no critic, no
    reference worker, the actor on ``n_gpus_per_node × nnodes`` GPUs, our loss settings."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import verl.trainer.config as verl_config

    _check(cfg, objective, batch_size=batch_size)
    values = _actor_values(cfg, objective, batch_size=batch_size) | _run_values(
        cfg, objective, batch_size=batch_size, total_steps=total_steps)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(verl_config.__file__).parent), version_base=None):
        conf = compose(config_name="ppo_trainer")
    OmegaConf.set_struct(conf, False)
    for key, value in values.items():
        OmegaConf.update(conf, key, value, force_add=True)
    OmegaConf.update(conf, f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{BACKEND}",
                     {"out_dir": str(cfg.output_dir / "weights"), "model_dir": str(cfg.model_dir)}, force_add=True)
    # ``critic.enable`` None means "use one if the estimator needs it" (GAE); ours never do
    OmegaConf.update(conf, "critic.enable", False, force_add=True)
    if cfg.overrides:
        conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(list(cfg.overrides)))
    return conf


def _check(cfg: VerlConfig, objective: objectives.ObjectiveConfig, *, batch_size: int) -> None:
    """Refuse, before any worker starts, what the veRL backend cannot run."""
    if objective.opd_topk and cfg.fused_kernels:
        raise ValueError("top-k OPD (opd_topk) needs the actor's logits, which veRL's fused kernels never "
                         "materialise: turn them off (--no-verl-fused-kernels, VerlConfig.fused_kernels=False) or use the local backend")
    if objective.opd_topk_from:
        raise ValueError("opd_topk_from (top-k OPD from a reply position on) is not supported on the veRL backend "
                         "yet; use the local backend or opd_topk_from 0")
    if objective.kl_coef > 0:
        raise ValueError("kl_coef > 0 is not supported on the veRL backend yet (it needs a reference worker); "
                         "use the local backend or kl_coef 0")
    if cfg.old_logprob_pass not in OLD_LOGPROB_PASS:
        raise ValueError(f"old_logprob_pass is one of {OLD_LOGPROB_PASS}, not {cfg.old_logprob_pass!r}")
    world = cfg.n_gpus_per_node * cfg.nnodes
    if batch_size % world:
        raise ValueError(f"batch size {batch_size} must be a multiple of the GPU count {world}")


def _actor_values(cfg: VerlConfig, objective: objectives.ObjectiveConfig, *, batch_size: int) -> dict[str, Any]:
    """The ``actor_rollout_ref`` settings: the model, the actor's FSDP, optimizer and loss, the
    log-prob pass, and our checkpoint engine in place of a rollout."""
    micro = max(1, min(cfg.micro_batch_size, batch_size // (cfg.n_gpus_per_node * cfg.nnodes)))
    attn = cfg.attn_implementation or (
        "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa")
    remove_padding = attn.startswith("flash_attention") if cfg.remove_padding is None else cfg.remove_padding
    dynamic = cfg.max_tokens_per_gpu > 0
    values: dict[str, Any] = {
        "actor_rollout_ref.model.path": str(cfg.model_dir),
        "actor_rollout_ref.model.enable_gradient_checkpointing": cfg.gradient_checkpointing,
        "actor_rollout_ref.model.use_remove_padding": remove_padding,
        "actor_rollout_ref.model.override_config.attn_implementation": attn,
        "actor_rollout_ref.model.use_fused_kernels": cfg.fused_kernels,
        "actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch",
        "actor_rollout_ref.model.lora_rank": cfg.lora_rank if cfg.lora else 0,
        "actor_rollout_ref.model.lora_alpha": cfg.lora_alpha,
        "actor_rollout_ref.model.target_modules": list(cfg.lora_targets),
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
        "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16" if cfg.bf16 else "float32",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        "actor_rollout_ref.actor.fsdp_config.seed": cfg.seed,
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": cfg.reshard_after_forward,
        "actor_rollout_ref.model.use_liger": cfg.liger,
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": dynamic,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": BACKEND,
        # the workers import this module, which registers the engine under BACKEND
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": PoolCheckpointManager.__module__,
        "actor_rollout_ref.rollout.checkpoint_manager_class":
            f"{PoolCheckpointManager.__module__}.{PoolCheckpointManager.__qualname__}",
    }
    if cfg.fused_adam:  # torch.optim.AdamW's own keyword, through veRL's optimizer builder
        values["actor_rollout_ref.actor.optim.override_optimizer_config"] = {"fused": True}
    if dynamic:  # the token budget per GPU, for the update and the log-prob pass alike
        values["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] = cfg.max_tokens_per_gpu
        values["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] = cfg.max_tokens_per_gpu
    return values


def _run_values(cfg: VerlConfig, objective: objectives.ObjectiveConfig, *, batch_size: int,
               total_steps: int) -> dict[str, Any]:
    """The ``algorithm``, ``trainer`` and ``data`` settings: our estimator, no KL in the reward,
    the GPUs, no validation or checkpoints of veRL's own (the pool and our pushes are the record)."""
    return {
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
