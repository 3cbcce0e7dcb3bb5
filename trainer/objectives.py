"""Training objectives: advantages and the PPO-clip loss, on top of veRL's ``core_algos``.

Everything here is a plain function over tensors of shape ``(batch, response_len)`` plus a
``response_mask`` of the same shape (1 on the reply tokens that are trained on, 0 on padding
and on tokens that are masked out). Nothing here knows about the pool, the model or the
backend: the caller turns rows into tensors, computes log-probabilities, and hands them in.

Objectives (docs/design.md, "Objectives"), per response token a_t of a turn:

- **Binary RL** (``objective="rl"``): the reward standardized within its GRPO group when
  samples carry a task group id (veRL's
  :func:`~verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`); samples without one
  (online: all of them) are standardized within the batch (``rl_baseline="batch"``, the
  default: the batch is one more GRPO group, so a batch of equal rewards gives A = 0), or get
  A = r on every response token (``rl_baseline="none"``).
- **Hindsight OPD** (``objective="opd"``): A_t = clip(log π_teacher(a_t | s + hint) −
  log π_θ(a_t | s), ±opd_clip); the student log-prob is detached, so the advantage is a
  constant for the surrogate.
- **Combined** (``objective="combined"``): A_t = w_rl · A_rl + w_opd · A_opd.
- **Top-k OPD** (``opd_topk``, under ``"opd"`` or ``"combined"``): on samples whose teacher pass
  kept its top-k tokens per position, the sampled-token OPD advantage is replaced by a loss term
  w_opd · agg(KL(q ‖ p)), the reverse KL between the student's and the teacher's k+1-way
  distributions at each response position: the teacher's k most likely tokens plus the tail
  (everything else), q_i = π_θ(v_i | s, a_<t), q_tail = 1 − Σ q_i, likewise p under s + hint
  (:func:`topk_opd_kl`). Its gradient is −Σ_i q_i (log p_i − log q_i) ∇log q_i (Σ_i q_i ∇log q_i = 0
  over a whole distribution): the sampled-token OPD advantage's policy gradient, averaged over
  the k+1 outcomes exactly instead of estimated from the one sampled token.

All three are optimised with the PPO clipped surrogate (veRL's
:func:`~verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`) with ratio
π_θ / π_behaviour, where π_behaviour is the log-prob captured from vLLM at sampling time
(``old_log_prob``), asymmetric clip ε_low = 0.2, ε_high = 0.28 and veRL's dual-clip bound
(ratio ≤ ``clip_ratio_c`` for negative advantages). An optional k3 KL to the base policy
(veRL's ``"low_var_kl"``) is added as ``kl_coef · agg(k3)``; the aggregation
(``loss_agg_mode``) is any of veRL's modes, applied to both terms.

Rewards: :func:`rewards_for_batch` turns turn-level judgements into one scalar per sample: the
turn's process reward r, or — for sessions with an outcome O — the integrated reward
R_t = O + (1/m) Σ_i r_t^(i), standardized per step index across the batch
(:func:`standardize_per_step`).

Samples without teacher log-probs (no hint, or the teacher call failed) get an OPD term of 0:
under ``"opd"`` their advantage is 0 on every token (they still count in token-mean
denominators and in the KL term), under ``"combined"`` they keep only ``w_rl · A_rl``.

The three advantage estimators are registered in veRL's registry
(``core_algos.register_adv_est``) as ``"nextstate_binary"``, ``"nextstate_opd"`` and
``"nextstate_combined"``; importing or reloading this module twice is safe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo import core_algos as ca
from verl.utils import torch_functional as verl_F

from trainer.config import (  # the objectives' names and their configuration
    ADV_BINARY,
    ADV_COMBINED,
    ADV_ESTIMATOR_FOR_OBJECTIVE,
    ADV_OPD,
    LOSS_AGG_MODES,
    Objective,
    ObjectiveConfig,
)

__all__ = [
    "ADV_BINARY",
    "ADV_COMBINED",
    "ADV_ESTIMATOR_FOR_OBJECTIVE",
    "ADV_OPD",
    "LOSS_AGG_MODES",
    "Objective",
    "ObjectiveConfig",
    "actor_config",
    "compute_advantages",
    "compute_binary_advantage",
    "compute_combined_advantage",
    "compute_loss",
    "compute_opd_advantage",
    "kl_to_base",
    "masked_mean",
    "rewards_for_batch",
    "sample_rewards",
    "scores_to_token_rewards",
    "standardize_per_step",
    "topk_opd_kl",
]

def _as_objective_config(config: Any) -> ObjectiveConfig:
    """Accept an ObjectiveConfig, None (defaults) or any config object veRL hands an estimator
    (e.g. its ``AlgoConfig``): fields it has with our names are used, the rest default."""
    if config is None:
        return ObjectiveConfig()
    if isinstance(config, ObjectiveConfig):
        return config
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ObjectiveConfig):
        try:
            value = getattr(config, f.name, None)
            if value is None and hasattr(config, "get"):
                value = config.get(f.name)
        except Exception:  # noqa: BLE001 - foreign config types (struct DictConfig ...): use defaults
            value = None
        if value is not None:
            values[f.name] = value
    if "grpo_norm_by_std" not in values:
        norm = getattr(config, "norm_adv_by_std_in_grpo", None)
        if norm is not None:
            values["grpo_norm_by_std"] = bool(norm)
    return ObjectiveConfig(**values)


# ----------------------------------------------------------------------------------- helpers


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is set (0 when nothing is set)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place one scalar per sample on its last response token (veRL's convention for
    ``token_level_rewards``): ``(batch,) -> (batch, response_len)``.

    Outcome estimators sum this over the response, so the sum of each row is its score; a row
    with no response tokens gets all zeros.
    """
    mask = response_mask.to(torch.bool)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=scores.device)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(torch.float32)[rows]
    return out


