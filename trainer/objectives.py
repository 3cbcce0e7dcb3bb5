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

All three are optimised with the PPO clipped surrogate (veRL's
:func:`~verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`) with ratio
π_θ / π_behaviour, where π_behaviour is the log-prob captured from vLLM at sampling time
(``old_log_prob``), asymmetric clip ε_low = 0.2, ε_high = 0.28 and veRL's dual-clip bound
(ratio ≤ ``clip_ratio_c`` for negative advantages).

Loss terms beside the surrogate are registered in :data:`LOSS_TERMS` (``@register_loss_term``,
as veRL registers its policy losses); each gives a coefficient, a per-token loss and the
positions it counts on, aggregated by ``loss_agg_mode`` like the surrogate:

- ``"kl"``, the anchor to the base policy: ``kl_coef · agg(kl_to_base)``, veRL's ``kl_penalty``
  of ``kl_type`` (``"low_var_kl"``, k3, by default) on the sampled tokens, under any objective.
- ``"topk_kl"``, **top-k OPD** (``opd_topk``, under ``"opd"`` or ``"combined"``): on samples whose
  teacher pass kept its top-k tokens per position, the sampled-token OPD advantage is replaced
  by w_opd · agg(KL(q ‖ p)), the reverse KL between the student's and the teacher's k+1-way
  distributions at each response position: the teacher's k most likely tokens plus the tail
  (everything else), q_i = π_θ(v_i | s, a_<t), q_tail = 1 − Σ q_i, likewise p under s + hint
  (:func:`topk_opd_kl`). Its gradient is −Σ_i q_i (log p_i − log q_i) ∇log q_i (Σ_i q_i ∇log q_i = 0
  over a whole distribution): the sampled-token OPD advantage's policy gradient, averaged over
  the k+1 outcomes exactly instead of estimated from the one sampled token. The teacher's k+1-way
  distribution may be tempered (``opd_topk_temperature`` > 1 spreads its mass, so the student is
  not pulled into the teacher's mode) and the tail's term weighted (``opd_topk_tail_weight``).

Rewards (:mod:`trainer.rewards`, re-exported here): one scalar per sample, the turn's process
reward or the integrated reward of a session with an outcome, standardized per step index.

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
from trainer.rewards import rewards_for_batch, sample_rewards, scores_to_token_rewards, standardize_per_step

__all__ = [
    "ADV_BINARY",
    "ADV_COMBINED",
    "ADV_ESTIMATOR_FOR_OBJECTIVE",
    "ADV_OPD",
    "LOSS_AGG_MODES",
    "LOSS_TERMS",
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
    "register_loss_term",
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


def positions_from(mask: torch.Tensor, start: int) -> torch.Tensor:
    """``mask`` (``(n, width)``, response-aligned) where the response position is ≥ *start*, else 0:
    where top-k OPD applies under ``ObjectiveConfig.opd_topk_from``."""
    if start <= 0:
        return mask
    return mask * (torch.arange(mask.shape[-1], device=mask.device) >= start).to(mask.dtype)


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
                *, tail: bool = True, eps: float = 1e-6, temperature: float = 1.0,
                tail_weight: float = 1.0) -> torch.Tensor:
    """Per position, KL(q ‖ p) between the student's and the teacher's k+1-way distributions.

    Args:
        student_log_prob: ``(..., K)`` log π_θ of the teacher's top-k tokens at each position
            (with grad).
        teacher_log_prob: ``(..., K)`` the teacher's log-probs of the same tokens (detached).
        valid: ``(..., K)``, which of the K entries are tokens (fewer than K where a sample's
            teacher kept fewer); default all.
        tail: add the tail outcome, log q_tail = log(1 − Σ q_i) (and p's), each mass kept ≥ *eps*;
            without it both are renormalised over the k tokens (then k = 1 gives 0: one outcome).
        temperature: the teacher's k+1-way (k-way without the tail) distribution tempered,
            p_i ∝ p_i^(1/T), renormalised over its outcomes; 1 leaves it as it is.
        tail_weight: the weight of the tail's term; 1 is the KL.

    Returns:
        ``(...)``: Σ_i q_i (log q_i − log p_i) [+ tail_weight · q_tail (log q_tail − log p_tail)],
        ≥ 0 with tail_weight 1.
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
    log_q_tail = _log1mexp(torch.logsumexp(s_in, -1), eps) if tail else None
    log_p_tail = _log1mexp(torch.logsumexp(t_in, -1), eps) if tail else None
    if temperature != 1.0:
        outcomes = torch.cat([t_in, log_p_tail[..., None]], -1) if tail else t_in
        tempered = torch.where(torch.cat([ok, torch.ones_like(ok[..., :1])], -1) if tail else ok,
                               outcomes / temperature, torch.full_like(outcomes, -1e4))
        tempered = tempered - torch.logsumexp(tempered, -1, keepdim=True)
        t_in, log_p_tail = (tempered[..., :-1], tempered[..., -1]) if tail else (tempered, None)
    terms = torch.where(ok, torch.exp(s_in) * (s_in - t_in), torch.zeros_like(s))
    kl = terms.sum(-1)
    if tail:
        kl = kl + tail_weight * torch.exp(log_q_tail) * (log_q_tail - log_p_tail)
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


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a loss term may read: the step's log-probs (``log_prob`` with grad), the response
    mask as bool, and what the caller passed of the base policy's and the teacher's top-k."""

    log_prob: torch.Tensor
    mask: torch.Tensor
    ref_log_prob: torch.Tensor | None = None
    topk_log_prob: torch.Tensor | None = None
    topk_teacher_log_prob: torch.Tensor | None = None
    topk_valid: torch.Tensor | None = None
    topk_mask: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One term beside the surrogate: ``coef · agg(loss_mat over mask)``; ``report`` are
    metrics of its own (detached tensors). A coefficient of 0 reports the term, adds nothing."""

    coef: float
    loss_mat: torch.Tensor
    mask: torch.Tensor
    report: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


#: name -> (config, inputs) -> LossTerm or None (the term does not apply to this batch)
LOSS_TERMS: dict[str, Callable[[ObjectiveConfig, LossInputs], LossTerm | None]] = {}


def register_loss_term(name: str) -> Callable[[Callable[..., LossTerm | None]], Callable[..., LossTerm | None]]:
    """Register a loss term under *name* (its aggregated value is the metric *name*); a later
    registration under the same name replaces the earlier one (a module reload)."""
    def decorate(fn: Callable[..., LossTerm | None]) -> Callable[..., LossTerm | None]:
        LOSS_TERMS[name] = fn
        return fn
    return decorate


@register_loss_term("kl_loss")
def kl_anchor_term(cfg: ObjectiveConfig, x: LossInputs) -> LossTerm | None:
    """The anchor to the base policy: kl_coef · :func:`kl_to_base` on the sampled tokens; with
    base log-probs and a coefficient of 0 only reported (``kl``: the masked mean estimate)."""
    if cfg.kl_coef > 0 and x.ref_log_prob is None:
        raise ValueError("kl_coef > 0 needs ref_log_prob (the base policy's log-probs)")
    if x.ref_log_prob is None:
        return None
    kld = kl_to_base(x.log_prob, x.ref_log_prob.detach(), cfg.kl_type)
    return LossTerm(cfg.kl_coef, kld, x.mask, {"kl": masked_mean(kld.detach(), x.mask)})


@register_loss_term("topk_kl")
def topk_opd_term(cfg: ObjectiveConfig, x: LossInputs) -> LossTerm | None:
    """Top-k OPD: w_opd · :func:`topk_opd_kl` over ``topk_mask`` (its metric is before w_opd)."""
    if not cfg.opd_topk or x.topk_log_prob is None:
        return None
    if x.topk_teacher_log_prob is None or x.topk_mask is None:
        raise ValueError("top-k OPD needs the teacher's top-k log-probs and their positions (topk_mask)")
    kl = topk_opd_kl(x.topk_log_prob, x.topk_teacher_log_prob, x.topk_valid, tail=cfg.opd_topk_tail,
                     temperature=cfg.opd_topk_temperature, tail_weight=cfg.opd_topk_tail_weight)
    return LossTerm(cfg.w_opd, kl, x.topk_mask.to(torch.bool))


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
    """PPO clipped surrogate plus the :data:`LOSS_TERMS`, aggregated by ``cfg.loss_agg_mode``.

    Per token, with ratio ρ = exp(log_prob − old_log_prob) (old_log_prob: the behaviour
    policy's captured log-probs) and A the advantage:
    L = max(−A·ρ, −A·clip(ρ, 1 − clip_low, 1 + clip_high)), and for A < 0 additionally
    L = min(L, −A·clip_ratio_c) (veRL's dual clip). The loss is ``agg(L) + Σ coef · agg(term)``.

    Args:
        log_prob: ``(batch, response_len)`` log-probs of the sampled tokens under π_θ (with grad);
            ``old_log_prob`` the behaviour policy's, ``advantages`` from
            :func:`compute_advantages`, ``response_mask`` 1 on trained tokens, all that shape.
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
            top-k teacher data).

    Returns:
        ``(loss, metrics)``; metrics are floats: ``loss``, ``pg_loss``, ``pg_clipfrac`` (share
        of tokens where the clip is active), ``pg_clipfrac_lower`` (dual clip active),
        ``ppo_kl`` (mean of old − new log-prob), ``adv_mean`` (masked mean advantage), and
        with ``ref_log_prob`` also ``kl`` (masked mean k3) and ``kl_loss`` (aggregated); with
        top-k OPD ``topk_kl`` (the aggregated top-k term, before w_opd).
    """
    actor_cfg = actor_config(cfg, global_batch_info)
    mask = response_mask.to(torch.bool)
    policy_loss_fn = ca.get_policy_loss_fn(cfg.policy_loss)
    if tensor_metrics and cfg.policy_loss == "vanilla":
        policy_loss_fn = policy_loss_vanilla
    loss, pg_metrics = policy_loss_fn(old_log_prob=old_log_prob.detach(), log_prob=log_prob,
                                      advantages=advantages.detach(), response_mask=mask,
                                      loss_agg_mode=cfg.loss_agg_mode, config=actor_cfg,
                                      rollout_is_weights=rollout_is_weights)
    metrics: dict[str, Any] = {k.removeprefix("actor/"): v for k, v in pg_metrics.items()}
    metrics |= {"pg_loss": loss, "adv_mean": masked_mean(advantages.detach().to(torch.float32), mask)}
    inputs = LossInputs(log_prob, mask, ref_log_prob, topk_log_prob, topk_teacher_log_prob, topk_valid, topk_mask)
    for name, term_fn in LOSS_TERMS.items():
        term = term_fn(cfg, inputs)
        if term is None:
            continue
        # a term over no position (a micro-batch without top-k samples, or replies shorter than
        # opd_topk_from) is 0 with a zero gradient, not 0 / 0 (decided on the device: no sync)
        empty = ~term.mask.to(torch.bool).any()
        value = ca.agg_loss(loss_mat=torch.where(empty, torch.zeros_like(term.loss_mat), term.loss_mat),
                            loss_mask=term.mask.to(torch.bool) | empty, loss_agg_mode=cfg.loss_agg_mode,
                            **actor_cfg.global_batch_info)
        metrics |= term.report | {name: value}
        if term.coef > 0:
            loss = loss + term.coef * value
    metrics["loss"] = loss
    if tensor_metrics:
        return loss, {k: v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=log_prob.device)
                      for k, v in metrics.items()}
    return loss, {k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}
