"""How far a round moved the policy, measured on the round's own sampled tokens.

After a round's updates, one no-grad pass of the candidate and one of the base policy (the same
LoRA model with its adapter switched off: no second model) over the round's samples give:

- ``drift_kl_k1`` = mean(log π_candidate − log π_base) and ``drift_kl_k3`` = mean(exp(r) − r − 1),
  r = log π_base − log π_candidate (veRL's ``low_var_kl``), per reply token: two estimates of
  KL(π_candidate ‖ π_base) from tokens the serving policy sampled (k3 ≥ 0 per token, lower variance;
  k1 unbiased only on the candidate's own samples);
- ``entropy_behaviour`` = −mean log π_behaviour: the serving policy's per-token entropy, estimated
  on its own samples from the log-probs vLLM captured (unbiased; where a sample has none, the
  candidate's log-prob stands in), and ``entropy_candidate`` = −mean log π_candidate on them;
- with the teacher's top-k (top-k OPD), per reply position: ``teacher_topk_mass`` Σ_i p_i of the
  teacher's k tokens (1 − its tail), ``student_topk_mass`` the candidate's Σ_i q_i on them, and
  ``sampled_in_topk`` the share of sampled tokens among them.

Full fine-tuning has no base to switch to: then only the entropies and top-k masses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.local import LocalTrainer
from trainer.objectives import kl_to_base
from trainer.samples import Sample

#: the metrics :func:`round_drift` may return
KEYS = ("drift_kl_k1", "drift_kl_k3", "entropy_behaviour", "entropy_candidate", "teacher_topk_mass",
        "student_topk_mass", "sampled_in_topk")


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    pads = [(0, width - r.shape[1]) if r.dim() == 2 else (0, 0, 0, width - r.shape[1]) for r in rows]
    return torch.cat([torch.nn.functional.pad(r.float().cpu(), p) for r, p in zip(rows, pads, strict=True)])


def _passes(trainer: LocalTrainer, samples: Sequence[Sample], topk_ids: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Candidate log-probs, mask, base log-probs (None without LoRA), the candidate's log-probs
    of the teacher's top-k ids (None without them), a micro-batch at a time, on the CPU."""
    width = max(len(s.response_ids) for s in samples)
    logp, masks, base, extra = [], [], [], []
    with torch.no_grad():
        for lo in range(0, len(samples), trainer.micro_batch_size):
            part = samples[lo: lo + trainer.micro_batch_size]
            if topk_ids is not None:
                lp, mask, ex = trainer.response_and_extra_logprobs(part, topk_ids[lo: lo + len(part)])
                extra.append(ex)
            else:
                lp, mask = trainer.response_logprobs(part)
            logp.append(lp)
            masks.append(mask)
            if trainer.cfg.lora:
                base.append(trainer.response_logprobs(part, adapter=False)[0])
    return (_padded(logp, width), _padded(masks, width), _padded(base, width) if base else None,
            _padded(extra, width) if extra else None)


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = float(mask.sum())
    return float((values * mask).sum()) / n if n else math.nan


def round_drift(trainer: LocalTrainer, samples: Sequence[Sample]) -> dict[str, float]:
    """The module docstring's metrics for the trainer's weights now (the round's candidate) on
    *samples* (the round's). Masked tokens (redacted text) do not count."""
    samples = list(samples)
    if not samples:
        return {}
    topk = LocalTrainer._topk(samples)
    logp, mask, base, extra = _passes(trainer, samples, topk[0] if topk is not None else None)
    out: dict[str, float] = {}
    if base is not None:
        out["drift_kl_k1"] = _mean(logp - base, mask)
        out["drift_kl_k3"] = _mean(kl_to_base(logp, base), mask)
    behaviour = logp.clone()
    for i, s in enumerate(samples):
        if s.behaviour_logprobs is not None:
            n = min(len(s.behaviour_logprobs), behaviour.shape[1])
            behaviour[i, :n] = torch.tensor(s.behaviour_logprobs[:n], dtype=behaviour.dtype)
    out["entropy_behaviour"] = _mean(-behaviour, mask)
    out["entropy_candidate"] = _mean(-logp, mask)
    if topk is not None and extra is not None:
        ids, lps, valid, rows = topk
        width = mask.shape[1]
        at = mask * rows[:, None].float()  # reply positions of samples with the teacher's top-k
        valid = valid[:, :width]
        out["teacher_topk_mass"] = _mean((lps[:, :width].exp() * valid).sum(-1), at)
        out["student_topk_mass"] = _mean((extra.exp() * valid).sum(-1), at)
        sampled = torch.zeros_like(mask, dtype=torch.long)
        for i, s in enumerate(samples):
            sampled[i, : len(s.response_ids)] = torch.tensor(s.response_ids[:width])
        hit = ((ids[:, :width] == sampled[..., None]) & valid).any(-1)
        out["sampled_in_topk"] = _mean(hit.float(), at)
    return out