def standardize_per_step(values: torch.Tensor, step_index: torch.Tensor | Sequence[int],
                         eps: float = 1e-6) -> torch.Tensor:
    """Standardize ``values`` (``(batch,)``) within each step index across the batch.

    Every sample with step index k gets ``(v − mean_k) / (std_k + eps)``, where mean_k and the
    (unbiased, as in veRL's GRPO) std_k are over the samples with step index k. A step index
    with a single sample has no spread: its std counts as 0, so that sample is only centred,
    which makes it exactly 0. Likewise, a step whose samples are all equal gives 0s.
    """
    values = values.to(torch.float32)
    steps = torch.as_tensor(step_index, device=values.device)
    if steps.shape != values.shape:
        raise ValueError(f"step_index shape {tuple(steps.shape)} != values shape {tuple(values.shape)}")
    out = torch.empty_like(values)
    for step in torch.unique(steps):
        sel = steps == step
        group = values[sel]
        mean = group.mean()
        std = group.std() if group.numel() > 1 else torch.zeros((), dtype=values.dtype, device=values.device)
        out[sel] = (group - mean) / (std + eps)
    return out


def rewards_for_batch(
    r: torch.Tensor,
    *,
    outcome: torch.Tensor | None = None,
    has_outcome: torch.Tensor | None = None,
    vote_mean: torch.Tensor | None = None,
    step_index: torch.Tensor | Sequence[int] | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One scalar reward per sample (``(batch,)``) from turn-level judgements.

    Args:
        r: the turn's process reward (majority of its PRM votes, +1 / 0 / −1, or a label's
            override). This is the binary reward used for samples without an outcome.
        outcome: the session's terminal reward O per sample (any value where there is none).
        has_outcome: which samples' sessions have an outcome; default: all of them when
            ``outcome`` is given.
        vote_mean: (1/m) Σ_i r_t^(i), the mean of the turn's m votes; defaults to ``r``.
        step_index: the turn's position in its session; required when outcomes are given.
        eps: added to the per-step std.

    Returns:
        ``r`` for samples without an outcome; for samples with one, the integrated reward
        R_t = O + vote_mean, standardized per step index among those samples
        (:func:`standardize_per_step`; a step index with one such sample gives 0).
    """
    rewards = r.to(torch.float32).clone()
    if outcome is None:
        return rewards
    if step_index is None:
        raise ValueError("step_index is required with outcomes (the integrated reward is standardized per step)")
    with_outcome = (torch.ones_like(rewards, dtype=torch.bool) if has_outcome is None
                    else has_outcome.to(torch.bool))
    if not bool(with_outcome.any()):
        return rewards
    votes = rewards if vote_mean is None else vote_mean.to(torch.float32)
    integrated = outcome.to(torch.float32) + votes
    steps = torch.as_tensor(step_index, device=rewards.device)
    rewards[with_outcome] = standardize_per_step(integrated[with_outcome], steps[with_outcome], eps=eps)
    return rewards


def sample_rewards(samples: Sequence[Any]) -> torch.Tensor:
    """:func:`rewards_for_batch` for pool samples (``trainer.samples.Sample``): the turn's r,
    or for sessions with an outcome the integrated reward R_t = O + mean votes (already summed
    in the pool as ``integrated_reward``) standardized per step index. Both backends use it."""
    r = torch.tensor([s.reward if s.reward is not None else 0.0 for s in samples])
    integrated = [s.integrated_reward for s in samples]
    if all(x is None for x in integrated):
        return rewards_for_batch(r)
    return rewards_for_batch(
        r, outcome=torch.tensor([x if x is not None else 0.0 for x in integrated]),
        has_outcome=torch.tensor([x is not None for x in integrated]), vote_mean=torch.zeros_like(r),
        step_index=[s.step_index for s in samples])


def _group_index(index: Any, batch: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Normalise group ids: None / NaN entries become unique singleton ids. Returns the ids as
    an object array and, per sample, the size of its group; None when no sample has a group."""
    if index is None:
        return None
    ids = list(np.asarray(index, dtype=object).reshape(-1))
    if len(ids) != batch:
        raise ValueError(f"index has {len(ids)} entries for a batch of {batch}")

    def missing(v: Any) -> bool:
        return v is None or (isinstance(v, float) and np.isnan(v))

    if all(missing(v) for v in ids):
        return None
    normalised = np.empty(batch, dtype=object)
    for i, v in enumerate(ids):
        normalised[i] = ("__nextstate_singleton__", i) if missing(v) else v
    counts: dict[Any, int] = {}
    for v in normalised:
        counts[v] = counts.get(v, 0) + 1
    sizes = np.array([counts[v] for v in normalised])
    return normalised, sizes


