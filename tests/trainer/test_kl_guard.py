"""The KL anchor (the topicality guard): ``ObjectiveConfig.kl_coef`` adds kl_coef · agg(k3) to the
base policy, whose log-probs the local trainer takes from the same LoRA model with the adapter
switched off (peft's ``disable_adapter()``). On a real (tiny) transformers + peft model: its
gradient pulls the adapter toward the base, it adds linearly to the objective, and a
coefficient of 0 is the objective without it, bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.tiny_model import VOCAB, write_tiny_llama
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig, kl_to_base
from trainer.samples import Sample


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _samples(rewards: list[float]) -> list[Sample]:
    rng = random.Random(1)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 8))],
                   response_ids=[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 8))],
                   behaviour_logprobs=None, teacher_logprobs=None, reward=r, integrated_reward=None,
                   capture="white-box") for i, r in enumerate(rewards)]


def _trainer(model: Path, cfg: ObjectiveConfig, lr: float = 1e-2) -> LocalTrainer:
    """A LoRA trainer whose adapter is already away from the base (B ≠ 0, the same every time)."""
    trainer = LocalTrainer(LocalConfig(model_dir=model, lr=lr, seed=0, device="cpu", micro_batch_size=2), cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return trainer


def _kl(trainer: LocalTrainer, samples: list[Sample]) -> float:
    with torch.no_grad():
        logp, mask = trainer.response_logprobs(samples)
        ref, _ = trainer.response_logprobs(samples, adapter=False)
    return float((kl_to_base(logp, ref) * mask).sum() / mask.sum())


def test_the_gradient_pulls_toward_the_base(tiny_model: Path) -> None:
    """Equal rewards under the batch baseline give A = 0: the step is the KL term alone (and
    AdamW's weight decay, which the coefficient-0 run has too). With the guard the adapter's
    log-probs end much nearer the base's than without."""
    samples = _samples([1.0] * 4)
    before = _kl(_trainer(tiny_model, ObjectiveConfig()), samples)
    after = {}
    for coef in (0.0, 1.0):
        trainer = _trainer(tiny_model, ObjectiveConfig(kl_coef=coef))
        for _ in range(3):
            metrics = trainer.step(samples)
        after[coef] = _kl(trainer, samples)
        assert metrics["advantage_mean"] == 0.0
    assert before > 1e-3
    assert after[1.0] < 0.5 * before and after[1.0] < after[0.0]


def _grads(model: Path, cfg: ObjectiveConfig, samples: list[Sample]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    trainer = _trainer(model, cfg, lr=0.0)  # the step leaves each parameter's gradient in place
    metrics = trainer.step(samples)
    return metrics, {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                     if p.requires_grad and p.grad is not None}


def test_zero_is_the_old_objective_and_the_term_adds_linearly(tiny_model: Path) -> None:
    samples = _samples([1.0, -1.0, 1.0, -1.0])
    old_metrics, old = _grads(tiny_model, ObjectiveConfig(objective="rl"), samples)
    m0, g0 = _grads(tiny_model, ObjectiveConfig(objective="rl", kl_coef=0.0), samples)
    assert "kl" not in m0 and "kl_loss" not in m0  # no base pass at all
    assert m0["loss"] == old_metrics["loss"] and all(torch.equal(g0[k], old[k]) for k in old)
    m1, g1 = _grads(tiny_model, ObjectiveConfig(objective="rl", kl_coef=0.5), samples)
    m2, g2 = _grads(tiny_model, ObjectiveConfig(objective="rl", kl_coef=1.0), samples)
    assert m1["kl"] > 0 and m1["kl"] == pytest.approx(m2["kl"], rel=1e-6)
    assert m1["loss"] == pytest.approx(m1["pg_loss"] + 0.5 * m1["kl_loss"], rel=1e-5)
    for k in old:  # g(c) = g(0) + c · g_kl
        torch.testing.assert_close(g2[k] - g0[k], 2 * (g1[k] - g0[k]), atol=1e-6, rtol=1e-4)
    assert any(float((g1[k] - g0[k]).abs().max()) > 1e-5 for k in old)


def test_full_fine_tuning_has_no_base_to_pull_toward(tiny_model: Path) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, lora=False, device="cpu"), ObjectiveConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_log_prob"):
        trainer.step(_samples([1.0, -1.0]))
