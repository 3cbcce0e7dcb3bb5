"""The eval gate's topicality check: a candidate whose on-topic share on the held-out prompts
falls more than the margin below the reference version's (the base model, evaluated once) is
refused, with a reason that says so, whatever its score; the replies come from a stand-in for
the vLLM (the refusal itself — marked refused, the event, the reason — is the real code)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from benchmarks.learning import preference
from datapool.models import PolicyEvent
from trainer.eval_gate import EvalGate

PROMPTS = [[{"role": "user", "content": q}] for q in ("What is a cloud?", "Why is the ocean salty?",
                                                     "How do magnets work?", "What is friction?")]
ON = {"What is a cloud?": "Water droplets in the sky form a cloud.", "Why is the ocean salty?": "Rivers carry salt.",
      "How do magnets work?": "Magnets pull iron.", "What is friction?": "Friction resists sliding."}


class Canned(EvalGate):
    """Each version answers from a table; counts how often each version was asked."""

    def __init__(self, *args: Any, replies: dict[str, dict[str, str]], **kw: Any):
        super().__init__(*args, **kw)
        self.replies = replies
        self.asked: dict[str, int] = {}

    def answer(self, model: str, prompts: list[list[dict[str, Any]]]) -> list[str]:
        self.asked[model] = self.asked.get(model, 0) + 1
        return [self.replies[model][m[0]["content"]] for m in prompts]


def _gate(engine: Any, replies: dict[str, dict[str, str]], **kw: Any) -> Canned:
    return Canned(engine, ["http://127.0.0.1:9/v1"], "smollm2", prompts=PROMPTS, sessions=0,
                  scorer=kw.pop("scorer", None), threshold=0.05, max_tokens=16,
                  topic_scorer=preference.topic_scorer, replies=replies, **kw)


def test_an_off_topic_candidate_is_refused_and_says_why(sqlite_engine: Any) -> None:
    drifted = dict(ON, **{"What is a cloud?": "Yes.", "How do magnets work?": "Bathroom scale."})
    gate = _gate(sqlite_engine, {"smollm2": ON, "cand": drifted}, topic_margin=0.3)
    assert gate.decide("cand", {}) == "refuse"
    assert gate.last_reason is not None and gate.last_reason.startswith("off topic: held-out on-topic share 0.500")
    with OrmSession(sqlite_engine) as db:
        events = db.execute(select(PolicyEvent.action, PolicyEvent.reason, PolicyEvent.metrics)
                            .order_by(PolicyEvent.id)).all()
    assert [e[0] for e in events] == ["eval", "refuse"]
    assert events[0][2]["on_topic"] == 0.5 and events[0][2]["reference_on_topic"] == 1.0
    assert events[1][1] == gate.last_reason


def test_within_the_margin_passes_and_the_reference_is_asked_once(sqlite_engine: Any) -> None:
    one_off = dict(ON, **{"What is a cloud?": "Yes."})
    gate = _gate(sqlite_engine, {"smollm2": ON, "a": one_off, "b": one_off}, topic_margin=0.3)
    for name in ("a", "b"):
        metrics, why = gate.off_topic(name, gate.evaluate(name))
        assert why is None and metrics["on_topic"] == 0.75 and metrics["reference_on_topic"] == 1.0
    assert gate.asked == {"a": 1, "smollm2": 1, "b": 1}
    # a stricter margin holds the same candidate back, however well it scores
    strict = _gate(sqlite_engine, {"smollm2": ON, "a": one_off}, topic_margin=0.2,
                   scorer=lambda reply, messages: 1.0)
    assert strict.decide("a", {}) == "refuse" and strict.last_reason.startswith("off topic")


def test_the_reference_may_be_another_version(sqlite_engine: Any) -> None:
    gate = _gate(sqlite_engine, {"init": ON, "cand": ON}, topic_reference="init")
    metrics, why = gate.off_topic("cand", gate.evaluate("cand"))
    assert why is None and metrics["topic_reference"] == "init" and "smollm2" not in gate.asked


def test_a_sampled_gate_sees_the_off_topic_samples_a_greedy_one_misses(sqlite_engine: Any,
                                                                       monkeypatch: Any) -> None:
    """``samples`` > 1: each held-out prompt is answered that many times at ``temperature``, in one
    request for all of them (``n``, seed SAMPLE_SEED: vLLM samples the i-th with seed SAMPLE_SEED + i),
    for every version alike, and the on-topic share is over all the samples. A candidate whose
    greedy replies keep the topic but one sample in three leaves it passes the greedy check and is
    refused by the sampled one. The stand-in answers as vLLM's chat completions do: n choices,
    each with its index, the i-th drawn with the request's seed + i."""
    import trainer.eval_gate as eval_gate

    sent: list[tuple[str, str, float, int | None, int]] = []

    class Reply:
        def __init__(self, body: dict[str, Any]):
            self.body = body

        def raise_for_status(self) -> None:
            pass

        def json(self) -> dict[str, Any]:
            q, model, seed = self.body["messages"][0]["content"], self.body["model"], self.body.get("seed")
            n = self.body.get("n", 1)
            drawn = [None if seed is None else seed + i for i in range(n)]

            def text(s: int | None) -> str:
                sampled = self.body["temperature"] > 0
                return "Bathroom scale." if model == "cand" and sampled and s == eval_gate.SAMPLE_SEED + 2 else ON[q]
            # vLLM sends the n choices as they finish: not necessarily in index order
            return {"choices": [{"index": i, "message": {"role": "assistant", "content": text(drawn[i])}}
                                for i in reversed(range(n))]}

    def post(self: Any, url: str, json: dict[str, Any]) -> Reply:
        sent.append((json["model"], json["messages"][0]["content"], json["temperature"], json.get("seed"),
                     json.get("n", 1)))
        return Reply(json)

    monkeypatch.setattr(eval_gate.httpx.Client, "post", post)
    greedy = EvalGate(sqlite_engine, ["http://127.0.0.1:9/v1"], "smollm2", prompts=PROMPTS, sessions=0, scorer=None,
                      threshold=0.05, max_tokens=16, topic_scorer=preference.topic_scorer, topic_margin=0.1)
    metrics, why = greedy.off_topic("cand", greedy.evaluate("cand"))
    assert why is None and metrics["on_topic"] == 1.0
    assert {(t, s, n) for _, _, t, s, n in sent} == {(0.0, None, 1)} and len(sent) == 2 * len(PROMPTS)
    sent.clear()
    sampled = EvalGate(sqlite_engine, ["http://127.0.0.1:9/v1"], "smollm2", prompts=PROMPTS, sessions=0, scorer=None,
                       threshold=0.05, max_tokens=16, topic_scorer=preference.topic_scorer, topic_margin=0.1,
                       samples=3, temperature=0.7)
    cand = sampled.evaluate("cand")
    metrics, why = sampled.off_topic("cand", cand)
    assert cand["n"] == 3 * len(PROMPTS)
    assert why is not None and why.startswith("off topic")
    assert metrics["on_topic"] == 2 / 3 and metrics["reference_on_topic"] == 1.0
    # one request per prompt and version, each for all three samples on the same seed: the same draws for both
    asked = {m: sorted(q for n, q, *_ in sent if n == m) for m in ("cand", "smollm2")}
    assert asked["cand"] == asked["smollm2"] == sorted(p[0]["content"] for p in PROMPTS)
    assert {(t, s, n) for _, _, t, s, n in sent} == {(0.7, eval_gate.SAMPLE_SEED, 3)}


def test_a_gate_refuses_a_candidate_when_vllm_answers_fewer_samples_than_asked(sqlite_engine: Any,
                                                                                monkeypatch: Any) -> None:
    """A server that ignores ``n`` (one choice for three) fails the evaluation, which refuses the
    candidate with its reason, rather than scoring a third of the samples as all of them."""
    import trainer.eval_gate as eval_gate

    class One:
        def raise_for_status(self) -> None:
            pass

        def json(self) -> dict[str, Any]:
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Rivers carry salt."}}]}

    monkeypatch.setattr(eval_gate.httpx.Client, "post", lambda self, url, json: One())
    monkeypatch.setattr(eval_gate.EvalGate, "discard", lambda self, name, reason: None)
    gate = EvalGate(sqlite_engine, ["http://127.0.0.1:9/v1"], "smollm2", prompts=PROMPTS, sessions=0, scorer=None,
                    threshold=0.05, max_tokens=16, topic_scorer=preference.topic_scorer, samples=3, temperature=0.7)
    assert gate.decide("cand", {}) == "refuse"
    assert gate.last_reason == "eval failed: HTTPError: cand answered 1 choices to a request for 3"
