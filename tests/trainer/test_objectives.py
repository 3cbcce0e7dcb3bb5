"""Objectives: advantages and losses on hand-built tensors, against the design's formulas and
veRL's core_algos where they overlap. CPU only, no services."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
ca = pytest.importorskip("verl.trainer.ppo.core_algos")

from trainer import objectives as obj
from trainer.objectives import (
    ObjectiveConfig,
    compute_advantages,
    compute_binary_advantage,
    compute_combined_advantage,
    compute_loss,
    compute_opd_advantage,
    kl_to_base,
    rewards_for_batch,
    scores_to_token_rewards,
    standardize_per_step,
)

MASK = torch.tensor([[1, 1, 1, 0],
                     [1, 1, 0, 0],
                     [1, 1, 1, 1],
                     [1, 0, 0, 0]], dtype=torch.float32)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-6) -> bool:
    return torch.allclose(a.to(torch.float32), b.to(torch.float32), atol=atol)


# ------------------------------------------------------------------------------- config


def test_config_defaults_and_validation() -> None:
    cfg = ObjectiveConfig()
    assert (cfg.objective, cfg.w_rl, cfg.w_opd) == ("rl", 1.0, 1.0)
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28)
    assert cfg.kl_coef == 0.0 and cfg.kl_type == "low_var_kl" and cfg.loss_agg_mode == "token-mean"
    assert cfg.rl_baseline == "batch"
    for bad in ({"objective": "sft"}, {"loss_agg_mode": "mean"}, {"clip_ratio_c": 1.0},
                {"opd_clip": 0.0}, {"kl_coef": -1.0}, {"clip_low": 1.0}, {"rl_baseline": "ema"}):
        with pytest.raises(ValueError):
            ObjectiveConfig(**bad)


# ------------------------------------------------------------------------------ rewards


def test_scores_to_token_rewards_last_token() -> None:
    tlr = scores_to_token_rewards(torch.tensor([1.0, -1.0, 0.5, 2.0]), MASK)
    expected = torch.zeros(4, 4)
    expected[0, 2], expected[1, 1], expected[2, 3], expected[3, 0] = 1.0, -1.0, 0.5, 2.0
    assert close(tlr, expected)
    empty = scores_to_token_rewards(torch.tensor([3.0]), torch.zeros(1, 3))
    assert close(empty, torch.zeros(1, 3))


def test_standardize_per_step() -> None:
    values = torch.tensor([1.0, 3.0, 5.0, 10.0, 2.0, 2.0])
    steps = torch.tensor([0, 0, 0, 1, 2, 2])
    out = standardize_per_step(values, steps, eps=1e-6)
    g = torch.tensor([1.0, 3.0, 5.0])
    assert close(out[:3], (g - g.mean()) / (g.std() + 1e-6))  # unbiased std, as veRL's GRPO
    assert out[3].item() == 0.0                                # single sample at step 1: centred only
    assert close(out[4:], torch.zeros(2))                       # no spread: 0
    assert standardize_per_step(torch.tensor([7.0]), [3]).item() == 0.0
    with pytest.raises(ValueError):
        standardize_per_step(values, torch.tensor([0, 1]))


def test_rewards_for_batch_binary_and_integrated() -> None:
    r = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0])
    assert close(rewards_for_batch(r), r)  # no outcomes: the binary reward as is

    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0, 99.0])
    has_outcome = torch.tensor([True, True, True, True, False])
    vote_mean = torch.tensor([1.0, -1.0, 1 / 3, 2 / 3, -1.0])
    step = torch.tensor([0, 0, 1, 1, 0])
    got = rewards_for_batch(r, outcome=outcome, has_outcome=has_outcome, vote_mean=vote_mean,
                            step_index=step)
    integrated = outcome[:4] + vote_mean[:4]  # R_t = O + mean votes
    exp0 = integrated[:2]
    exp1 = integrated[2:]
    assert close(got[:2], (exp0 - exp0.mean()) / (exp0.std() + 1e-6))
    assert close(got[2:4], (exp1 - exp1.mean()) / (exp1.std() + 1e-6))
    assert got[4].item() == -1.0  # no outcome: binary r, not standardized with the others

    # vote_mean defaults to r; a lone sample at its step is centred to 0
    lone = rewards_for_batch(torch.tensor([1.0]), outcome=torch.tensor([1.0]), step_index=[0])
    assert lone.item() == 0.0
    with pytest.raises(ValueError):
        rewards_for_batch(r, outcome=outcome)


# --------------------------------------------------------------------------- advantages


NO_BASELINE = ObjectiveConfig(rl_baseline="none")


def standardized(r: torch.Tensor) -> torch.Tensor:
    """GRPO's (r − mean) / (std + 1e-6), unbiased std."""
    return (r - r.mean()) / (r.std() + 1e-6)


