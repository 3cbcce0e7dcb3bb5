"""Teacher logprobs for hindsight on-policy distillation (OPD).

For a hinted turn, the teacher is the policy itself under an enhanced context: the turn's own
request messages with the hint appended to the last user message. The teacher logprob of each
response token ``a_t`` is ``log pi(a_t | s + hint, a_<t)``, obtained exactly (no sampling, no
re-tokenization of the response) by asking vLLM for ``prompt_logprobs`` over
``teacher_prompt_ids + response_token_ids``:

1. ``POST {root}/tokenize`` with the teacher messages and ``add_generation_prompt`` renders the
   chat template exactly as the server does for chat completions → ``teacher_prompt_ids``.
2. ``POST {api_base}/completions`` with ``prompt`` = the concatenated token ids,
   ``max_tokens=1`` and ``prompt_logprobs=0`` returns, for every prompt position, the logprob
   of the token actually at that position; the last ``len(response_token_ids)`` entries are the
   teacher logprobs.

The response token ids are the captured ``token_ids`` of the turn (white-box capture), used
verbatim, including a trailing end-of-turn token if the capture has one.

With ``top_k`` > 0 (top-k OPD, ``TeacherConfig.top_k``) the same call asks for
``prompt_logprobs=top_k``: each position's entry then also holds the teacher's k most likely
tokens, which are kept per response position (ids and log-probs, most likely first) beside the
sampled token's log-prob. One pass either way; the trainer distils the k tokens plus the tail
mass 1 − Σ p (``trainer.objectives.topk_opd_loss``).

Both calls go through :mod:`vllm_client` (the one vLLM client), over httpx, so a
Celery worker can import this without the gateway or the trainer.

Known vLLM problems to keep in mind (vLLM 0.32.0, CPU build, as served by nextstate):

* With ``--enable-lora`` and LoRA on ``lm_head`` (vLLM's default ``--lora-target-modules``), a
  ``prompt_logprobs`` request that is scheduled in the same step as any other running request
  kills the EngineCore (``einsum(): subscript b has size N ...`` in
  ``punica_cpu.add_lora_logits``: the LoRA logits mapping has one row per request, prompt
  logprobs one per prompt token; the GPU build dies of the same mismatch with a CUDA illegal
  memory access); every in-flight request then fails with 500 and the server must be restarted.
  The servers nextstate starts leave ``lm_head`` out (``nextstate.modelserver.LORA_TARGET_MODULES``);
  teacher requests still go to a replica of their own, one at a time (``TEACHER_ARGS`` there says
  why). The upstream reports: docs/limitations.md.
* When a LoRA adapter targets ``lm_head``, vLLM's ``prompt_logprobs`` may omit the adapter's
  lm_head delta (an open upstream report, in docs/limitations.md); adapters that leave
  ``lm_head`` alone are unaffected.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import httpx

from base.errors import FINAL_STATUSES, CallError, TeacherError
from vllm_client.http import post_json
from vllm_client.tokenizer import tokenize

__all__ = [
    "FINAL_STATUSES",
    "HINT_TEMPLATE",
    "TeacherError",
    "TeacherResult",
    "teacher_logprobs",
    "teacher_messages",
]

HINT_TEMPLATE = "[Hint for your reply: {hint}]"
"""How a hint is written into the teacher context: a bracketed, clearly labelled line."""

_STRING_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class TeacherResult:
    """The teacher's view of one turn's response.

    ``prompt_token_ids``: the rendered teacher context (messages + hint + generation prompt).
    ``logprobs``: one logprob per response token, aligned with ``response_token_ids``.
    ``topk_ids`` / ``topk_logprobs``: with ``top_k`` > 0, per response position the teacher's
    ``top_k`` most likely tokens and their log-probs, most likely first; None without.
    """

    prompt_token_ids: list[int]
    logprobs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


def _marked_hint(hint: str) -> str:
    return HINT_TEMPLATE.format(hint=hint.strip())


def teacher_messages(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """Return a deep copy of *messages* with *hint* appended to the last user message.

    The hint is written with :data:`HINT_TEMPLATE` so the model sees it as a hint, not as part
    of what the user said. String content gets ``"\\n\\n" + marked hint`` appended; list
    content (OpenAI content parts) gets a new ``{"type": "text", ...}`` part appended; a user
    message without content gets the marked hint as its content. If there is no user message
    at all, a new user message holding the marked hint is appended. *messages* is never
    mutated.
    """
    out = copy.deepcopy(messages)
    marked = _marked_hint(hint)
    for message in reversed(out):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, list):
            content.append({"type": "text", "text": marked})
        elif isinstance(content, str) and content:
            message["content"] = content + _STRING_SEPARATOR + marked
        else:
            message["content"] = marked
        return out
    out.append({"role": "user", "content": marked})
    return out


def _actual_logprob(entry: Any, token_id: int, position: int) -> float:
    """The logprob of *token_id* in one ``prompt_logprobs`` entry (keys are token ids as strings)."""
    if not isinstance(entry, dict):
        raise TeacherError(f"prompt_logprobs[{position}] is {entry!r}, expected an object")
    info = entry.get(str(token_id))
    if info is None:
        info = entry.get(token_id)  # tolerate int keys
    if not isinstance(info, dict) or "logprob" not in info:
        raise TeacherError(
            f"prompt_logprobs[{position}] has no entry for the actual token {token_id} "
            f"(keys: {sorted(entry)[:5]})"
        )
    value = info["logprob"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TeacherError(f"prompt_logprobs[{position}] logprob is {value!r}, expected a number")
    value = float(value)
    if math.isnan(value):
        raise TeacherError(f"prompt_logprobs[{position}] logprob is NaN")
    return value


def _top_k(entry: dict[str, Any], k: int, position: int) -> tuple[list[int], list[float]]:
    """The *k* most likely tokens of one ``prompt_logprobs`` entry (which also holds the actual
    token, beyond the k when it is not among them), most likely first; ties by vLLM's rank."""
    ranked = []
    for key, info in entry.items():
        try:
            value, rank = float(info["logprob"]), info.get("rank")
        except (KeyError, TypeError, ValueError) as exc:
            raise TeacherError(f"prompt_logprobs[{position}][{key!r}] is {info!r}, expected a logprob") from exc
        if math.isnan(value):
            raise TeacherError(f"prompt_logprobs[{position}][{key!r}] logprob is NaN")
        ranked.append((-value, rank if isinstance(rank, int) else 1 << 30, int(key)))
    ranked.sort()
    if len(ranked) < k:
        raise TeacherError(f"prompt_logprobs[{position}] has {len(ranked)} entries, fewer than top_k={k}")
    return [t for _, _, t in ranked[:k]], [-v for v, _, _ in ranked[:k]]


