"""Objectives: advantages and losses on hand-built tensors, against the design's formulas and
veRL's core_algos where they overlap. CPU only, no services."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

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
    for bad in ({"objective": "sft"}, {"loss_agg_mode": "mean"}, {"clip_ratio_c": 1.0},
                {"opd_clip": 0.0}, {"kl_coef": -1.0}, {"clip_low": 1.0}):
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


def test_binary_advantage_is_r_on_masked_tokens() -> None:
    r = torch.tensor([1.0, -1.0, 0.5, 0.0])
    adv, ret = compute_binary_advantage(scores_to_token_rewards(r, MASK), MASK)
    assert close(adv, r[:, None] * MASK)
    assert close(ret, adv)
    assert (adv[MASK == 0] == 0).all()
    # a batch without group ids, even with grpo on, is plain r; so is grpo off with ids
    adv_off, _ = compute_binary_advantage(scores_to_token_rewards(r, MASK), MASK,
                                          index=np.array(["a", "a", "b", "b"], dtype=object),
                                          config=ObjectiveConfig(grpo=False))
    assert close(adv_off, r[:, None] * MASK)
    adv_none, _ = compute_binary_advantage(scores_to_token_rewards(r, MASK), MASK, index=[None] * 4)
    assert close(adv_none, r[:, None] * MASK)


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


def test_grpo_mixed_batch_singletons_keep_r() -> None:
    mask = torch.ones(4, 2)
    r = torch.tensor([1.0, 0.0, -1.0, 1.0])
    adv, _ = compute_binary_advantage(scores_to_token_rewards(r, mask), mask,
                                      index=["g", "g", None, "alone"])
    g = r[:2]
    assert close(adv[:2], ((g - g.mean()) / (g.std() + 1e-6))[:, None].expand(2, 2), atol=1e-5)
    assert close(adv[2:], r[2:, None].expand(2, 2))


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
    assert close(adv, 0.7 * r[:, None] * MASK + 1.5 * opd)
    assert close(adv[2], 0.7 * r[2] * MASK[2])  # no teacher: RL term only

    # the dispatcher goes through veRL's registry and agrees
    via_registry = compute_advantages(cfg, response_mask=MASK, token_level_rewards=tlr, teacher_log_prob=teacher,
                                      student_log_prob=student, teacher_mask=has_teacher)
    assert close(via_registry, adv)
    rl_only = compute_advantages(ObjectiveConfig(), response_mask=MASK, token_level_rewards=tlr)
    assert close(rl_only, r[:, None] * MASK)
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