def test_binary_advantage_without_baseline_is_r_on_masked_tokens() -> None:
    r = torch.tensor([1.0, -1.0, 0.5, 0.0])
    adv, ret = compute_binary_advantage(scores_to_token_rewards(r, MASK), MASK, config=NO_BASELINE)
    assert close(adv, r[:, None] * MASK)
    assert close(ret, adv)
    assert (adv[MASK == 0] == 0).all()
    # without group ids, even with grpo on, it is plain r; so is grpo off with ids
    adv_off, _ = compute_binary_advantage(scores_to_token_rewards(r, MASK), MASK,
                                          index=np.array(["a", "a", "b", "b"], dtype=object),
                                          config=ObjectiveConfig(grpo=False, rl_baseline="none"))
    assert close(adv_off, r[:, None] * MASK)
    adv_none, _ = compute_binary_advantage(scores_to_token_rewards(r, MASK), MASK, index=[None] * 4,
                                           config=NO_BASELINE)
    assert close(adv_none, r[:, None] * MASK)


def test_batch_baseline_standardizes_within_the_batch_like_verl() -> None:
    """The default: samples without a group (online: all) are one GRPO group, the batch."""
    r = torch.tensor([1.0, -1.0, -1.0, -1.0])
    tlr = scores_to_token_rewards(r, MASK)
    adv, ret = compute_binary_advantage(tlr, MASK)
    assert close(adv, standardized(r)[:, None] * MASK, atol=1e-5)
    assert close(ret, adv)
    assert (adv[MASK == 0] == 0).all()
    # exactly veRL's GRPO with one index for the whole batch
    verl_adv, _ = ca.compute_grpo_outcome_advantage(tlr, MASK, np.array(["batch"] * 4, dtype=object))
    assert close(adv, verl_adv)
    # no ids, all-None ids, or grpo off: the same batch group
    for kw in ({"index": [None] * 4}, {"index": ["a", "a", "b", "b"], "config": ObjectiveConfig(grpo=False)}):
        assert close(compute_binary_advantage(tlr, MASK, **kw)[0], adv)
    # Dr. GRPO's centring when the std is off: (1, -1, -1, -1) - (-0.5)
    centred, _ = compute_binary_advantage(tlr, MASK, config=ObjectiveConfig(grpo_norm_by_std=False))
    assert close(centred, torch.tensor([1.5, -0.5, -0.5, -0.5])[:, None] * MASK)


def test_batch_baseline_all_failed_gives_no_rl_signal() -> None:
    """Every reply of the round failed: A = 0 (without a baseline every token got −1)."""
    r = -torch.ones(4)
    tlr = scores_to_token_rewards(r, MASK)
    adv, _ = compute_binary_advantage(tlr, MASK)
    assert (adv == 0).all()
    assert close(compute_binary_advantage(tlr, MASK, config=NO_BASELINE)[0], -MASK)
    # a lone sample has no batch to compare with: it keeps A = r (veRL's rule for a group of one)
    lone, _ = compute_binary_advantage(scores_to_token_rewards(r[:1], MASK[:1]), MASK[:1])
    assert close(lone, -MASK[:1])