# -------------------------------------------------------------------------------- advantages


#: the group id that samples outside any GRPO group share under ``rl_baseline="batch"``
_BATCH_GROUP = ("__nextstate_batch__",)


def compute_binary_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | Sequence[Any] | None = None,
    config: ObjectiveConfig | Any | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary RL advantage (registered as ``"nextstate_binary"``).

    The sample's reward is ``token_level_rewards.sum(-1)`` (see :func:`scores_to_token_rewards`).
    Samples sharing a group id with at least one other sample of the batch (``config.grpo``
    on) are standardized within their group by veRL's ``compute_grpo_outcome_advantage``:
    A = (r − mean_g) / (std_g + ε) (unbiased std; only centred with ``grpo_norm_by_std`` off).

    The other samples — all of them online, where turns have no groups — get the baseline
    ``config.rl_baseline``: ``"batch"`` puts them in one more group, the batch's, and
    standardizes them the same way, so a batch whose rewards are all equal (every reply
    failed) gives A = 0, and a single such sample keeps A = r (veRL's rule for a group of
    one); ``"none"`` keeps A = r. The advantage is the same on every response token and 0
    elsewhere.

    Returns ``(advantages, returns)``, both ``(batch, response_len)``, like veRL's estimators.
    """
    cfg = _as_objective_config(config)
    mask = response_mask.to(torch.float32)
    scores = token_level_rewards.to(torch.float32).sum(dim=-1)
    batch = scores.shape[0]
    advantages = scores.unsqueeze(-1) * mask
    groups = _group_index(index, batch) if cfg.grpo else None
    if groups is None:
        ids, sizes = np.empty(batch, dtype=object), np.ones(batch, dtype=int)
        for i in range(batch):
            ids[i] = ("__nextstate_singleton__", i)
    else:
        ids, sizes = groups
    grouped = sizes > 1
    if cfg.rl_baseline == "batch":
        ids = ids.copy()
        for i in np.flatnonzero(~grouped):
            ids[i] = _BATCH_GROUP
        grouped = np.ones(batch, dtype=bool)
    if grouped.any():
        # in float64: a group's mean of equal fp32 rewards is then exactly that reward, so equal
        # rewards give A = 0 (in fp32 the mean is off by an ulp, which (std + eps) blows up)
        grpo, _ = ca.compute_grpo_outcome_advantage(
            token_level_rewards=token_level_rewards.to(torch.float64),
            response_mask=mask.to(torch.float64),
            index=ids,
            epsilon=cfg.grpo_eps,
            norm_adv_by_std_in_grpo=cfg.grpo_norm_by_std,
        )
        take = torch.as_tensor(grouped, device=advantages.device).unsqueeze(-1)
        advantages = torch.where(take, grpo.to(advantages.dtype), advantages)
    return advantages, advantages


def compute_opd_advantage(
    token_level_rewards: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    index: np.ndarray | Sequence[Any] | None = None,
    config: ObjectiveConfig | Any | None = None,
    *,
    teacher_log_prob: torch.Tensor | None = None,
    student_log_prob: torch.Tensor | None = None,
    teacher_mask: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hindsight OPD advantage (registered as ``"nextstate_opd"``).

    A_t = clip(log π_teacher(a_t) − log π_θ(a_t), −opd_clip, +opd_clip) on response tokens,
    with both log-probs detached (the advantage is a constant of the surrogate).

    Args:
        token_level_rewards: unused (kept for veRL's estimator signature).
        response_mask: ``(batch, response_len)``.
        index: unused.
        config: supplies ``opd_clip``.
        teacher_log_prob: ``(batch, response_len)`` log-probs of the sampled tokens under the
            hinted context; None means no sample has any (all advantages 0).
        student_log_prob: ``(batch, response_len)`` log-probs under the current policy.
        teacher_mask: which samples (``(batch,)``) or tokens (``(batch, response_len)``) have
            teacher log-probs; default all. Non-finite teacher entries count as missing too.
            Where missing, the OPD advantage is 0.
    """
    if response_mask is None:
        raise ValueError("response_mask is required")
    cfg = _as_objective_config(config)
    mask = response_mask.to(torch.float32)
    if teacher_log_prob is None:
        zeros = torch.zeros_like(mask)
        return zeros, zeros
    if student_log_prob is None:
        raise ValueError("student_log_prob is required with teacher_log_prob")
    teacher = teacher_log_prob.detach().to(torch.float32)
    student = student_log_prob.detach().to(torch.float32)
    present = torch.isfinite(teacher) & response_mask.to(torch.bool)
    if teacher_mask is not None:
        tm = teacher_mask.to(torch.bool)
        present = present & (tm.unsqueeze(-1) if tm.dim() == 1 else tm)
    gap = torch.clamp(teacher - student, min=-cfg.opd_clip, max=cfg.opd_clip)
    advantages = torch.where(present, gap, torch.zeros_like(gap)) * mask
    return advantages, advantages


