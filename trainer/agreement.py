"""Train/serve agreement: does the model server serve the policy the trainer trained?

After a version is published, a sample of the round's sampled tokens is scored twice: by the
trainer's own model (the policy it just saved) and by a model server through the published
version (vLLM's ``prompt_logprobs`` over prompt + response). When the served version *is* the
trained policy, the two log-probs of each token agree to the kernels' numerical noise (bf16 on
a GPU: a few thousandths of a nat on average). A mismatch in LoRA scaling (``lora_alpha``),
target modules, the chat template or the weights loaded shows here first, as a gap of tenths of
a nat, before any learning curve could show it.

The numbers, per version, go on its ``publish`` event (``datapool.versions.add_event_metrics``)
and so onto the training page:

- ``train_serve_mean_abs`` / ``train_serve_max_abs``: mean and max |log π_serve − log π_train|
  over the scored response tokens, in nats;
- ``train_serve_kl``: the k3 estimate of KL(π_train ‖ π_serve) on those tokens,
  mean(r − 1 − log r) with r = π_serve / π_train (non-negative; veRL's ``low_var_kl``). The tokens
  were sampled by the version before, not by the trained policy, so it is a diagnostic, not an
  unbiased KL;
- ``train_serve_tokens``, ``train_serve_samples``: how much was scored.

``MAX_MEAN_ABS`` is the agreement a healthy publish keeps (0.02 nats); :func:`measure` logs a
warning above it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
import torch

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from base.vocab import PolicyAction
from datapool import versions
from datapool.models import TrainingStep
from trainer.samples import Sample, load_samples
from vllm_client.http import CallError
from vllm_client.sampling import score_from_ids

log = logging.getLogger("nextstate.trainer")

MAX_MEAN_ABS = 0.02
"""Mean |Δ log-prob| (nats) above which a published version is not the policy that was trained."""


class ScoresTokens(Protocol):
    tokenizer: Any

    def response_logprobs(self, samples: Sequence[Sample], *, adapter: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor]: ...


def trained_logprobs(trainer: ScoresTokens, samples: Sequence[Sample]) -> list[list[float]]:
    """The trainer's log-prob of each response token of each sample (no gradients)."""
    with torch.no_grad():
        logprobs, _ = trainer.response_logprobs(samples)  # (batch, longest response), left-aligned
    return [logprobs[i, : len(sample.response_ids)].float().tolist() for i, sample in enumerate(samples)]


async def served_logprobs(api_base: str, model: str, samples: Sequence[Sample], *, api_key: str | None = None,
                          timeout_s: float = 120.0, concurrency: int = 4) -> list[list[float]]:
    """The log-prob of each response token of each sample under *model* on the vLLM at *api_base*."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        async def one(sample: Sample) -> list[float]:
            async with gate:
                return await score_from_ids(http, api_base, model, sample.prompt_ids, sample.response_ids,
                                            api_key=api_key)
        return list(await asyncio.gather(*(one(s) for s in samples)))


def compare(train: Sequence[Sequence[float]], serve: Sequence[Sequence[float]]) -> dict[str, float]:
    """The agreement metrics of two sets of per-token log-probs of the same tokens."""
    deltas = [s - t for tr, sv in zip(train, serve, strict=True) for t, s in zip(tr, sv, strict=True)]
    if not deltas:
        raise ValueError("no tokens to compare")
    # k3 with log r = delta: expm1 keeps small deltas exact, the clamp keeps one wild token from
    # overflowing exp, and max() drops the last rounding below the true value's floor of 0
    k3 = [max(0.0, math.expm1(min(d, 30.0)) - d) for d in deltas]
    return {"train_serve_mean_abs": sum(abs(d) for d in deltas) / len(deltas),
            "train_serve_max_abs": max(abs(d) for d in deltas),
            "train_serve_kl": sum(k3) / len(k3),
            "train_serve_tokens": float(len(deltas)),
            "train_serve_samples": float(len(train))}


def choose(samples: Sequence[Sample], k: int, *, seed: int = 0, max_tokens: int = 4096) -> list[Sample]:
    """Up to *k* samples that have a prompt and a response, fit *max_tokens* and have no redacted
    position (the trainer gives those no log-prob), drawn reproducibly."""
    usable = [s for s in samples if s.prompt_ids and s.response_ids and not s.masked
              and len(s.prompt_ids) + len(s.response_ids) < max_tokens]
    return random.Random(seed).sample(usable, min(k, len(usable)))


def measure(trainer: ScoresTokens, samples: Sequence[Sample], api_base: str, model: str, *, k: int = 8,
            api_key: str | None = None, timeout_s: float = 120.0, seed: int = 0) -> dict[str, Any]:
    """Score up to *k* of *samples* with the trainer and with *model* served at *api_base* (…/v1),
    and compare (the metrics in this module's docstring; empty when no sample is usable)."""
    chosen = choose(samples, k, seed=seed)
    if not chosen:
        return {}
    train = trained_logprobs(trainer, chosen)
    serve = asyncio.run(served_logprobs(api_base, model, chosen, api_key=api_key, timeout_s=timeout_s))
    metrics = compare(train, serve)
    if metrics["train_serve_mean_abs"] > MAX_MEAN_ABS:
        log.warning("version %s on %s is not the policy that was trained: mean |Δ log-prob| %.4f nats "
                    "(max %.3f) over %d tokens (healthy: <= %.2f); check the adapter's scaling, target "
                    "modules and chat template", model, api_base, metrics["train_serve_mean_abs"],
                    metrics["train_serve_max_abs"], int(metrics["train_serve_tokens"]), MAX_MEAN_ABS)
    return metrics


def trained_turns(engine: Engine, run_id: str) -> list[str]:
    """The turns run *run_id* trained on, in step order (each step's ``turn_ids``)."""
    with OrmSession(engine) as db:
        steps = db.scalars(select(TrainingStep.metrics).where(TrainingStep.run_id == run_id)
                           .order_by(TrainingStep.step, TrainingStep.id)).all()
    return [tid for metrics in steps for tid in (metrics or {}).get("turn_ids") or []]


def check_published(engine: Engine, trainer: ScoresTokens, name: str, api_base: str, *, run_id: str | None = None,
                    samples: Sequence[Sample] | None = None, k: int = 8, api_key: str | None = None,
                    timeout_s: float = 120.0) -> dict[str, Any]:
    """After version *name* was published from *trainer*: :func:`measure` on *samples* (or on up to
    *k* of the turns run *run_id* trained on) and record the metrics on the version's publish event.
    Never raises for a server that cannot answer: the metrics then say why (``train_serve_error``)."""
    try:
        if samples is None:
            trained = trained_turns(engine, run_id or "")
            ids = random.Random(0).sample(trained, min(4 * k, len(trained)))
            with OrmSession(engine) as db:
                samples = load_samples(db, ids, trainer.tokenizer)
        metrics: dict[str, Any] = measure(trainer, samples, api_base, name, k=k, api_key=api_key, timeout_s=timeout_s)
    except (CallError, httpx.HTTPError, OSError, ValueError) as exc:
        log.warning("could not check that %s serves the trained policy: %s", name, exc)
        metrics = {"train_serve_error": f"{type(exc).__name__}: {exc}"[:300]}
    if metrics:
        versions.add_event_metrics(engine, name, PolicyAction.PUBLISH, metrics)
    return metrics