def test_grpo_advantage_matches_formula_and_verl() -> None:
    mask = torch.ones(6, 3)
    mask[1, 2] = 0
    mask[4, 1:] = 0
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    index = np.array(["t1", "t1", "t1", "t2", "t2", "t2"], dtype=object)
    tlr = scores_to_token_rewards(r, mask)
    adv, _ = compute_binary_advantage(tlr, mask, index=index)

    expected = torch.empty(6)
    for lo in (0, 3):
        g = r[lo:lo + 3]
        expected[lo:lo + 3] = (g - g.mean()) / (g.std() + 1e-6)
    assert close(adv, expected[:, None] * mask, atol=1e-5)

    verl_adv, _ = ca.compute_grpo_outcome_advantage(tlr, mask, index)
    assert close(adv, verl_adv)

    # Dr. GRPO variant (centre only) also follows veRL
    adv_c, _ = compute_binary_advantage(tlr, mask, index=index, config=ObjectiveConfig(grpo_norm_by_std=False))
    verl_c, _ = ca.compute_grpo_outcome_advantage(tlr, mask, index, norm_adv_by_std_in_grpo=False)
    assert close(adv_c, verl_c)


def test_grpo_groups_and_the_batch_group_in_one_batch() -> None:
    mask = torch.ones(5, 2)
    r = torch.tensor([1.0, 0.0, -1.0, 1.0, 0.5])
    index = ["g", "g", None, "alone", None]
    adv, _ = compute_binary_advantage(scores_to_token_rewards(r, mask), mask, index=index)
    assert close(adv[:2], standardized(r[:2])[:, None].expand(2, 2), atol=1e-5)
    # a group of one and the samples without a group make the batch's group
    rest = torch.tensor([2, 3, 4])
    assert close(adv[rest], standardized(r[rest])[:, None].expand(3, 2), atol=1e-5)
    # without a baseline they keep r
    adv_none, _ = compute_binary_advantage(scores_to_token_rewards(r, mask), mask, index=index, config=NO_BASELINE)
    assert close(adv_none[:2], adv[:2])
    assert close(adv_none[rest], r[rest, None].expand(3, 2))


# hypothesis: rewards of a batch (binary ±1 or the −1/0/+1 majority, or any real), reply lengths
rewards = st.lists(st.one_of(st.sampled_from([-1.0, 0.0, 1.0]), st.floats(-3, 3, allow_nan=False, width=32)),
                   min_size=2, max_size=12)


def _batch(values: list[float], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.tensor(values, dtype=torch.float32)
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float32)
    return r, mask


@hsettings(max_examples=200, deadline=None)
@given(data=st.data(), values=rewards, centre_only=st.booleans())
def test_batch_baseline_properties(data: st.DataObject, values: list[float], centre_only: bool) -> None:
    """Per batch: the advantages sum to ~0 over samples, keep the order of the rewards, are the
    same on each sample's tokens (0 off the mask), and are 0 when every reward is equal."""
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=len(values), max_size=len(values)))
    r, mask = _batch(values, lengths)
    cfg = ObjectiveConfig(grpo_norm_by_std=not centre_only)
    adv, _ = compute_binary_advantage(scores_to_token_rewards(r, mask), mask, config=cfg)
    per_sample = adv[:, 0]
    assert (adv[mask == 0] == 0).all()
    assert close(adv, per_sample[:, None] * mask)
    scale = max(1.0, float(r.abs().max())) * len(values)
    assert abs(float(per_sample.sum())) <= 1e-4 * scale
    for i in range(len(values)):
        for j in range(len(values)):
            if r[i] == r[j]:
                assert per_sample[i] == per_sample[j]
            elif r[i] > r[j]:  # strictly for rewards apart by more than rounding
                assert per_sample[i] >= per_sample[j] if r[i] - r[j] < 1e-3 else per_sample[i] > per_sample[j]
    if float(r.max()) == float(r.min()):
        assert (adv == 0).all()


