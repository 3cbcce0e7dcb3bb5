"""The veRL backend: train on many GPUs and nodes (Ray + FSDP) from the pool.

Built on veRL 0.9.1's own classes, patched nowhere. One module per job:

- :mod:`trainer.verl.batch` — a step's batch is leased from the pool (``datapool.leases``) and
  turned into veRL's ``DataProto`` by :func:`~trainer.verl.batch.samples_to_batch` — prompts,
  responses, masks, behaviour logprobs, teacher logprobs and the turn rewards as
  ``token_level_scores``; :func:`~trainer.verl.batch.add_advantages` computes the advantages
  with our estimators (``nextstate_binary`` / ``nextstate_opd`` / ``nextstate_combined``,
  registered in veRL's registry by ``trainer.objectives``).
- :mod:`trainer.verl.ppo` — :class:`~trainer.verl.ppo.PoolPPOTrainer` is veRL's
  separation-style ``SeparateRayPPOTrainer`` with its generation step replaced by the leased
  batch. Everything after that is veRL's own step: the actor recomputes the current policy's
  log-probs, the driver computes advantages, and veRL's actor update runs its PPO loss
  (``ppo_loss`` with the ``vanilla`` clipped surrogate, our ε_low/ε_high/dual clip and loss
  aggregation) on FSDP, in :class:`~trainer.verl.ppo.PoolActorWorker`.
- :mod:`trainer.verl.topk_loss` — top-k OPD (``opd_topk``) goes through veRL's top-k
  distillation hook: the batch carries the teacher's top-k in veRL's
  ``teacher_ids``/``teacher_logprobs`` layout, and the actor's loss function is
  :func:`~trainer.verl.topk_loss.topk_opd_loss`, which the FSDP engine hands the logits (it
  needs them: not with veRL's fused kernels, which ``build_config`` refuses with it).
- :mod:`trainer.verl.config` — :func:`~trainer.verl.config.build_config`: veRL's own
  ``ppo_trainer`` Hydra config with our settings.
- :mod:`trainer.verl.weights` — the weight push:
  :class:`~trainer.verl.weights.PoolCheckpointEngine` is a checkpoint engine registered with
  veRL's ``CheckpointEngineRegistry`` as ``"nextstate"``; instead of streaming weights into a
  rollout engine veRL started, it writes them — the LoRA adapter in PEFT layout, or the full
  model in Hugging Face layout — to a new directory.
  :class:`~trainer.verl.weights.PoolCheckpointManager` (the trainer's ``checkpoint_manager``,
  loadable through ``rollout.checkpoint_manager_class``) then hot-loads that directory into the
  serving vLLM through ``publishing.publish``, the same policy-version bookkeeping the local
  backend uses.
- :mod:`trainer.verl.backend` — :class:`~trainer.verl.backend.VerlTrainer`, the backend behind
  ``LocalTrainer``'s calls, and :func:`~trainer.verl.backend.train_verl`, ``nextstate train
  --backend verl``.

The batch maths is the local backend's (``trainer.local``) to the token: the same samples
give the same tensors, advantages and loss (tests/trainer/test_verl_backend.py, on the CPU). What
needs a GPU is only the Ray workers (veRL places them on GPU bundles).

veRL pins ``transformers<5.11`` and vLLM needs ``>=5.16``: the trainer runs from the ``train``
extra's environment, vLLM from its own (docs/trainer-verl.md).
"""