def compute_combined_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | Sequence[Any] | None = None,
    config: ObjectiveConfig | Any | None = None,
    *,
    teacher_log_prob: torch.Tensor | None = None,
    student_log_prob: torch.Tensor | None = None,
    teacher_mask: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combined advantage (registered as ``"nextstate_combined"``):
    A_t = w_rl · A_rl + w_opd · A_opd, with A_rl from :func:`compute_binary_advantage`
    (GRPO when group ids are given) and A_opd from :func:`compute_opd_advantage` (0 for
    samples or tokens without teacher log-probs)."""
    cfg = _as_objective_config(config)
    rl, _ = compute_binary_advantage(token_level_rewards, response_mask, index=index, config=cfg)
    opd, _ = compute_opd_advantage(None, response_mask, config=cfg, teacher_log_prob=teacher_log_prob,
                                   student_log_prob=student_log_prob, teacher_mask=teacher_mask)
    advantages = cfg.w_rl * rl + cfg.w_opd * opd
    return advantages, advantages


def compute_advantages(
    cfg: ObjectiveConfig,
    *,
    response_mask: torch.Tensor,
    token_level_rewards: torch.Tensor | None = None,
    index: np.ndarray | Sequence[Any] | None = None,
    teacher_log_prob: torch.Tensor | None = None,
    student_log_prob: torch.Tensor | None = None,
    teacher_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``(batch, response_len)`` for ``cfg.objective``, through veRL's registry
    (``core_algos.get_adv_estimator_fn``). ``token_level_rewards`` is required for ``"rl"`` and
    ``"combined"``; the teacher/student log-probs are used by ``"opd"`` and ``"combined"``."""
    name = ADV_ESTIMATOR_FOR_OBJECTIVE[cfg.objective]
    if cfg.objective != "opd" and token_level_rewards is None:
        raise ValueError(f"objective {cfg.objective!r} needs token_level_rewards")
    fn = ca.get_adv_estimator_fn(name)
    advantages, _ = fn(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index,
                       config=cfg, teacher_log_prob=teacher_log_prob, student_log_prob=student_log_prob,
                       teacher_mask=teacher_mask)
    return advantages