@hsettings(max_examples=100, deadline=None)
@given(value=st.one_of(st.sampled_from([-1.0, 0.0, 1.0, 0.05860195308923721]),
                       st.floats(-3, 3, allow_nan=False, width=32)),
       n=st.integers(2, 16), centre_only=st.booleans())
def test_batch_baseline_equal_rewards_give_zeros(value: float, n: int, centre_only: bool) -> None:
    r, mask = _batch([value] * n, [3] * n)
    adv, _ = compute_binary_advantage(scores_to_token_rewards(r, mask), mask,
                                      config=ObjectiveConfig(grpo_norm_by_std=not centre_only))
    assert (adv == 0).all()


def test_opd_advantage_is_clipped_teacher_minus_student() -> None:
    cfg = ObjectiveConfig(objective="opd", opd_clip=2.0)
    teacher = torch.tensor([[-0.5, -9.0, -1.0, -1.0],
                            [-4.0, -0.1, -2.0, -2.0],
                            [-1.0, -1.0, -1.0, -1.0],
                            [-0.2, -7.0, -7.0, -7.0]])
    student = torch.tensor([[-1.0, -1.0, -1.0, -3.0],
                            [-1.0, -5.0, -2.0, -2.0],
                            [-2.0, -0.5, -3.0, -1.0],
                            [-0.3, -1.0, -1.0, -1.0]], requires_grad=True)
    adv, _ = compute_opd_advantage(None, MASK, config=cfg, teacher_log_prob=teacher, student_log_prob=student)
    expected = torch.clamp(teacher - student.detach(), -2.0, 2.0) * MASK
    assert close(adv, expected)
    assert adv[0, 1].item() == -2.0 and adv[1, 1].item() == 2.0  # clipped both ways
    assert not adv.requires_grad  # the student is detached

    # samples without teacher log-probs get 0 (by row mask or NaN entries)
    has_teacher = torch.tensor([True, False, True, True])
    adv_rows, _ = compute_opd_advantage(None, MASK, config=cfg, teacher_log_prob=teacher,
                                        student_log_prob=student, teacher_mask=has_teacher)
    assert close(adv_rows, expected * has_teacher[:, None])
    nan_teacher = teacher.clone()
    nan_teacher[2] = float("nan")
    adv_nan, _ = compute_opd_advantage(None, MASK, config=cfg, teacher_log_prob=nan_teacher,
                                       student_log_prob=student)
    assert torch.isfinite(adv_nan).all()
    assert close(adv_nan[2], torch.zeros(4)) and close(adv_nan[[0, 1, 3]], expected[[0, 1, 3]])
    none, _ = compute_opd_advantage(None, MASK, config=cfg)
    assert close(none, torch.zeros_like(MASK))


def test_combined_advantage_is_weighted_sum() -> None:
    cfg = ObjectiveConfig(objective="combined", w_rl=0.7, w_opd=1.5, opd_clip=1.0)
    r = torch.tensor([1.0, -1.0, 0.0, 1.0])
    tlr = scores_to_token_rewards(r, MASK)
    teacher = -torch.rand(4, 4) * 3
    student = -torch.rand(4, 4) * 3
    has_teacher = torch.tensor([True, True, False, True])
    adv, _ = compute_combined_advantage(tlr, MASK, config=cfg, teacher_log_prob=teacher,
                                        student_log_prob=student, teacher_mask=has_teacher)
    opd = torch.clamp(teacher - student, -1.0, 1.0) * MASK * has_teacher[:, None]
    rl = standardized(r)[:, None] * MASK  # the batch baseline (default)
    assert close(adv, 0.7 * rl + 1.5 * opd, atol=1e-5)
    assert close(adv[2], 0.7 * rl[2])  # no teacher: RL term only
    # without a baseline: w_rl · r
    old, _ = compute_combined_advantage(tlr, MASK, config=ObjectiveConfig(
        objective="combined", w_rl=0.7, w_opd=1.5, opd_clip=1.0, rl_baseline="none"),
        teacher_log_prob=teacher, student_log_prob=student, teacher_mask=has_teacher)
    assert close(old, 0.7 * r[:, None] * MASK + 1.5 * opd)
    # a round where every reply failed: OPD alone
    failed = scores_to_token_rewards(-torch.ones(4), MASK)
    only_opd, _ = compute_combined_advantage(failed, MASK, config=cfg, teacher_log_prob=teacher,
                                             student_log_prob=student, teacher_mask=has_teacher)
    assert close(only_opd, 1.5 * opd)

    # the dispatcher goes through veRL's registry and agrees
    via_registry = compute_advantages(cfg, response_mask=MASK, token_level_rewards=tlr, teacher_log_prob=teacher,
                                      student_log_prob=student, teacher_mask=has_teacher)
    assert close(via_registry, adv)
    rl_only = compute_advantages(ObjectiveConfig(), response_mask=MASK, token_level_rewards=tlr)
    assert close(rl_only, rl, atol=1e-5)
    opd_only = compute_advantages(ObjectiveConfig(objective="opd", opd_clip=1.0), response_mask=MASK,
                                  teacher_log_prob=teacher, student_log_prob=student, teacher_mask=has_teacher)
    assert close(opd_only, opd)


