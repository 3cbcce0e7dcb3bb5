"""The online loop's eval gate: a candidate version and the active one answer the held-out prompts;
a candidate scoring more than ``eval_threshold`` below the active one is refused (unloaded,
marked ``refused``), otherwise it is promoted. Every decision is a ``policy_events`` row."""

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

def _chat(http: httpx.Client, url: str, model: str, messages: list[dict[str, Any]], max_tokens: int) -> str:
    resp = http.post(f"{url}/chat/completions", json={"model": model, "messages": messages,
                                                      "temperature": 0, "max_tokens": max_tokens})
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"].get("content") or ""


class EvalGate:
    """Decides about candidates of one online run (see the module docstring)."""

    def __init__(self, engine: Engine, urls: Sequence[str], base_model: str, *,
                 prompts: Sequence[list[dict[str, Any]]], sessions: int, scorer: Scorer | None,
                 threshold: float, max_tokens: int):
        self.engine = engine
        self.urls = list(urls)
        self.base_model = base_model
        self.prompts = list(prompts)
        self.sessions = sessions
        self.scorer = scorer
        self.threshold = threshold
        self.max_tokens = max_tokens
        self._cache: dict[str, float] = {}  # version -> held-out score

    def eval_prompts(self) -> list[list[dict[str, Any]]]:
        """The held-out prompts: the configured ones, then the newest eval sessions' first prompts."""
        prompts = list(self.prompts)
        if self.sessions:
            with OrmSession(self.engine) as db:
                prompts += queries.eval_session_prompts(db, self.sessions)
        return prompts

    def evaluate(self, model: str) -> dict[str, Any]:
        """The version's mean score on the held-out prompts (greedy, on the first vLLM); each
        reply and its score is stored (``eval_replies``)."""
        prompts = self.eval_prompts()
        assert self.scorer is not None
        with httpx.Client(timeout=300) as http, ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda m: _chat(http, self.urls[0], model, m, self.max_tokens), prompts))
        scores = [float(self.scorer(r, m)) for r, m in zip(replies, prompts)]
        # kept for the admin UI's version-vs-version page (the replies side by side)
        evals.record_replies(self.engine, model, prompts, replies, scores)
        return {"score": sum(scores) / len(scores), "n": len(scores)}

    def discard(self, name: str, reason: str) -> None:
        """Refuse candidate *name*: marked refused, unloaded from every vLLM, the reason recorded."""
        versions.refuse_candidate(self.engine, name)
        with httpx.Client(timeout=30) as http:
            unload(http, self.urls, name)
        versions.record_event(self.engine, PolicyAction.REFUSE, version=name, actor="trainer", reason=reason)

    def decide(self, name: str, stats: dict[str, Any]) -> str:
        """Promote the candidate or refuse it; returns "promote" or "refuse"."""
        active = versions.active_row(self.engine)
        current = active.name if active else self.base_model
        metrics: dict[str, Any] = {"against": current}
        if self.scorer is not None and self.eval_prompts():
            try:
                if current not in self._cache:
                    self._cache[current] = self.evaluate(current)["score"]
                cand = self.evaluate(name)
            except httpx.HTTPError as exc:
                self.discard(name, f"eval failed: {type(exc).__name__}: {exc}")
                return PolicyAction.REFUSE
            metrics |= {"score": cand["score"], "active_score": self._cache[current], "n": cand["n"],
                        "threshold": self.threshold}
            versions.record_event(self.engine, PolicyAction.EVAL, version=name, actor="eval-gate", metrics=metrics)
            if cand["score"] < self._cache[current] - self.threshold:
                self.discard(name, f"held-out score {cand['score']:.3f} < {current} "
                                   f"{self._cache[current]:.3f} - {self.threshold}")
                log.info("refused %s: held-out %.3f vs %.3f", name, cand["score"], self._cache[current])
                return PolicyAction.REFUSE
            self._cache[name] = cand["score"]
            reason = f"held-out score {cand['score']:.3f} vs {current} {self._cache[current]:.3f}"
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
