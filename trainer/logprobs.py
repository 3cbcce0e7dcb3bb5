"""Log-probabilities of given tokens without materialising the full logits.

The RL objectives need log π(a_t | prefix) of the sampled token only, never the whole
distribution. :func:`token_logprobs` computes it from the last hidden states and the LM head
in chunks over the tokens: per chunk the logits (hidden @ Wᵀ in the model's dtype, bf16 on a
GPU), their log-sum-exp in fp32, and the target's logit; only the (tokens,) log-sum-exp is kept
for backward. The backward pass recomputes each chunk's logits and forms the exact gradient
g · (onehot − softmax) in fp32 before casting it to the matmul dtype, so gradients to the hidden
states and, for full fine-tuning, to the (tied) LM-head weight equal those of
``log_softmax(logits.float()).gather(target)`` up to the matmul's rounding.

Peak extra memory is about one chunk of ``chunk_size × vocab`` fp32 values plus its bf16
logits (:func:`auto_chunk` sizes the chunk to 256 MiB of fp32 logits: 441 tokens for a
151,936-token vocabulary), where the full path holds bf16 logits, their fp32 copy and the fp32
log-softmax for every position of the micro-batch. The backward pass turns the recomputed logits
into the gradient in place (one fp32 buffer per chunk).

:func:`select_response_hidden` picks the hidden states that predict the response tokens
(position p predicts token p + 1), so the LM head runs on response positions only.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024
#: fp32 logits per chunk that :func:`auto_chunk` aims at
CHUNK_BYTES = 256 << 20


def auto_chunk(vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about ``budget_bytes`` (64 … 4,096)."""
    return max(64, min(4096, budget_bytes // (4 * max(1, vocab))))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``; to a GPU through pinned memory without blocking, so that
    building a micro-batch's indices does not wait for the GPU work queued before it (a plain
    ``.to("cuda")`` from pageable memory synchronises the stream)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits


class _TokenLogprobs(torch.autograd.Function):
    """(hidden (T, d), weight (V, d), bias (V,) | None, targets (T, K)) -> logprobs (T, K) fp32:
    K tokens' log-probs per row from one log-sum-exp (K = 1: the sampled token; more: top-k OPD)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):  # type: ignore[override]
        n = hidden.shape[0]
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, chunk_size):
            hi = min(n, lo + chunk_size)
            logits = _chunk_logits(hidden[lo:hi], weight, bias).float()
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[lo:hi] = chunk_lse
            out[lo:hi] = logits.gather(-1, targets[lo:hi]) - chunk_lse[:, None]
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        n = hidden.shape[0]
        grad_out = grad_out.float()
        for lo in range(0, n, ctx.chunk_size):
            hi = min(n, lo + ctx.chunk_size)
            g = grad_out[lo:hi]
            # d logp_k / d logits = onehot(target_k) − softmax; times the upstream gradients, summed
            # over k, in fp32, in place in one buffer (the bf16 logits are freed once copied)
            grad_logits = _chunk_logits(hidden[lo:hi], weight, bias).float()
            grad_logits.sub_(lse[lo:hi, None]).exp_().mul_(-g.sum(-1, keepdim=True))
            grad_logits.scatter_add_(-1, targets[lo:hi], g)
            if grad_b is not None:
                grad_b += grad_logits.sum(0)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_h is not None:
                grad_h[lo:hi] = grad_logits @ weight
            if grad_w is not None:
                grad_w += grad_logits.t() @ hidden[lo:hi]  # matmul dtype, summed over chunks in fp32
            del grad_logits
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   bias: torch.Tensor | None = None, *, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """log softmax(hidden @ weightᵀ + bias)[target] for each row, in fp32, chunked over rows.

    ``hidden``: (..., d); ``targets``: (...) token ids, one per row, or (..., K): K per row (the
    top-k tokens of top-k OPD, from the same logits); returns ``targets``' shape, fp32. Exact
    gradients to ``hidden``, ``weight`` and ``bias`` (whichever require them), recomputing each
    chunk's logits in backward instead of keeping them.
    """
    shape = targets.shape
    rows = hidden.shape[:-1]
    if shape == rows:
        k = 1
    elif shape[:-1] == rows:
        k = shape[-1]
    else:
        raise ValueError(f"targets {tuple(shape)} must be hidden's {tuple(rows)} or that plus one dimension")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1, k).to(torch.long)
    if flat_h.shape[0] == 0 or k == 0:
        return torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    out = _TokenLogprobs.apply(flat_h, weight, bias, flat_t, max(1, int(chunk_size)))
    return out.reshape(shape)


def select_response_hidden(hidden: torch.Tensor, starts: list[int], lengths: list[int], rows: list[int] | None = None,
                           width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather, for each sequence i, the hidden states at positions starts[i] − 1 … starts[i] +
    lengths[i] − 2 of row rows[i] (default i): those that predict its response tokens.

    Returns (hidden (n, width, d), valid (n, width) bool) with rows right-padded to ``width``
    (default the longest response); padded entries repeat a valid position and are masked.
    """
    n = len(starts)
    width = width if width is not None else max(lengths, default=0)
    rows = list(range(n)) if rows is None else rows
    offs = torch.arange(width)
    pos = torch.tensor(starts)[:, None] - 1 + offs[None, :]
    valid = offs[None, :] < torch.tensor(lengths)[:, None]
    pos = torch.where(valid, pos, torch.tensor(starts)[:, None] - 1).clamp_min(0)
    row_idx = torch.tensor(rows)[:, None].expand(n, width)
    dev = hidden.device
    return hidden[to_device(row_idx.contiguous(), dev), to_device(pos, dev)], to_device(valid, dev)