def test_registered_in_verl_and_idempotent() -> None:
    assert ca.get_adv_estimator_fn("nextstate_binary") is obj.compute_binary_advantage
    assert ca.get_adv_estimator_fn("nextstate_opd") is obj.compute_opd_advantage
    assert ca.get_adv_estimator_fn("nextstate_combined") is obj.compute_combined_advantage
    importlib.reload(obj)  # importing twice must not raise
    assert ca.get_adv_estimator_fn("nextstate_binary") is obj.compute_binary_advantage
    # veRL's own call style: keyword args and its AlgoConfig-like config (no fields of ours)
    r = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 3)

    class AlgoLike:
        norm_adv_by_std_in_grpo = True

    adv, _ = ca.get_adv_estimator_fn("nextstate_binary")(
        token_level_rewards=scores_to_token_rewards(r, mask), response_mask=mask, config=AlgoLike(),
        index=np.array(["u", "u"], dtype=object))
    # r = (1, 0): mean 0.5, unbiased std sqrt(0.5)
    assert close(adv, torch.tensor([[0.5] * 3, [-0.5] * 3]) / (math.sqrt(0.5) + 1e-6), atol=1e-5)
    # a foreign function under one of our names is still refused
    with pytest.raises(ValueError):
        ca.register_adv_est("nextstate_binary")(lambda **_: None)


# --------------------------------------------------------------------------------- loss


def hand_ppo_loss_mat(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                      lo: float = 0.2, hi: float = 0.28, c: float = 3.0) -> torch.Tensor:
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - lo, 1 + hi) * adv)
    loss = -surrogate
    return torch.where(adv < 0, torch.minimum(loss, -adv * c), loss)


RATIOS = torch.tensor([[1.00, 1.50, 0.50, 1.25],   # A>0: -, clipped high (1.28), unclipped low side, inside ε_high
                       [0.70, 0.82, 1.40, 4.00]])  # A<0: clipped low (0.8), inside ε_low, unclipped, dual-clip (3)
ADV = torch.tensor([[1.0, 2.0, 1.0, 0.5],
                    [-1.0, -1.0, -2.0, -1.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0],
                    [-1.5, -0.7, -2.5, -4.0]])
