"""The chunked log-prob path (``trainer.logprobs``, LocalTrainer's default) equals the full
log_softmax path (``LocalTrainer._full_logprobs``, for heads the chunked path cannot take),
logprobs and gradients, on the real SmolLM2 weights, with padding (sequences of different
lengths) and with packing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import logprobs as chunked
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.samples import Sample

TOL = 1e-3


def _samples(seed: int, shapes: list[tuple[int, int]]) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randint(3, 49151) for _ in range(p)],
                   response_ids=[rng.randint(3, 49151) for _ in range(r)],
                   behaviour_logprobs=None, teacher_logprobs=None, reward=1.0, integrated_reward=None,
                   capture="white-box") for i, (p, r) in enumerate(shapes)]


def _grads(trainer: LocalTrainer, samples: list[Sample], weights: torch.Tensor, path: str, packing: str = "off"
           ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    trainer.cfg.packing = packing
    if path == "full":
        lp, mask, _ = trainer._full_logprobs(samples)
    else:
        lp, mask, _ = trainer._chunked_logprobs(samples)
    (lp * weights[:, : lp.shape[1]] * mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
             if p.requires_grad and p.grad is not None}
    return lp.detach(), mask, grads


def _assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    # to 1e-3 of each tensor's scale (absolute where it is below 1): fp32 gradients of ~100 (the
    # norms', the first layer's) differ by ~1e-2 absolute between two summation orders alone
    worst, name = max((float((a[k] - b[k]).abs().max()) / max(1.0, float(a[k].abs().max())), k) for k in a)
    assert worst <= TOL, f"largest gradient difference {worst:.2e} of the scale of {name}"
    assert any(float(g.abs().max()) > 10 * TOL for g in a.values()), "gradients too small to compare"


# one long, a short prompt, a one-token response, a long response: padding on both axes
SHAPES = [(23, 9), (5, 14), (31, 1), (12, 20)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_chunked_equals_full_logsoftmax_on_smollm2(model_dir: Path, lora: bool) -> None:
    torch.manual_seed(0)
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir, lora=lora, device="cpu", logprob_chunk=7),
                           ObjectiveConfig())
    if lora:  # lora_B starts at 0, which would leave lora_A's gradient 0 on both paths
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    samples = _samples(1, SHAPES)
    weights = torch.randn(len(samples), max(r for _, r in SHAPES))
    ref_lp, ref_mask, ref_g = _grads(trainer, samples, weights, "full")
    for packing in ("off", "on"):
        lp, mask, g = _grads(trainer, samples, weights, "chunked", packing)
        assert torch.equal(mask, ref_mask)
        assert torch.allclose(lp, ref_lp, atol=TOL, rtol=0), f"packing {packing}: {(lp - ref_lp).abs().max():.2e}"
        assert float((ref_lp * ref_mask).sum()) < -10  # real log-probs, not zeros
        _assert_grads_close(g, ref_g)
    if not lora:  # the tied LM head / embedding gets gradient through the chunked head too
        emb = next(k for k in ref_g if "embed_tokens" in k)
        assert float(ref_g[emb].abs().max()) > 10 * TOL


@pytest.mark.parametrize("objective", ["opd", "combined"])
def test_one_micro_batch_step_fuses_the_no_grad_pass(model_dir: Path, objective: str) -> None:
    """A step whose batch is one micro-batch takes the current policy's log-probs (OPD
    advantages) from its own forward instead of a separate no-grad pass: the same loss and the
    same updated LoRA weights as with the pass."""
    samples = _samples(4, [(10, 6), (14, 3), (7, 8), (9, 5)])
    rng = random.Random(5)
    for i, s in enumerate(samples):
        s.reward = 1.0 if i == 0 else -1.0
        s.behaviour_logprobs = [-2.0 * rng.random() for _ in s.response_ids]
        if i:  # three corrected turns carry teacher log-probs
            s.teacher_logprobs = [-3.0 * rng.random() for _ in s.response_ids]
    out = {}
    for fused in (True, False):
        trainer = LocalTrainer(LocalConfig(model_dir=model_dir, device="cpu", lr=1e-3, seed=1, micro_batch_size=4),
                               ObjectiveConfig(objective=objective))
        trainer._fuse_no_grad_pass = lambda n, fused=fused: fused  # type: ignore[method-assign]
        metrics = [trainer.step(samples) for _ in range(2)]  # the second step from moved weights
        assert trainer.last_step_no_grad_pass == (not fused)
        lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        out[fused] = metrics, lora
    (m_fused, w_fused), (m_pass, w_pass) = out[True], out[False]
    for a, b in zip(m_fused, m_pass, strict=True):
        assert abs(a["loss"] - b["loss"]) < TOL and a["loss"] != 0
        assert abs(a["advantage_mean"] - b["advantage_mean"]) < TOL
    assert w_fused.keys() == w_pass.keys() and w_fused
    worst = max(float((w_fused[k] - w_pass[k]).abs().max()) for k in w_fused)
    assert worst < 0.5 * 1e-3
    assert any(float(w.abs().max()) > 0 for k, w in w_fused.items() if "lora_B" in k)  # it moved


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 300), chunk=st.integers(1, 50), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_token_logprobs_matches_log_softmax(n: int, vocab: int, chunk: int, bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    up = torch.randn(n, generator=g, dtype=torch.float64)
    ref = torch.log_softmax((h @ w.t() + (b if b is not None else 0)).float(), -1).gather(-1, t[:, None]).squeeze(-1)
    ref_grads = torch.autograd.grad((ref * up).sum(), [x for x in (h, w, b) if x is not None])
    out = chunked.token_logprobs(h, w, t, b, chunk_size=chunk)
    grads = torch.autograd.grad((out * up).sum(), [x for x in (h, w, b) if x is not None])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), vocab=st.integers(2, 200), k=st.integers(1, 6), chunk=st.integers(1, 40),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_k_targets_per_row_match_log_softmax(n: int, vocab: int, k: int, chunk: int, bias: bool, seed: int) -> None:
    """K targets per row (top-k OPD: the sampled token and the teacher's top k), repeats allowed:
    the same log-probs and gradients as gathering K columns of a plain log_softmax."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (2, n, k), generator=g)
    up = torch.randn(2, n, k, generator=g, dtype=torch.float64)
    ref = torch.log_softmax((h @ w.t() + (b if b is not None else 0)).float(), -1).gather(-1, t)
    params = [x for x in (h, w, b) if x is not None]
    ref_grads = torch.autograd.grad((ref * up).sum(), params)
    out = chunked.token_logprobs(h, w, t, b, chunk_size=chunk)
    grads = torch.autograd.grad((out * up).sum(), params)
    assert out.shape == (2, n, k) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        chunked.token_logprobs(h, w, t[0, :, 0], b)  # neither (2, n) nor (2, n, K)


def test_select_response_hidden_positions() -> None:
    hidden = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6, 1)
    h, valid = chunked.select_response_hidden(hidden, starts=[2, 4], lengths=[3, 1])
    # sequence 0: positions 1, 2, 3 predict its 3 response tokens; sequence 1: position 3
    assert h[..., 0].tolist() == [[1.0, 2.0, 3.0], [9.0, 9.0, 9.0]]
    assert valid.tolist() == [[True, True, True], [True, False, False]]