def _register_adv_est(name: str, fn: Callable[..., Any]) -> None:
    """``ca.register_adv_est(name)(fn)``, idempotent across imports and reloads: an earlier
    registration of the same function (same module and qualified name) is replaced, while a
    foreign function under the same name still raises, as veRL does."""
    existing = ca.ADV_ESTIMATOR_REGISTRY.get(name)
    if existing is not None and existing is not fn:
        same = (getattr(existing, "__module__", None) == fn.__module__
                and getattr(existing, "__qualname__", None) == fn.__qualname__)
        if same:
            del ca.ADV_ESTIMATOR_REGISTRY[name]
    ca.register_adv_est(name)(fn)


_register_adv_est(ADV_BINARY, compute_binary_advantage)
_register_adv_est(ADV_OPD, compute_opd_advantage)
_register_adv_est(ADV_COMBINED, compute_combined_advantage)


# ------------------------------------------------------------------------------------- loss


def _log1mexp(x: torch.Tensor, eps: float) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0, with 1 − exp(x) kept ≥ *eps* (a top-k mass of ~1)."""
    x = x.clamp(max=math.log1p(-eps))
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_opd_kl(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, valid: torch.Tensor | None = None,
                *, tail: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per position, KL(q ‖ p) between the student's and the teacher's k+1-way distributions.

    Args:
        student_log_prob: ``(..., K)`` log π_θ of the teacher's top-k tokens at each position
            (with grad).
        teacher_log_prob: ``(..., K)`` the teacher's log-probs of the same tokens (detached).
        valid: ``(..., K)``, which of the K entries are tokens (fewer than K where a sample's
            teacher kept fewer); default all.
        tail: add the tail outcome, log q_tail = log(1 − Σ q_i) (and p's), each mass kept ≥ *eps*;
            without it both are renormalised over the k tokens (then k = 1 gives 0: one outcome).

    Returns:
        ``(...)``: Σ_i q_i (log q_i − log p_i) [+ q_tail (log q_tail − log p_tail)], ≥ 0.
    """
    s = student_log_prob.to(torch.float32)
    t = teacher_log_prob.detach().to(torch.float32)
    ok = torch.ones_like(s, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    # absent entries: a log-prob whose exp is 0 in fp32 but finite (no inf − inf, no NaN gradients)
    absent = torch.full_like(s, -1e4)
    s_in, t_in = torch.where(ok, s, absent), torch.where(ok, t, absent)
    if not tail:
        s_in = s_in - torch.logsumexp(s_in, -1, keepdim=True)
        t_in = t_in - torch.logsumexp(t_in, -1, keepdim=True)
    terms = torch.where(ok, torch.exp(s_in) * (s_in - t_in), torch.zeros_like(s))
    kl = terms.sum(-1)
    if tail:
        log_q_tail = _log1mexp(torch.logsumexp(s_in, -1), eps)
        log_p_tail = _log1mexp(torch.logsumexp(t_in, -1), eps)
        kl = kl + torch.exp(log_q_tail) * (log_q_tail - log_p_tail)
    return torch.where(ok.any(-1), kl, torch.zeros_like(kl))


def actor_config(cfg: ObjectiveConfig, global_batch_info: dict[str, Any] | None = None) -> Any:
    """The veRL ``ActorConfig`` its policy losses read: clip ratios, dual-clip bound, loss
    aggregation and ``global_batch_info`` (dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor: pass them when a global batch is split across ranks or micro-batches,
    so the aggregated loss is normalised over the whole batch; empty means this batch alone).
    """
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=cfg.clip_low,
        clip_ratio_low=cfg.clip_low,
        clip_ratio_high=cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        use_kl_loss=cfg.kl_coef > 0,
        kl_loss_coef=cfg.kl_coef,
        kl_loss_type=cfg.kl_type,
        global_batch_info=dict(global_batch_info or {}),
    )