LOGP = OLD + torch.log(RATIOS)
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_ppo_loss_matches_hand_clipped_surrogate_and_verl() -> None:
    cfg = ObjectiveConfig()
    logp = LOGP.clone().requires_grad_(True)
    loss, metrics = compute_loss(cfg, logp, OLD, ADV, LOSS_MASK)
    mat = hand_ppo_loss_mat(LOGP, OLD, ADV)
    # spell out the clipped tokens
    assert math.isclose(mat[0, 1].item(), -2.0 * 1.28, rel_tol=1e-6)   # high clip
    assert math.isclose(mat[0, 3].item(), -0.5 * 1.25, rel_tol=1e-6)   # within ε_high = 0.28
    assert math.isclose(mat[1, 0].item(), 1.0 * 0.8, rel_tol=1e-6)     # low clip
    assert math.isclose(mat[1, 1].item(), 1.0 * 0.82, rel_tol=1e-6)    # within ε_low
    assert math.isclose(mat[1, 3].item(), 1.0 * 3.0, rel_tol=1e-6)     # dual clip
    assert math.isclose(loss.item(), mat.mean().item(), rel_tol=1e-6)
    assert math.isclose(metrics["pg_loss"], loss.item(), rel_tol=1e-6)
    # ε-clip active (clipped loss > unclipped) on (0,1) and (1,0); the dual clip on (1,3)
    assert math.isclose(metrics["pg_clipfrac"], 2 / 8, rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_lower"], 1 / 8, rel_tol=1e-6)
    assert math.isclose(metrics["ppo_kl"], (OLD - LOGP).mean().item(), rel_tol=1e-5)
    assert math.isclose(metrics["adv_mean"], ADV.mean().item(), rel_tol=1e-6)
    assert "kl" not in metrics

    actor_cfg = obj.actor_config(cfg)
    verl_loss, verl_metrics = ca.compute_policy_loss_vanilla(OLD, LOGP, ADV, LOSS_MASK, "token-mean", actor_cfg)
    assert math.isclose(loss.item(), verl_loss.item(), rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac"], verl_metrics["actor/pg_clipfrac"], rel_tol=1e-6)

    # clipped tokens carry no gradient; unclipped ones carry -A·ρ / N
    loss.backward()
    grad = logp.grad
    assert grad[0, 1].item() == 0.0 and grad[1, 0].item() == 0.0 and grad[1, 3].item() == 0.0
    assert math.isclose(grad[0, 0].item(), -1.0 * 1.0 / 8, rel_tol=1e-5)
    assert math.isclose(grad[1, 2].item(), 2.0 * 1.4 / 8, rel_tol=1e-5)


def test_masked_tokens_do_not_count() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    loss, metrics = compute_loss(ObjectiveConfig(), LOGP, OLD, ADV, mask)
    mat = hand_ppo_loss_mat(LOGP, OLD, ADV)
    assert math.isclose(loss.item(), ((mat * mask).sum() / mask.sum()).item(), rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac"], 2 / 4, rel_tol=1e-6)  # (0,1) and (1,0)


@pytest.mark.parametrize("mode", obj.LOSS_AGG_MODES)
def test_loss_agg_modes_follow_verl(mode: str) -> None:
    # row 2 fully masked: veRL's seq-mean modes exclude it
    old = torch.zeros(3, 4)
    logp = torch.zeros(3, 4)
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mat = -adv  # ratio 1: L = -A
    sums = (mat * mask).sum(-1)
    counts = mask.sum(-1)
    expected = {
        "token-mean": sums.sum() / counts.sum(),
        "token-sum": sums.sum(),
        "seq-mean-token-sum": sums[:2].mean(),
        "seq-mean-token-mean": (sums[:2] / counts[:2]).mean(),
        "seq-mean-token-sum-norm": sums[:2].mean() / 4,
    }[mode]
    loss, _ = compute_loss(ObjectiveConfig(loss_agg_mode=mode), logp, old, adv, mask)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-5)
    assert math.isclose(loss.item(), ca.agg_loss(mat, mask, mode).item(), rel_tol=1e-5)


def test_k3_kl_to_base() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.3], [-0.1, -3.0, -1.2]])
    ref = torch.tensor([[-1.5, -1.0, -0.3], [-2.0, -2.5, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    d = ref - logp
    k3 = torch.exp(d) - d - 1
    assert close(kl_to_base(logp, ref), k3)
    assert close(kl_to_base(logp, ref), ca.kl_penalty(logp, ref, "low_var_kl"))
    assert (k3 >= 0).all()

    adv = torch.zeros_like(logp)  # no policy-gradient term: the loss is the KL term alone
    loss, metrics = compute_loss(ObjectiveConfig(kl_coef=0.1), logp, logp.detach(), adv, mask, ref_log_prob=ref)
    kl_mean = ((k3 * mask).sum() / mask.sum()).item()
    assert math.isclose(loss.item(), 0.1 * kl_mean, rel_tol=1e-5)
    assert math.isclose(metrics["kl"], kl_mean, rel_tol=1e-5)
    assert math.isclose(metrics["kl_loss"], kl_mean, rel_tol=1e-5)

    # kl_coef 0: reported, not added
    loss0, metrics0 = compute_loss(ObjectiveConfig(), logp, logp.detach(), adv, mask, ref_log_prob=ref)
    assert loss0.item() == 0.0 and math.isclose(metrics0["kl"], kl_mean, rel_tol=1e-5)
    with pytest.raises(ValueError):
        compute_loss(ObjectiveConfig(kl_coef=0.1), logp, logp, adv, mask)


def test_kl_gradient_pulls_toward_base() -> None:
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    tokens = torch.tensor([[0]])
    ref = torch.log(torch.tensor([[0.6]]))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)  # log 1/3
    loss, _ = compute_loss(ObjectiveConfig(kl_coef=1.0), logp, logp.detach(), torch.zeros(1, 1),
                           torch.ones(1, 1), ref_log_prob=ref)
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    new = torch.log_softmax(logits, -1)[0, 0, 0]
    assert new.item() > logp.item()  # moved toward the base policy's 0.6


def test_one_sgd_step_moves_logprobs_with_advantage_sign() -> None:
    torch.manual_seed(0)
    batch, length, vocab = 3, 5, 7
    logits = torch.randn(batch, length, vocab, requires_grad=True)
    tokens = torch.randint(0, vocab, (batch, length))
    mask = torch.ones(batch, length)
    mask[2, 3:] = 0

    def logprobs() -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)

    before = logprobs().detach()
    r = torch.tensor([1.0, -1.0, 1.0])
    for cfg in (ObjectiveConfig(), ObjectiveConfig(loss_agg_mode="seq-mean-token-mean")):
        logits.grad = None
        adv = compute_advantages(cfg, response_mask=mask, token_level_rewards=scores_to_token_rewards(r, mask))
        loss, _ = compute_loss(cfg, logprobs(), before, adv, mask)
        loss.backward()
        step = logits.detach() - 0.1 * logits.grad
        after = torch.log_softmax(step, -1).gather(-1, tokens[..., None]).squeeze(-1)
        delta = after - before
        assert (delta[0] > 0).all() and (delta[2, :3] > 0).all()  # positive advantage: up
        assert (delta[1] < 0).all()                                 # negative advantage: down
        assert close(logits.grad[2, 3:], torch.zeros(2, vocab))     # masked tokens: no gradient

    # OPD: tokens the teacher likes more go up, those it likes less go down
    logits.grad = None
    teacher = before + torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]]).expand(batch, length)
    cfg = ObjectiveConfig(objective="opd")
    adv = compute_advantages(cfg, response_mask=mask, teacher_log_prob=teacher, student_log_prob=before)
    loss, _ = compute_loss(cfg, logprobs(), before, adv, mask)
    loss.backward()
    after = torch.log_softmax(logits.detach() - 0.1 * logits.grad, -1).gather(-1, tokens[..., None]).squeeze(-1)
    delta = (after - before)[:2]
    assert (delta[:, [0, 2, 4]] > 0).all() and (delta[:, [1, 3]] < 0).all()


