"""The per-round drift instruments (``trainer.drift``) on a real (tiny) transformers + peft
model: the candidate's KL to the base policy on the round's tokens (0 for an untrained LoRA,
the k1 and k3 estimates of log-probs computed directly otherwise), the serving policy's entropy
from the captured log-probs, and the teacher's top-k masses."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from tests.support.tiny_model import VOCAB, write_tiny_llama
from trainer import drift
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig, kl_to_base
from trainer.samples import Sample


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _samples(n: int, *, topk: bool = False, behaviour: bool = False) -> list[Sample]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        length = rng.randint(3, 7)
        response = [rng.randrange(2, VOCAB) for _ in range(length)]
        ids = [[response[t] if t % 2 == 0 else rng.randrange(2, VOCAB), *(rng.randrange(2, VOCAB) for _ in range(2))]
               for t in range(length)]
        out.append(Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                          prompt_ids=[rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 6))],
                          response_ids=response, behaviour_logprobs=[-2.0] * length if behaviour else None,
                          teacher_logprobs=[-1.0] * length, reward=-1.0, integrated_reward=None, capture="white-box",
                          teacher_topk_ids=ids if topk else None,
                          teacher_topk_logprobs=[[-0.5, -1.5, -2.5]] * length if topk else None))
    return out


def _trainer(model: Path, perturb: bool) -> LocalTrainer:
    trainer = LocalTrainer(LocalConfig(model_dir=model, seed=0, device="cpu", micro_batch_size=2),
                           ObjectiveConfig(objective="opd", opd_topk=True))
    if perturb:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return trainer


def test_an_untrained_adapter_has_not_moved(tiny_model: Path) -> None:
    m = drift.round_drift(_trainer(tiny_model, perturb=False), _samples(3))
    assert m["drift_kl_k1"] == pytest.approx(0.0, abs=1e-6) and m["drift_kl_k3"] == pytest.approx(0.0, abs=1e-6)
    assert m["entropy_behaviour"] == pytest.approx(m["entropy_candidate"]) and m["entropy_candidate"] > 0
    assert set(m) <= set(drift.KEYS) and "teacher_topk_mass" not in m


def test_kl_entropy_and_top_k_masses(tiny_model: Path) -> None:
    trainer = _trainer(tiny_model, perturb=True)
    samples = _samples(5, topk=True, behaviour=True)
    m = drift.round_drift(trainer, samples)
    k1 = k3 = n = 0.0
    student_mass = 0.0
    with torch.no_grad():
        for s in samples:
            logp, _ = trainer.response_logprobs([s])
            ref, _ = trainer.response_logprobs([s], adapter=False)
            k1 += float((logp - ref).sum())
            k3 += float(kl_to_base(logp, ref).sum())
            _, _, extra = trainer.response_and_extra_logprobs([s], torch.tensor([s.teacher_topk_ids]))
            student_mass += float(extra.exp().sum())
            n += len(s.response_ids)
    assert m["drift_kl_k3"] > 1e-3 and m["drift_kl_k3"] == pytest.approx(k3 / n, rel=1e-4)
    assert m["drift_kl_k1"] == pytest.approx(k1 / n, rel=1e-4, abs=1e-6)
    assert m["entropy_behaviour"] == pytest.approx(2.0)  # the captured log-probs, not the candidate's
    assert m["teacher_topk_mass"] == pytest.approx(sum(math.exp(x) for x in (-0.5, -1.5, -2.5)), rel=1e-5)
    assert m["student_topk_mass"] == pytest.approx(student_mass / n, rel=1e-4)
    # every other position's top-k holds the sampled token (see _samples)
    hits = sum((len(s.response_ids) + 1) // 2 for s in samples)
    assert m["sampled_in_topk"] == pytest.approx(hits / n)
