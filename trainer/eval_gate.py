"""The online loop's eval gate: a candidate version and the active one answer the held-out prompts;
a candidate scoring more than ``eval_threshold`` below the active one is refused (unloaded,
marked ``refused``), otherwise it is promoted. Every decision is a ``policy_events`` row.

The replies are greedy by default; with ``samples`` > 1 each prompt is answered that many times at
``temperature``, every version on the same seeds. A user is served sampled replies, and a greedy
check passed candidates whose sampled replies left the topic (GPU runs: a candidate passing 24
greedy prompts, its sampled held-out replies 0.86 on topic against the base's 0.98).

The topicality check (``topic_scorer``) holds back a candidate that drifted off what it is asked:
its share of on-topic replies to the same prompts more than ``topic_margin`` below the reference
version's (the base model by default, evaluated once) refuses it, whatever its score. The
refusal's reason says which check held it back (the training page shows it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool import evals, queries, versions
from publishing import publish
from vllm_client.adapters import unload
from datapool.db import utcnow
from base.vocab import PolicyAction
from trainer.config import Scorer

log = logging.getLogger("nextstate.online")

#: the seed of a held-out prompt's i-th sample is SAMPLE_SEED + i, for every version alike: a
#: candidate and its reference are compared on the same draws
SAMPLE_SEED = 1000


def _chat(http: httpx.Client, url: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
          temperature: float = 0.0, seed: int | None = None, n: int = 1) -> list[str]:
    """The *n* replies of one chat completion request. With a *seed*, vLLM samples the i-th of
    the n with seed *seed* + i (``vllm/v1/engine/parallel_sampling.py``): the draws of n requests
    with those seeds (up to vLLM's numerics in another batch), their prompt read once."""
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
    if seed is not None:
        body["seed"] = seed
    if n > 1:
        body["n"] = n
    resp = http.post(f"{url}/chat/completions", json=body)
    resp.raise_for_status()
    choices = sorted(resp.json()["choices"], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise httpx.HTTPError(f"{model} answered {len(choices)} choices to a request for {n}")
    return [c["message"].get("content") or "" for c in choices]


class EvalGate:
    """Decides about candidates of one online run (see the module docstring)."""

    def __init__(self, engine: Engine, urls: Sequence[str], base_model: str, *,
                 prompts: Sequence[list[dict[str, Any]]], sessions: int, scorer: Scorer | None,
                 threshold: float, max_tokens: int, topic_scorer: Scorer | None = None,
                 topic_margin: float = 0.05, topic_reference: str | None = None, samples: int = 1,
                 temperature: float = 0.0):
        self.engine = engine
        self.urls = list(urls)
        self.base_model = base_model
        self.prompts = list(prompts)
        self.sessions = sessions
        self.scorer = scorer
        self.threshold = threshold
        self.max_tokens = max_tokens
        self.topic_scorer = topic_scorer
        self.topic_margin = topic_margin
        self.topic_reference = topic_reference or base_model
        #: replies per held-out prompt, sampled at *temperature* (1 at 0: the greedy reply)
        self.samples = samples
        self.temperature = temperature
        self._cache: dict[str, float] = {}  # version -> held-out score
        self._topic: dict[str, float] = {}  # version -> held-out on-topic share
        #: why the last candidate :meth:`decide` saw was refused (None: promoted)
        self.last_reason: str | None = None

    def eval_prompts(self) -> list[list[dict[str, Any]]]:
        """The held-out prompts: the configured ones, then the newest eval sessions' first prompts."""
        prompts = list(self.prompts)
        if self.sessions:
            with OrmSession(self.engine) as db:
                prompts += queries.eval_session_prompts(db, self.sessions)
        return prompts

    def per_sample(self, prompts: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
        """*prompts* in the order of :meth:`answer`'s replies to them: each :attr:`samples` times in a row."""
        return [p for p in prompts for _ in range(self.samples)]

    def answer(self, model: str, prompts: list[list[dict[str, Any]]]) -> list[str]:
        """The version's replies to *prompts* (on the first vLLM), :attr:`samples` a prompt in a row
        (:meth:`per_sample`'s order): greedy, or sampled at :attr:`temperature`, the i-th sample of
        each prompt with seed SAMPLE_SEED + i. A prompt's samples are one request (``n``), 8 requests
        at a time: a sampled gate sends as many requests as a greedy one."""
        seed = SAMPLE_SEED if self.temperature > 0 else None
        with httpx.Client(timeout=300) as http, ThreadPoolExecutor(8) as pool:
            replies = pool.map(lambda m: _chat(http, self.urls[0], model, m, self.max_tokens, self.temperature,
                                               seed, self.samples), prompts)
            return [reply for group in replies for reply in group]

    def evaluate(self, model: str) -> dict[str, Any]:
        """The version's mean score on the held-out prompts (:meth:`answer`'s replies, each prompt
        :attr:`samples` times) and, with a topic scorer, its on-topic share (``on_topic``); each
        reply and its score is stored (``eval_replies``)."""
        asked = self.eval_prompts()
        replies, prompts = self.answer(model, asked), self.per_sample(asked)
        out: dict[str, Any] = {"n": len(replies)}
        if self.topic_scorer is not None:
            out["on_topic"] = sum(float(self.topic_scorer(r, m)) for r, m in zip(replies, prompts)) / len(replies)
            self._topic[model] = out["on_topic"]
        if self.scorer is not None:
            scores = [float(self.scorer(r, m)) for r, m in zip(replies, prompts)]
            # kept for the admin UI's version-vs-version page (the replies side by side)
            evals.record_replies(self.engine, model, prompts, replies, scores)
            out["score"] = sum(scores) / len(scores)
        return out

    def off_topic(self, name: str, cand: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The topicality check of candidate *name* (evaluated as *cand*): its metrics, and the
        reason to refuse it when its on-topic share is more than the margin below the reference's."""
        if self.topic_scorer is None:
            return {}, None
        ref = self.topic_reference
        if ref not in self._topic:
            self.evaluate(ref)
        got, want = cand["on_topic"], self._topic[ref]
        metrics = {"on_topic": got, "reference_on_topic": want, "topic_reference": ref,
                   "topic_margin": self.topic_margin}
        if got < want - self.topic_margin:
            return metrics, (f"off topic: held-out on-topic share {got:.3f} < {ref} {want:.3f} - "
                             f"{self.topic_margin}")
        return metrics, None

    def refuse(self, name: str, reason: str) -> str:
        """:meth:`discard` a candidate :meth:`decide` refused, its reason kept in :attr:`last_reason`."""
        self.discard(name, reason)
        self.last_reason = reason
        log.info("refused %s: %s", name, reason)
        return PolicyAction.REFUSE

    def discard(self, name: str, reason: str) -> None:
        """Refuse candidate *name*: marked refused, unloaded from every vLLM, the reason recorded."""
        versions.refuse_candidate(self.engine, name)
        with httpx.Client(timeout=30) as http:
            unload(http, self.urls, name)
        versions.record_event(self.engine, PolicyAction.REFUSE, version=name, actor="trainer", reason=reason)

    def decide(self, name: str, stats: dict[str, Any]) -> str:
        """Promote the candidate or refuse it; returns "promote" or "refuse" (the reason of a
        refusal in :attr:`last_reason`)."""
        active = versions.active_row(self.engine)
        current = active.name if active else self.base_model
        metrics: dict[str, Any] = {"against": current}
        self.last_reason = None
        if (self.scorer is not None or self.topic_scorer is not None) and self.eval_prompts():
            try:
                if self.scorer is not None and current not in self._cache:
                    self._cache[current] = self.evaluate(current)["score"]
                cand = self.evaluate(name)
                topic, why = self.off_topic(name, cand)
            except httpx.HTTPError as exc:
                return self.refuse(name, f"eval failed: {type(exc).__name__}: {exc}")
            metrics |= topic
            if self.scorer is not None:
                metrics |= {"score": cand["score"], "active_score": self._cache[current], "n": cand["n"],
                            "threshold": self.threshold}
            versions.record_event(self.engine, PolicyAction.EVAL, version=name, actor="eval-gate", metrics=metrics)
            if why is None and self.scorer is not None and cand["score"] < self._cache[current] - self.threshold:
                why = (f"held-out score {cand['score']:.3f} < {current} {self._cache[current]:.3f} - "
                       f"{self.threshold}")
            if why is not None:
                return self.refuse(name, why)
            if self.scorer is not None:
                self._cache[name] = cand["score"]
                reason = f"held-out score {cand['score']:.3f} vs {current} {self._cache[current]:.3f}"
            else:
                reason = f"held-out on-topic share {cand['on_topic']:.3f} vs {metrics['reference_on_topic']:.3f}"
        else:
            reason = "no held-out set configured: promoted without an eval"
        # learning latency: from a turn being scored to a version trained on it serving (the
        # alias flips at the end of activate; the adapter load before it dominates)
        started = utcnow()
        publish.activate(self.engine, name, self.urls, actor="eval-gate", reason=reason, event_metrics=metrics)
        now = utcnow()
        latencies = [(now - datetime.fromisoformat(t)).total_seconds() for t in (stats.get("scored_at") or {}).values()]
        if latencies:
            versions.add_event_metrics(self.engine, name, PolicyAction.PROMOTE, {
                "learning_latency_s_min": min(latencies), "learning_latency_s_max": max(latencies),
                "learning_latency_s_mean": sum(latencies) / len(latencies),
                "activate_s": (now - started).total_seconds()})
        log.info("promoted %s (%s)", name, reason)
        return PolicyAction.PROMOTE