@pytest.mark.parametrize("mode", obj.LOSS_AGG_MODES)
@pytest.mark.parametrize("weights", [False, True])
def test_tensor_metrics_equal_verl_vanilla(mode: str, weights: bool) -> None:
    """compute_loss(tensor_metrics=True) runs our copy of veRL's vanilla PPO loss (no .item()
    syncs): the loss, its gradient and every metric equal veRL's own on random inputs with
    clipped, dual-clipped and masked tokens."""
    gen = torch.Generator().manual_seed(7)
    shape = (5, 9)
    old = -3 * torch.rand(shape, generator=gen)
    logp = (old + torch.randn(shape, generator=gen)).requires_grad_(True)  # ratios far outside the clip
    adv = torch.randn(shape, generator=gen)
    mask = (torch.rand(shape, generator=gen) > 0.3).float()
    mask[3] = 0  # a fully masked row
    is_w = torch.rand(shape, generator=gen) * 2 if weights else None
    cfg = ObjectiveConfig(loss_agg_mode=mode, kl_coef=0.1)
    ref = old - 0.5 * torch.rand(shape, generator=gen)
    loss_f, metrics_f = compute_loss(cfg, logp, old, adv, mask, ref_log_prob=ref, rollout_is_weights=is_w)
    (grad_f,) = torch.autograd.grad(loss_f, logp)
    loss_t, metrics_t = compute_loss(cfg, logp, old, adv, mask, ref_log_prob=ref, rollout_is_weights=is_w,
                                     tensor_metrics=True)
    (grad_t,) = torch.autograd.grad(loss_t, logp)
    assert torch.equal(loss_f.detach(), loss_t.detach()) and torch.equal(grad_f, grad_t)
    assert metrics_f.keys() == metrics_t.keys()
    for key, value in metrics_t.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
        assert value.item() == metrics_f[key], key
    assert 0 < metrics_f["pg_clipfrac"] < 1 and metrics_f["pg_clipfrac_lower"] > 0