def kl_to_base(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate to the base policy (veRL ``kl_penalty``). For ``"low_var_kl"``
    (k3): exp(ref − logp) − (ref − logp) − 1, with veRL's clamps (|ref − logp| ≤ 20, ≤ 10)."""
    return ca.kl_penalty(log_prob, ref_log_prob, kl_type)


def policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """veRL's ``compute_policy_loss_vanilla`` (0.9.1) step by step, with its three metrics
    returned as detached tensors instead of ``.item()`` floats: each ``.item()`` makes the host
    wait for the GPU, three times per micro-batch. Same arithmetic (``tests/trainer/test_objectives.py``
    compares the two)."""
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(),
                                           response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = ca.agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                          **config.global_batch_info)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.detach(), "actor/ppo_kl": ppo_kl.detach(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach()}


def compute_loss(
    cfg: ObjectiveConfig,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_prob: torch.Tensor | None = None,
    *,
    global_batch_info: dict[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    tensor_metrics: bool = False,
    topk_log_prob: torch.Tensor | None = None,
    topk_teacher_log_prob: torch.Tensor | None = None,
    topk_valid: torch.Tensor | None = None,
    topk_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO clipped surrogate (+ optional KL to the base policy), aggregated by ``cfg.loss_agg_mode``.

    Per token, with ratio ρ = exp(log_prob − old_log_prob) (old_log_prob: the behaviour
    policy's captured log-probs) and A the advantage:
    L = max(−A·ρ, −A·clip(ρ, 1 − clip_low, 1 + clip_high)), and for A < 0 additionally
    L = min(L, −A·clip_ratio_c) (veRL's dual clip). The loss is
    ``agg(L) + kl_coef · agg(kl_to_base(log_prob, ref_log_prob))``.

    Args:
        cfg: the objective configuration.
        log_prob: ``(batch, response_len)`` log-probs of the sampled tokens under π_θ (with grad).
        old_log_prob: same shape, behaviour-policy log-probs (no grad needed).
        advantages: same shape, from :func:`compute_advantages`.
        response_mask: same shape, 1 on trained tokens.
        ref_log_prob: base-policy log-probs; required when ``cfg.kl_coef > 0``, else only
            reported as the ``kl`` metric.
        global_batch_info: see :func:`actor_config`.
        rollout_is_weights: optional per-token importance weights (veRL rollout correction).
        tensor_metrics: return the metrics as detached 0-dim tensors on the loss's device, so
            that nothing here waits for the GPU (the vanilla loss then runs as
            :func:`policy_loss_vanilla`); the local trainer reads them once per step.
        topk_log_prob: with ``cfg.opd_topk``, ``(batch, response_len, K)`` log π_θ of the
            teacher's top-k tokens (with grad); ``topk_teacher_log_prob`` the teacher's, same
            shape; ``topk_valid`` which entries are tokens; ``topk_mask`` ``(batch,
            response_len)``, the positions that have them (the response tokens of samples with
            top-k teacher data). Adds ``w_opd · agg(topk_opd_kl)`` over ``topk_mask``.

    Returns:
        ``(loss, metrics)``; metrics are floats: ``loss``, ``pg_loss``, ``pg_clipfrac`` (share
        of tokens where the clip is active), ``pg_clipfrac_lower`` (dual clip active),
        ``ppo_kl`` (mean of old − new log-prob), ``adv_mean`` (masked mean advantage), and
        with ``ref_log_prob`` also ``kl`` (masked mean k3) and ``kl_loss`` (aggregated); with
        top-k OPD ``topk_kl`` (the aggregated top-k term, before w_opd).
    """
    if cfg.kl_coef > 0 and ref_log_prob is None:
        raise ValueError("kl_coef > 0 needs ref_log_prob (the base policy's log-probs)")
    actor_cfg = actor_config(cfg, global_batch_info)
    mask = response_mask.to(torch.bool)
    policy_loss_fn = ca.get_policy_loss_fn(cfg.policy_loss)
    if tensor_metrics and cfg.policy_loss == "vanilla":
        policy_loss_fn = policy_loss_vanilla
    pg_loss, pg_metrics = policy_loss_fn(
        old_log_prob=old_log_prob.detach(),
        log_prob=log_prob,
        advantages=advantages.detach(),
        response_mask=mask,
        loss_agg_mode=cfg.loss_agg_mode,
        config=actor_cfg,
        rollout_is_weights=rollout_is_weights,
    )
    loss = pg_loss
    if tensor_metrics:
        def out(v: Any) -> Any:
            return v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=log_prob.device)
    else:
        def out(v: Any) -> Any:
            return float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
    metrics: dict[str, Any] = {k.removeprefix("actor/"): out(v) for k, v in pg_metrics.items()}
    metrics["pg_loss"] = out(pg_loss)
    metrics["adv_mean"] = out(masked_mean(advantages.detach().to(torch.float32), mask))
    if ref_log_prob is not None:
        kld = kl_to_base(log_prob, ref_log_prob.detach(), cfg.kl_type)
        kl_loss = ca.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode,
                              **actor_cfg.global_batch_info)
        metrics["kl"] = out(masked_mean(kld.detach(), mask))
        metrics["kl_loss"] = out(kl_loss)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
    if cfg.opd_topk and topk_log_prob is not None:
        if topk_teacher_log_prob is None or topk_mask is None:
            raise ValueError("top-k OPD needs the teacher's top-k log-probs and their positions (topk_mask)")
        topk = ca.agg_loss(loss_mat=topk_opd_kl(topk_log_prob, topk_teacher_log_prob, topk_valid,
                                                tail=cfg.opd_topk_tail),
                           loss_mask=topk_mask.to(torch.bool), loss_agg_mode=cfg.loss_agg_mode,
                           **actor_cfg.global_batch_info)
        metrics["topk_kl"] = out(topk)
        loss = loss + cfg.w_opd * topk
    metrics["loss"] = out(loss)
    return loss, metrics
