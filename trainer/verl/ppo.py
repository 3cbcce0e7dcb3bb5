"""veRL's PPO trainer and actor worker, fed from the pool: the trainer's generation step is
the leased batch, the worker writes weights through our checkpoint engine and, for top-k OPD,
runs our loss; and Ray started as veRL's own entry point starts it."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch
from verl import DataProto
from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, ResourcePoolManager
from verl.trainer.ppo.ray_trainer import compute_response_mask
from verl.trainer.ppo.utils import Role
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import left_right_2_no_padding

from trainer import objectives
from trainer.verl.batch import add_advantages
from trainer.verl.topk_loss import topk_batch_info, topk_opd_loss
from trainer.verl.weights import BACKEND, PoolCheckpointEngine, PoolCheckpointManager


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



class PoolPPOTrainer(SeparateRayPPOTrainer):
    """veRL's separation-style PPO trainer whose batches come from the pool, not a rollout."""

    def __init__(self, config: Any, tokenizer: Any, objective: objectives.ObjectiveConfig,
                 publish: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
                 old_logprob_pass: str = "auto", **kwargs: Any):
        pool = "global_pool"
        manager = ResourcePoolManager(
            resource_pool_spec={pool: [config.trainer.n_gpus_per_node] * config.trainer.nnodes},
            mapping={Role.ActorRollout: pool})
        self.objective = objective
        self._publish = publish
        self.old_logprob_pass = old_logprob_pass  # VerlConfig.old_logprob_pass
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

    def _fit_compute_log_prob(self, batch: DataProto) -> DataProto:
        """veRL's no-grad log-prob pass (π_old), skipped under ``old_logprob_pass="auto"`` where
        nothing reads it (:func:`old_logprob_pass_needed`): ``old_log_probs`` is then vLLM's
        captured log-probs, which :func:`~trainer.verl.batch.add_advantages` puts there anyway."""
        if self.old_logprob_pass == "auto" and not old_logprob_pass_needed(batch, self.objective):
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
            self.metrics["actor/old_log_prob_pass"] = 0.0
            return batch
        self.metrics["actor/old_log_prob_pass"] = 1.0
        return super()._fit_compute_log_prob(batch)

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


def old_logprob_pass_needed(batch: DataProto, objective: objectives.ObjectiveConfig) -> bool:
    """Whether the step reads the current policy's log-probs before its update: OPD (the
    student's log-probs of its advantage, top-k OPD's too) or a turn without vLLM's captured
    log-probs (black-box: its own π_old). An ``rl`` batch of captured turns reads neither."""
    if objective.objective != "rl":  # opd, combined (top-k OPD needs one of them)
        return True
    has = batch.non_tensor_batch.get("has_behaviour")
    return has is None or not bool(has.all())


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
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    runtime_env["env_vars"] = env
    ray.init(address=address, runtime_env=runtime_env, num_cpus=num_cpus)