async def teacher_logprobs(
    http: httpx.AsyncClient,
    api_base: str,
    model: str,
    messages: list[dict[str, Any]],
    response_token_ids: list[int],
    *,
    tools: list[dict[str, Any]] | None = None,
    api_key: str | None = None,
    top_k: int = 0,
) -> TeacherResult:
    """Logprobs of *response_token_ids* under the teacher context *messages*.

    *messages* are the TEACHER messages: the caller applies :func:`teacher_messages` (or
    passes the original messages to score the response under the unhinted policy). *tools*
    are the turn's tool definitions, rendered into the template exactly as in the original
    request. *api_base* is the OpenAI base (``…/v1``) of the vLLM server serving *model* (a
    base model or a loaded LoRA adapter name); ``/tokenize`` is called at its root. With
    *api_key*, both calls send ``Authorization: Bearer <api_key>``. Timeouts are those of
    *http*.

    Raises :class:`TeacherError` for empty *response_token_ids*, HTTP/transport errors
    (carrying the server's message), malformed replies and length mismatches. The rendered
    teacher prompt plus the response must fit the server's ``max_model_len`` minus one token
    (the one generated token the completion call needs). *top_k* > 0 also returns each response
    position's *top_k* most likely teacher tokens (vLLM's ``--max-logprobs`` bounds it, 20 by default).
    """
    if top_k < 0:
        raise TeacherError(f"top_k must be >= 0, got {top_k}")
    if not response_token_ids:
        raise TeacherError("response_token_ids is empty: nothing to score")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in response_token_ids):
        raise TeacherError("response_token_ids must be a list of ints")
    base = api_base.rstrip("/")
    try:
        tokenized = await tokenize(http, base, model, messages=messages, tools=tools, api_key=api_key)
    except CallError as exc:
        raise TeacherError(f"teacher tokenize: {exc}", status_code=exc.status_code) from exc
    prompt_ids = tokenized.tokens
    if not prompt_ids:
        raise TeacherError("teacher tokenize: the rendered teacher prompt has no tokens")

    response_ids = list(response_token_ids)
    try:
        completion = await post_json(http, f"{base}/completions", {
            "model": model,
            "prompt": prompt_ids + response_ids,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": top_k,
        }, api_key=api_key)
    except CallError as exc:
        raise TeacherError(f"teacher prompt_logprobs: {exc}", status_code=exc.status_code) from exc
    try:
        entries = completion["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise TeacherError(
            f"teacher prompt_logprobs: reply has no choices[0].prompt_logprobs: {str(completion)[:200]}"
        ) from exc
    total = len(prompt_ids) + len(response_ids)
    if not isinstance(entries, list) or len(entries) != total:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise TeacherError(
            f"teacher prompt_logprobs: expected {total} entries "
            f"({len(prompt_ids)} prompt + {len(response_ids)} response), got {got}"
        )
    offset = len(prompt_ids)
    logprobs = [
        _actual_logprob(entries[offset + i], token_id, offset + i)
        for i, token_id in enumerate(response_ids)
    ]
    if not top_k:
        return TeacherResult(prompt_token_ids=list(prompt_ids), logprobs=logprobs)
    tops = [_top_k(entries[offset + i], top_k, offset + i) for i in range(len(response_ids))]
    return TeacherResult(prompt_token_ids=list(prompt_ids), logprobs=logprobs,
                         topk_ids=[ids for ids, _ in tops], topk_logprobs=[lps for _, lps in tops])
