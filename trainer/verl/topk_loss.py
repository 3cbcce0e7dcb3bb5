"""Top-k OPD's loss inside veRL's FSDP actor: the logits processor and the loss function the
engine calls for a batch marked ``distillation_use_topk``, and the counts it is averaged over."""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from trainer import objectives
from trainer.verl.batch import TOPK_ABSENT


def topk_batch_info(batch: Any) -> dict[str, int]:
    """What the top-k term is averaged over, counted over a whole step's batch (one mini-batch:
    ``build_config``), as the local backend averages it: ``topk_num_tokens`` (its positions:
    ``topk_mask``) and ``topk_num_seqs`` (the samples that have any). veRL's own counts are of
    every response token and sample, which would shrink the term when some samples lack top-k."""
    mask = batch["topk_mask"]
    return {"topk_num_tokens": int(mask.sum()), "topk_num_seqs": int((mask.sum(-1) > 0).sum())}


def _topk_kl_from_logits(student_logits: torch.Tensor, data: Any, tail: bool) -> torch.Tensor:
    """Per packed position, :func:`objectives.topk_opd_kl` of the student's log-probs of the
    teacher's top-k tokens (gathered from *student_logits*, ``(1, nnz, V)``, already divided by
    the temperature) against the teacher's: ``(1, nnz)``, 0 where the position has none."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    ids, lps = data["teacher_ids"], data["teacher_logprobs"]
    ids = ids.values().unsqueeze(0) if ids.is_nested else ids
    lps = lps.values().unsqueeze(0) if lps.is_nested else lps
    if get_ulysses_sequence_parallel_world_size() > 1:  # this rank's slice of the sequence, as veRL's own
        ids, lps = slice_input_tensor(ids, dim=1), slice_input_tensor(lps, dim=1)
    if ids.shape[:2] != student_logits.shape[:2]:
        raise ValueError(f"top-k OPD: teacher top-k for {ids.shape[1]} positions, logits for {student_logits.shape[1]}")
    logits = student_logits.float()
    logp = logits.gather(-1, ids.to(logits.device)) - torch.logsumexp(logits, -1, keepdim=True)
    lps = lps.to(logits.device)
    return objectives.topk_opd_kl(logp, lps, lps > TOPK_ABSENT / 2, tail=tail)


def topk_opd_loss(config: Any, model_output: dict[str, Any] | None = None, data: Any = None, dp_group: Any = None,
                  *, w_opd: float, tail: bool = True, student_logits: torch.Tensor | None = None,
                  data_format: str = "thd") -> Any:
    """The actor's loss function for top-k OPD (``PoolActorWorker`` sets it in place of veRL's
    ``ppo_loss``), called the two ways veRL's FSDP engine calls a distillation loss:

    - with ``student_logits`` (the micro-batch's logits, ``(1, nnz, V)``, when the batch is marked
      ``distillation_use_topk``): as its logits processor, returning ``{"topk_opd_kl": (1, nnz)}``,
      the per-position KL(q ‖ p) of :func:`objectives.topk_opd_kl`, which the engine hands back in
      ``model_output``;
    - otherwise as the loss: veRL's ``ppo_loss`` (the clipped surrogate on the advantages) plus
      ``w_opd · agg(topk_opd_kl)`` over ``topk_mask``, aggregated by the actor's
      ``loss_agg_mode`` over the step's top-k positions (:func:`topk_batch_info`) — the local
      backend's ``objectives.compute_loss`` with its ``topk_*`` arguments, term for term. Adds
      the metric ``actor/topk_kl`` (the aggregated term, before w_opd).
    """
    if student_logits is not None:
        return {"topk_opd_kl": _topk_kl_from_logits(student_logits, data, tail)}
    assert model_output is not None and data is not None
    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    if "topk_opd_kl" not in model_output or "topk_mask" not in data.keys():
        return loss, metrics
    kl = no_padding_2_padding(model_output["topk_opd_kl"], data)
    mask = data["topk_mask"]
    if mask.is_nested:
        mask = mask.to_padded_tensor(0.0)
    mask = mask[:, : kl.shape[1]].to(device=kl.device, dtype=torch.bool)
    info = dict(config.global_batch_info)
    tokens = tu.get_non_tensor_data(data=data, key="topk_num_tokens", default=None)
    seqs = tu.get_non_tensor_data(data=data, key="topk_num_seqs", default=None)
    if tokens is not None:
        info["batch_num_tokens"] = max(int(tokens), 1)
    if seqs is not None:
        info["global_batch_size"] = max(int(seqs), 1)
    topk = agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info)
    metrics["actor/topk_kl"] = Metric(value=topk, aggregation=metrics["actor/pg_loss"].aggregation)
    return loss + w_opd * topk, metrics
