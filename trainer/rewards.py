"""Rewards as the objectives take them: one scalar per sample from turn-level judgements, and
that scalar placed on a response's last token (veRL's ``token_level_rewards``).

A sample's reward is the turn's process reward r, or — for sessions with an outcome O — the
integrated reward R_t = O + (1/m) Σ_i r_t^(i), standardized per step index across the batch
(:func:`standardize_per_step`). Both backends use :func:`sample_rewards`.

With ``by_group`` (``ObjectiveConfig.integrated_norm="group"``) a sample of a GRPO group keeps its
R_t as it is: the group's baseline is then the only one (``objectives.compute_binary_advantage``),
so a group whose episodes all failed (or all passed) gets A = 0 on every turn whatever step the
turns are at. Standardizing per step across the batch first gives the turns of such a group
different values wherever the batch's step indices differ in their mix of successes (episodes of
different lengths, or a batch holding turn 1 of some episodes and turn 2 of others), and the group's
standardization then blows those differences up to advantages of about ±1: noise on turns that
carry no signal.

``integrated_norm="dense"`` (:func:`vote_credit`) keeps the outcome's signal and the votes'
apart, so that votes neither become the whole update of a group with no outcome signal (its
turns standardized on their votes alone) nor blur a group with one.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch


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


def sample_rewards(samples: Sequence[Any], *, by_group: bool = False) -> torch.Tensor:
    """:func:`rewards_for_batch` for pool samples (``trainer.samples.Sample``): the turn's r,
    or for sessions with an outcome the integrated reward R_t = O + mean votes (already summed
    in the pool as ``integrated_reward``) standardized per step index. Both backends use it.

    *by_group*: samples with a ``group_id`` keep their integrated reward unstandardized (their
    group's GRPO baseline standardizes it); only those without one are standardized per step."""
    r = torch.tensor([s.reward if s.reward is not None else 0.0 for s in samples])
    integrated = [s.integrated_reward for s in samples]
    if all(x is None for x in integrated):
        return rewards_for_batch(r)
    raw = [by_group and x is not None and s.group_id is not None for s, x in zip(samples, integrated, strict=True)]
    out = rewards_for_batch(
        r, outcome=torch.tensor([x if x is not None else 0.0 for x in integrated]),
        has_outcome=torch.tensor([x is not None and not w for x, w in zip(integrated, raw, strict=True)]),
        vote_mean=torch.zeros_like(r), step_index=[s.step_index for s in samples])
    for i, w in enumerate(raw):
        if w:
            out[i] = float(integrated[i])
    return out



def _outcome_group(s: Any) -> bool:
    return s.group_id is not None and s.integrated_reward is not None


def without_votes(s: Any) -> Any:
    """A sample of a GRPO group with an outcome as its outcome alone (R_t = O, no vote); any other
    sample as it is."""
    if not _outcome_group(s):
        return s
    vote = float(s.reward) if s.reward is not None else 0.0
    return dataclasses.replace(s, reward=0.0, integrated_reward=float(s.integrated_reward) - vote)


def vote_credit(samples: Sequence[Any], vote_weight: float) -> list[float | None]:
    """``integrated_norm="dense"``'s second term: per sample of a GRPO group (two or more samples)
    with an outcome, *vote_weight* · (v_t − the group's mean vote), v_t its vote r_t (0 when
    unjudged); None for the other samples, a group of one among them (it has nothing to compare
    with). Its first term is the outcome's GRPO advantage, of :func:`without_votes` samples.
    The credit is bounded by *vote_weight* on the very turns the votes judged, and sums to 0 in
    each group."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if _outcome_group(s):
            groups[s.group_id].append(i)
    votes = [float(s.reward) if s.reward is not None else 0.0 for s in samples]
    out: list[float | None] = [None] * len(samples)
    for members in groups.values():
        if len(members) > 1:
            mean = sum(votes[i] for i in members) / len(members)
            for i in members:
                out[i] = vote_weight * (votes[i] - mean)
    return out
