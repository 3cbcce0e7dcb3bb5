"""A step's memory follows its micro-batch's tokens, not its round's: micro-batches are cut by a
token budget (``LocalConfig.max_tokens_per_micro_batch``), so no forward over a round of long
turns holds more than the budget's tokens (checked on the shapes the decoder is given, through a
forward hook), a turn longer than the budget trains alone, and neither the split nor gradient
checkpointing changes what the step learns."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_model import VOCAB, write_tiny_llama
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.samples import Sample


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _samples(lengths: list[tuple[int, int]], seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randrange(2, VOCAB) for _ in range(p)],
                   response_ids=[rng.randrange(2, VOCAB) for _ in range(r)],
                   behaviour_logprobs=[-2.0 * rng.random() for _ in range(r)],
                   teacher_logprobs=[-2.0 * rng.random() for _ in range(r)],
                   reward=1.0 if i % 2 else 0.0, integrated_reward=None, capture="white-box")
            for i, (p, r) in enumerate(lengths)]


def _forwards(trainer: LocalTrainer) -> list[int]:
    """The tokens (rows × width) of every forward the decoder runs from now on."""
    seen: list[int] = []

    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(ids.shape[0] * ids.shape[1])

    trainer._causal_lm().model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("packing", ["off", "on"])
@pytest.mark.parametrize("objective", ["rl", "combined"])
def test_no_forward_holds_more_than_the_budget(tiny_model: Path, objective: str, packing: str) -> None:
    # a round of four 40-token turns (160 tokens) under a budget of 96: two forwards of 80 a pass
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", micro_batch_size=4, packing=packing,
                                       max_tokens_per_micro_batch=96), ObjectiveConfig(objective=objective))
    seen = _forwards(trainer)
    metrics = trainer.step(_samples([(30, 10)] * 4))
    assert seen and max(seen) <= 96, seen
    assert seen == [80] * (4 if objective == "combined" else 2)  # combined: the no-grad pass too
    assert metrics["micro_batches"] == 2 and metrics["samples"] == 4


def test_a_turn_longer_than_the_budget_trains_alone(tiny_model: Path) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", max_tokens_per_micro_batch=56),
                           ObjectiveConfig(objective="rl"))
    samples = _samples([(10, 6), (90, 10), (12, 4), (20, 6)])
    assert [(p.start, p.stop) for p in trainer.micro_batches(samples)] == [(0, 1), (1, 2), (2, 4)]
    seen = _forwards(trainer)
    assert trainer.step(samples)["loss"] != 0
    assert seen == [16, 100, 2 * 26]


def test_without_a_budget_the_round_is_one_forward(tiny_model: Path) -> None:
    """What the trainer did before the budget (``max_tokens_per_micro_batch=0``): turns counted,
    not tokens, so the round's four long turns are one forward."""
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", micro_batch_size=4,
                                       max_tokens_per_micro_batch=0), ObjectiveConfig(objective="rl"))
    seen = _forwards(trainer)
    trainer.step(_samples([(30, 10)] * 4))
    assert seen == [160]


def test_the_split_and_checkpointing_learn_the_same(tiny_model: Path) -> None:
    """Turns of one length: the token-budget split with recomputed activations gives the loss and
    the updated weights of one forward over the round with kept activations."""
    samples = _samples([(20, 8)] * 4, seed=3)
    out = []
    for local in ({"max_tokens_per_micro_batch": 0, "gradient_checkpointing": False},
                  {"max_tokens_per_micro_batch": 56, "gradient_checkpointing": True}):
        trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", lr=1e-2, seed=0, micro_batch_size=4,
                                           **local), ObjectiveConfig(objective="rl"))
        assert trainer.gradient_checkpointing == local["gradient_checkpointing"]
        metrics = trainer.step(samples)
        out.append((metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}))
    (m_one, w_one), (m_split, w_split) = out
    assert m_one["micro_batches"] == 1 and m_split["micro_batches"] == 2
    assert m_split["loss"] == pytest.approx(m_one["loss"], abs=1e-5) and m_one["loss"] != 0
    assert w_one.keys() == w_split.keys() and w_one
    assert max(float((w_one[k] - w_split[k]).abs().max()) for k in w_one) < 1e-5


def test_per_reply_averaging_is_the_same_split_or_whole(tiny_model: Path) -> None:
    """``seq-mean-token-mean`` (the learning benchmark's ``+seq`` arms) over turns of different
    lengths: each micro-batch's loss weighted by its share of the turns is the whole round's mean
    of per-reply means, so the split learns what one forward learns."""
    samples = _samples([(20, 12), (20, 3), (20, 12), (20, 3)], seed=5)
    out = []
    for budget in (0, 70):
        trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", lr=1e-2, seed=0, micro_batch_size=4,
                                           max_tokens_per_micro_batch=budget, gradient_checkpointing=False),
                               ObjectiveConfig(objective="rl", loss_agg_mode="seq-mean-token-mean"))
        metrics = trainer.step(samples)
        out.append((metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}))
    (m_one, w_one), (m_split, w_split) = out
    assert m_one["micro_batches"] == 1 and m_split["micro_batches"] > 1
    assert m_split["loss"] == pytest.approx(m_one["loss"], abs=1e-5) and m_one["loss"] != 0
    assert max(float((w_one[k] - w_split[k]).abs().max()) for k in w_one) < 1e-5