def test_loss_terms_are_a_registry_that_adds_linearly() -> None:
    """The KL anchor and top-k OPD are registered loss terms; a term registered beside them is
    aggregated like the surrogate, reported under its name, and added times its coefficient
    (a coefficient of 0 reports it only)."""
    assert list(obj.LOSS_TERMS)[:2] == ["kl_loss", "topk_kl"]
    logp = torch.tensor([[-1.0, -2.0, -0.3]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    zeros = torch.zeros(1, 3)
    base, base_metrics = compute_loss(ObjectiveConfig(), logp, logp.detach(), zeros, mask)
    for coef in (0.0, 2.0):
        @obj.register_loss_term("length_test")
        def length(cfg: ObjectiveConfig, x: obj.LossInputs, c: float = coef) -> obj.LossTerm:
            return obj.LossTerm(c, -x.log_prob, x.mask, {"length_test_tokens": x.mask.sum()})

        try:
            loss, metrics = compute_loss(ObjectiveConfig(), logp, logp.detach(), zeros, mask)
        finally:
            del obj.LOSS_TERMS["length_test"]
        assert metrics["length_test"] == pytest.approx(1.5) and metrics["length_test_tokens"] == 2.0
        assert loss.item() == pytest.approx(base.item() + coef * 1.5)
    assert "length_test" not in base_metrics


def test_per_reply_averaging_weighs_a_long_failure_as_a_short_success() -> None:
    """A long failed reply (A = −1, 8 tokens) beside a short successful one (A = +1, 2 tokens):
    under token-mean the failure's tokens take 4× the push of the success's, so the step lowers
    the sampled tokens' probability overall (the entropy rise of the learning benchmark's early
    rounds); per reply (seq-mean-token-mean) both replies get the same total push."""
    mask = torch.tensor([[1.0] * 8, [1.0, 1.0] + [0.0] * 6])
    adv = torch.tensor([[-1.0] * 8, [1.0] * 8]) * mask
    pushes = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        logp = torch.full((2, 8), -1.0, requires_grad=True)
        loss, _ = compute_loss(ObjectiveConfig(loss_agg_mode=mode), logp, logp.detach(), adv, mask)
        loss.backward()
        pushes[mode] = (-logp.grad * mask).sum(-1)  # each reply's total ascent on its log-probs
    down, up = pushes["token-mean"].tolist()
    assert down < 0 < up and math.isclose(-down / up, 4.0, rel_tol=1e-5)
    down, up = pushes["seq-mean-token-mean"].tolist()
    assert down < 0 < up and math.isclose(-down, up, rel_tol=1e-5)
