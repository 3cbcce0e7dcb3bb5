"""Pool samples as veRL's batch (``DataProto``) and the advantages veRL's actor update reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from verl import DataProto

from trainer import objectives
from trainer.samples import Sample

#: A top-k entry that is no token (a position with fewer than K, or none): its teacher log-prob.
TOPK_ABSENT = -1e9


def samples_to_batch(samples: Sequence[Sample], pad_token_id: int) -> DataProto:
    """veRL's batch for these samples, in its left/right padding layout.

    Tensors (``B`` samples, ``P`` the longest prompt, ``R`` the longest response):
    ``prompts`` (B, P) left-padded, ``responses`` (B, R) right-padded, ``input_ids`` =
    prompts ‖ responses, ``attention_mask`` and ``position_ids`` over it, ``response_mask``
    (B, R), ``rollout_log_probs`` (B, R: vLLM's captured behaviour logprobs, 0 where a turn has
    none), ``teacher_log_probs`` (B, R: 0 where none) and ``token_level_scores`` (B, R: the
    reward on the last response token, :func:`objectives.scores_to_token_rewards`).
    Non-tensors: ``uid`` (the GRPO group: the session's task group, else the turn), ``turn_id``,
    ``session_id``, ``step_index``, ``has_behaviour``, ``has_teacher``, ``has_group``, ``has_topk``.

    When any sample carries the teacher's top-k (top-k OPD), also ``teacher_ids`` and
    ``teacher_logprobs`` (B, P + R, K: the largest k) in veRL's distillation layout — over the
    whole padded sequence, column j holding the top-k for the token at j + 1, so the response
    token t of a prompt of P columns is at P − 1 + t; entries that are no token have log-prob
    :data:`TOPK_ABSENT` — and ``topk_mask`` (B, R: the response mask of the samples that have
    them). ``left_right_2_no_padding`` packs the first two as veRL's FSDP engine expects.
    """
    if not samples:
        raise ValueError("an empty batch")
    for s in samples:
        if not s.prompt_ids or not s.response_ids:
            raise ValueError(f"turn {s.turn_id} has an empty prompt or response")
    n = len(samples)
    p_len = max(len(s.prompt_ids) for s in samples)
    r_len = max(len(s.response_ids) for s in samples)
    prompts = torch.full((n, p_len), pad_token_id, dtype=torch.long)
    responses = torch.full((n, r_len), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, p_len + r_len), dtype=torch.long)
    response_mask = torch.zeros((n, r_len), dtype=torch.float32)
    behaviour = torch.zeros((n, r_len), dtype=torch.float32)
    teacher = torch.zeros((n, r_len), dtype=torch.float32)
    for i, s in enumerate(samples):
        lp, lr = len(s.prompt_ids), len(s.response_ids)
        prompts[i, p_len - lp:] = torch.tensor(s.prompt_ids)
        responses[i, :lr] = torch.tensor(s.response_ids)
        attention[i, p_len - lp: p_len + lr] = 1
        response_mask[i, :lr] = torch.tensor(s.loss_weights())
        if s.behaviour_logprobs is not None:
            behaviour[i, :lr] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if s.teacher_logprobs is not None:
            teacher[i, :lr] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    position_ids = torch.clamp(torch.cumsum(attention, dim=-1) - 1, min=0)
    scores = objectives.scores_to_token_rewards(objectives.sample_rewards(samples), response_mask)
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention, "position_ids": position_ids, "response_mask": response_mask,
        "rollout_log_probs": behaviour, "teacher_log_probs": teacher, "token_level_scores": scores,
    }
    has_topk = [s.teacher_topk_ids is not None and s.teacher_topk_logprobs is not None for s in samples]
    if any(has_topk):
        tensors |= _topk_tensors(samples, has_topk, p_len, response_mask)
    return DataProto.from_dict(tensors=tensors, non_tensors=_non_tensors(samples, has_topk),
                               meta_info={"global_token_num": attention.sum(-1).tolist()})



def _topk_tensors(samples: Sequence[Sample], has_topk: list[bool], p_len: int,
                  response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``teacher_ids``, ``teacher_logprobs`` and ``topk_mask`` of :func:`samples_to_batch`."""
    n, r_len = response_mask.shape
    k = max(len(x) for s, h in zip(samples, has_topk, strict=True) if h for x in s.teacher_topk_ids or [[]])
    top_ids = torch.zeros((n, p_len + r_len, max(k, 1)), dtype=torch.long)
    top_lps = torch.full((n, p_len + r_len, max(k, 1)), TOPK_ABSENT, dtype=torch.float32)
    for i, s in enumerate(samples):
        if not has_topk[i]:
            continue
        for t, (tok, lp) in enumerate(zip(s.teacher_topk_ids or [], s.teacher_topk_logprobs or [], strict=True)):
            if t >= len(s.response_ids):
                break
            top_ids[i, p_len - 1 + t, : len(tok)] = torch.tensor(tok, dtype=torch.long)
            top_lps[i, p_len - 1 + t, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return {"teacher_ids": top_ids, "teacher_logprobs": top_lps,
            "topk_mask": response_mask * torch.tensor(has_topk, dtype=torch.float32)[:, None]}


def _non_tensors(samples: Sequence[Sample], has_topk: list[bool]) -> dict[str, np.ndarray]:
    """The non-tensor columns of :func:`samples_to_batch`, one entry a sample."""
    uid = np.array([s.group_id if s.group_id is not None else f"turn:{s.turn_id}" for s in samples], dtype=object)
    return {
        "uid": uid,
        "turn_id": np.array([s.turn_id for s in samples], dtype=object),
        "session_id": np.array([s.session_id for s in samples], dtype=object),
        "step_index": np.array([s.step_index for s in samples], dtype=np.int64),
        "has_behaviour": np.array([s.behaviour_logprobs is not None for s in samples], dtype=bool),
        "has_teacher": np.array([s.teacher_logprobs is not None for s in samples], dtype=bool),
        "has_group": np.array([s.group_id is not None for s in samples], dtype=bool),
        "has_topk": np.array(has_topk, dtype=bool),
    }


def add_advantages(batch: DataProto, cfg: objectives.ObjectiveConfig) -> DataProto:
    """Advantages for a batch whose ``old_log_probs`` hold the current policy's log-probs
    (veRL's actor recomputes them), exactly as ``LocalTrainer.step`` computes them.

    Then ``old_log_probs`` becomes π_behaviour, what veRL's PPO ratio divides by: vLLM's
    captured logprobs where the turn has them (the exact importance ratio), else the current
    policy's (black-box turns: ratio 1). Adds ``advantages``, ``returns`` and
    ``token_level_rewards`` (= ``token_level_scores``; no KL in the reward)."""
    t = batch.batch
    mask = t["response_mask"].to(torch.float32)
    student = t["old_log_probs"].to(torch.float32)
    has_behaviour = torch.as_tensor(batch.non_tensor_batch["has_behaviour"], device=student.device)
    t["current_log_probs"] = student
    t["old_log_probs"] = torch.where(has_behaviour[:, None], t["rollout_log_probs"].to(torch.float32), student)
    teacher = teacher_mask = None
    if cfg.objective != "rl":
        has_teacher = torch.as_tensor(batch.non_tensor_batch["has_teacher"], device=student.device)
        teacher = torch.where(has_teacher[:, None], t["teacher_log_probs"].to(torch.float32), student)
        if cfg.opd_topk:  # a sample distilled on the teacher's top-k takes no sampled-token OPD advantage
            has_teacher = has_teacher & ~torch.as_tensor(batch.non_tensor_batch["has_topk"], device=student.device)
        teacher_mask = has_teacher.to(torch.float32)[:, None] * mask
    t["token_level_rewards"] = t["token_level_scores"]
    has_group = batch.non_tensor_batch["has_group"]
    index = ([g if h else None for g, h in zip(batch.non_tensor_batch["uid"], has_group, strict=True)]
             if cfg.grpo and bool(np.any(has_group)) else None)
    adv = objectives.compute_advantages(cfg, response_mask=mask, token_level_rewards=t["token_level_scores"],
                                        index=index, teacher_log_prob=teacher, student_log_prob=student,
                                        teacher_mask=teacher_mask)
    t["advantages"] = adv
    t["returns"] = adv
    return batch
