"""The local backend: torch + transformers + peft on the CPU or one GPU.

LoRA by default (full fine-tuning by flag), bf16 where the device supports it, gradient
accumulation over micro-batches. Each step: the current policy's logprobs of the samples'
response tokens, advantages and the clipped PPO loss from ``trainer.objectives`` (veRL's
core_algos), one optimizer step.

Memory: a step's peak grows with its largest micro-batch, not with its round. Micro-batches
are cut by turns (``LocalConfig.micro_batch_size``) and by tokens
(``LocalConfig.max_tokens_per_micro_batch``, :meth:`LocalTrainer.micro_batches`): a round of
long agent turns is split, never held in one forward; a turn longer than the budget goes alone.
On the CPU the decoder layers recompute their activations in backward (gradient checkpointing,
``LocalConfig.gradient_checkpointing``), so a turn keeps one hidden state per layer and token
instead of every intermediate; attention is torch's SDPA (no seq × seq scores kept).

Speed: the log-probs of the response
tokens come from the decoder's last hidden states at the response positions and the LM head in
chunks (``trainer.logprobs``), never the full-vocabulary logits; micro-batches with much
padding are packed into one row with position ids (transformers' padding-free masks);
LoRA adapters compute in the base model's dtype (bf16 on a GPU) while the optimizer keeps fp32
master copies of them; AdamW is fused on CUDA; and the no-grad pass over the batch runs only
when the objective needs the current policy's log-probs before the step (OPD, stale-sample
correction) — otherwise samples without captured log-probs take the same values from the
step's own forward (detached), where the no-grad pass would have produced them. Where the
objective does need them and the batch is one micro-batch, the step's own forward gives them
too (detached, before the advantages are built): one forward per step instead of two.

Host syncs: a step waits for the GPU once, at its end (the metrics). Everything the step needs
before its first forward (masks, behaviour log-probs, advantages for ``rl``) is built on the CPU
and sent with non-blocking copies from pinned memory, and the loss metrics stay on the GPU
until then (veRL's vanilla policy loss calls ``.item()`` three times per call; the local path
uses ``objectives.compute_loss(..., tensor_metrics=True)``, the same arithmetic without them).
Full fine-tuning may keep fp32 master weights and AdamW states (``LocalConfig.fp32_master``).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import logprobs as chunked
from trainer import objectives
from trainer.config import LocalConfig
from trainer.samples import Sample


@dataclass
class StepProgress:
    """How far an optimizer step is: tokens (prompt and response) passed through the model of
    all its passes' (the no-grad pass, the step's forward and backward, the reference pass)."""

    tokens_total: int
    tokens: int = 0


def _device(cfg: LocalConfig) -> torch.device:
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


#: ``LocalConfig.micro_batch_size`` on the CPU when it is None (the value it always had)
CPU_MICRO_BATCH = 4
#: the largest micro-batch chosen on a GPU: one H100 trains the 1.7 B shape fastest with 8 turns
#: of 768 tokens in one micro-batch (benchmarks/trainer/README.md); beyond 8 was not measured
GPU_MICRO_BATCH_MAX = 8
#: tokens a turn is assumed to hold when the micro-batch is sized
TURN_TOKENS = 1024
#: ``LocalConfig.max_tokens_per_micro_batch`` on the CPU when it is None: SmolLM2-135M's step peaks
#: at about 2 GB RSS for a turn of 8k tokens, with gradient checkpointing (benchmarks/trainer/README.md)
CPU_MICRO_BATCH_TOKENS = 8192


def gpu_micro_batch(free_bytes: int, layers: int, hidden: int, trainable: int, *, turn_tokens: int = TURN_TOKENS,
                    cap: int = GPU_MICRO_BATCH_MAX) -> int:
    """The micro-batch for a GPU with *free_bytes* free once the model is on it: the largest power
    of two up to *cap* whose activations fit half of what the optimizer leaves. A turn of
    *turn_tokens* tokens keeps ~34 bytes per hidden unit, token and layer for backward (bf16, no
    recomputation; Korthikanti et al. 2022, an over-estimate with torch.compile's fusion); each
    trainable parameter adds ~18 bytes (its gradient, fp32 master and master gradient, AdamW's
    two moments). At least 1. On an H100 (80 GB) the 1.7 B shape gets 8, full or LoRA."""
    budget = (free_bytes - 18 * trainable) // 2
    fit = budget // (34 * hidden * layers * turn_tokens) if budget > 0 else 1
    mb = 1
    while mb * 2 <= min(fit, cap):
        mb *= 2
    return mb


#: glibc malloc: blocks from this size up are mmapped, so freed ones go back to the system at once
MALLOC_MMAP_THRESHOLD = 128 << 10


def release_freed_memory() -> bool:
    """Make glibc's malloc give freed tensor memory back to the system at once (False where the C
    library is not glibc). By default its mmap threshold climbs to 32 MB as large blocks are
    freed; past that, a layer's activations (tens of MB each on the CPU) come from the heap, whose
    freed pages stay resident: a step over a turn of 8k tokens with 4 of SmolLM2's layers peaked
    at 2.0 GB RSS, 1.1 GB with this (benchmarks/trainer/README.md, "Memory on the CPU")."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                and libc.mallopt(m_trim_threshold, MALLOC_MMAP_THRESHOLD))


@dataclass
class _StepBatch:
    """A step's samples, its micro-batches and what the loss needs of them, the whole batch's."""

    samples: list[Sample]
    parts: list[slice]
    student: torch.Tensor  # the current policy's log-probs before the step (zeros when not needed)
    mask: torch.Tensor
    old: torch.Tensor  # π_behaviour
    fill_old: list[bool]  # samples whose π_behaviour is the step's own forward, detached
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    fused_out: tuple[torch.Tensor, ...] | None  # the whole batch's forward, when it is one micro-batch
    adv: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


class LocalTrainer:
    def __init__(self, cfg: LocalConfig, objective: objectives.ObjectiveConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.objective = objective
        self.device = _device(cfg)
        if self.device.type == "cpu":
            release_freed_memory()
        bf16 = cfg.bf16 if cfg.bf16 is not None else (self.device.type == "cuda" and torch.cuda.is_bf16_supported())
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=self.dtype)
        # peft's default upcasts adapters to fp32 on a bf16 base (fp32 GEMMs without tensor
        # cores on every adapted projection); they stay in the base dtype and the optimizer gets
        # fp32 master copies instead (below)
        autocast = False
        if cfg.lora:
            from peft import LoraConfig, PeftModel, get_peft_model

            if cfg.init_adapter is not None:
                model = PeftModel.from_pretrained(model, cfg.init_adapter, is_trainable=True,
                                                  autocast_adapter_dtype=autocast)
            else:
                model = get_peft_model(model, LoraConfig(
                    r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_targets),
                    lora_dropout=0.0, task_type="CAUSAL_LM"), autocast_adapter_dtype=autocast)
        self.model = model.to(self.device)
        self.model.train()
        #: whether the decoder layers are compiled: LocalConfig.compile, by default on with CUDA
        self.compile = cfg.compile if cfg.compile is not None else self.device.type == "cuda"
        #: whether backward recomputes each decoder layer's activations: LocalConfig.gradient_checkpointing
        self.gradient_checkpointing = (cfg.gradient_checkpointing if cfg.gradient_checkpointing is not None
                                       else self.device.type == "cpu")
        if self.gradient_checkpointing:  # non-reentrant: frozen embeddings need no grad-requiring input
            self._causal_lm().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.compile:
            if cfg.activation_memory_budget is not None:
                import torch._functorch.config as functorch_config

                functorch_config.activation_memory_budget = cfg.activation_memory_budget
            for layer in self._causal_lm().model.layers:
                layer.compile(mode=cfg.compile_mode)
        params = [p for p in self.model.parameters() if p.requires_grad]
        #: turns per forward pass: LocalConfig.micro_batch_size, by default sized to the GPU's free memory
        self.micro_batch_size = cfg.micro_batch_size or CPU_MICRO_BATCH
        if cfg.micro_batch_size is None and self.device.type == "cuda":
            lm = self._causal_lm().config
            self.micro_batch_size = gpu_micro_batch(torch.cuda.mem_get_info(self.device)[0], lm.num_hidden_layers,
                                                    lm.hidden_size, sum(p.numel() for p in params))
        #: tokens per forward pass at most (0: no budget): LocalConfig.max_tokens_per_micro_batch
        self.max_tokens_per_micro_batch = cfg.max_tokens_per_micro_batch
        if self.max_tokens_per_micro_batch is None:
            self.max_tokens_per_micro_batch = (CPU_MICRO_BATCH_TOKENS if self.device.type == "cpu"
                                               else self.micro_batch_size * TURN_TOKENS)
        # fp32 master weights for LoRA adapters kept in a lower precision (a few MB); full
        # fine-tuning too unless ``fp32_master`` is off (then bf16 weights and AdamW states; a 1.7 B
        # model's fp32 masters and states add 20 GB)
        self._master: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        want_master = cfg.lora or cfg.fp32_master
        if want_master and any(p.dtype != torch.float32 for p in params):
            self._master = [(p, p.detach().float().clone().requires_grad_(True)) for p in params]
            params = [m for _, m in self._master]
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, **({"fused": True} if fused else {}))
        self._params = params
        # Adam's first steps move every weight by about lr whatever the gradient's size: warmup
        # (LocalConfig.warmup_steps) makes a fresh optimizer's first steps smaller
        self.scheduler = (torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / cfg.warmup_steps)) if cfg.warmup_steps else None)
        self.step_count = 0
        #: whether the last step ran the no-grad pass (for benchmarks' FLOP counts)
        self.last_step_no_grad_pass = True

    # -- logprobs -------------------------------------------------------------------------------

    def _batch(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Right-padded input ids and attention mask, the response mask over the last
        ``resp_len`` positions' targets, and resp_len."""
        resp_len = max(len(s.response_ids) for s in samples)
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        width = max(len(x) for x in seqs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
        mask = torch.zeros((len(seqs), resp_len))
        for i, s in enumerate(samples):
            mask[i, : len(s.response_ids)] = torch.tensor(s.loss_weights())
        return (chunked.to_device(ids, self.device), chunked.to_device(attn, self.device),
                chunked.to_device(mask, self.device), resp_len)

    def response_logprobs(self, samples: Sequence[Sample], *, adapter: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(a_t | prefix) for each response token, response mask), both (batch, resp_len).
        ``adapter=False`` gives the base policy's (for the KL term), without gradients."""
        if not self._chunked_ok():
            return self._full_logprobs(samples, adapter=adapter)[:2]
        if adapter:
            return self._chunked_logprobs(samples)[:2]
        with torch.no_grad(), self.model.disable_adapter():
            return self._chunked_logprobs(samples)[:2]

    def response_and_extra_logprobs(self, samples: Sequence[Sample], extra: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`response_logprobs` (with gradients) and, from the same forward and LM-head pass,
        the log-probs of *extra* token ids at each response position: ``extra`` is ``(batch, ≥
        resp_len, K)`` (the teacher's top-k tokens for top-k OPD); returns them ``(batch,
        resp_len, K)``, unmasked."""
        if not self._chunked_ok():
            return self._full_logprobs(samples, extra=extra)  # type: ignore[return-value]
        return self._chunked_logprobs(samples, extra=extra)  # type: ignore[return-value]

    def _causal_lm(self) -> torch.nn.Module:
        """The transformers causal LM (under peft's wrapper for LoRA; its layers carry the adapters)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def _chunked_ok(self) -> bool:
        """The chunked path needs a plain linear LM head over the decoder's last hidden state
        (no adapter on the head, no logit soft-capping or scaling)."""
        lm = self._causal_lm()
        head = lm.get_output_embeddings()
        config = lm.config
        return (type(head) is torch.nn.Linear and hasattr(lm, "model")
                and not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) is None)

    def _pack(self, samples: Sequence[Sample]) -> bool:
        mode = self.cfg.packing
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"packing must be auto, on or off, got {mode!r}")
        if mode != "auto" or len(samples) < 2:
            return mode == "on"
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        return sum(lengths) <= 0.75 * len(lengths) * max(lengths)

    def _chunked_logprobs(self, samples: Sequence[Sample], extra: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lm = self._causal_lm()
        starts = [len(s.prompt_ids) for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        if self._pack(samples):
            # one row, position ids restarting at 0 per sequence and no attention mask:
            # transformers builds the block-diagonal causal mask (varlen with FlashAttention)
            seqs = [s.prompt_ids + s.response_ids for s in samples]
            ids = chunked.to_device(torch.tensor([[t for seq in seqs for t in seq]]), self.device)
            pos = chunked.to_device(torch.cat([torch.arange(len(seq)) for seq in seqs])[None], self.device)
            offsets = [sum(len(x) for x in seqs[:i]) for i in range(len(seqs))]
            hidden = lm.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            h, valid = chunked.select_response_hidden(hidden, [o + st for o, st in zip(offsets, starts, strict=True)],
                                                      lengths, rows=[0] * len(seqs))
        else:
            ids, attn, _, _ = self._batch(samples)
            hidden = lm.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            h, valid = chunked.select_response_hidden(hidden, starts, lengths)
        width = valid.shape[1]
        targets = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            targets[i, : len(s.response_ids)] = torch.tensor(s.response_ids, dtype=torch.long)
        if extra is not None:  # the sampled token and the extra ones, from one log-sum-exp per position
            targets = torch.cat([targets[..., None], extra[:, :width].to("cpu", torch.long)], dim=-1)
        head = lm.get_output_embeddings()
        chunk = self.cfg.logprob_chunk or chunked.auto_chunk(head.weight.shape[0])
        logp = chunked.token_logprobs(h, head.weight, chunked.to_device(targets, self.device), head.bias,
                                      chunk_size=chunk)
        extra_logp = None
        if extra is not None:
            logp, extra_logp = logp[..., 0], logp[..., 1:]
        mask = valid.to(torch.float32)
        if any(s.masked for s in samples):  # redacted text: no loss weight (trainer.samples)
            weights = torch.zeros((len(samples), width))
            for i, s in enumerate(samples):
                weights[i, : len(s.response_ids)] = torch.tensor(s.loss_weights())
            mask = mask * chunked.to_device(weights, self.device)
        return logp * mask, mask, extra_logp

    def _full_logprobs(self, samples: Sequence[Sample], *, adapter: bool = True, extra: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For an LM head the chunked path cannot take (see :meth:`_chunked_ok`): the model's
        logits at every position of the micro-batch and their fp32 log_softmax."""
        ids, attn, mask, resp_len = self._batch(samples)
        if adapter:
            logits = self.model(input_ids=ids, attention_mask=attn).logits
        else:
            with torch.no_grad(), self.model.disable_adapter():
                logits = self.model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        rows, extra_rows = [], []
        for i, s in enumerate(samples):
            # the logits at position p predict token p + 1
            start = len(s.prompt_ids)
            positions = torch.arange(start - 1, start - 1 + len(s.response_ids), device=self.device)
            targets = torch.tensor(s.response_ids, device=self.device)
            row = logp[i, positions, :].gather(-1, targets[:, None]).squeeze(-1)
            rows.append(torch.nn.functional.pad(row, (0, resp_len - row.shape[0])))
            if extra is not None:
                ids = extra[i, : len(s.response_ids)].to(self.device, torch.long)
                extra_rows.append(torch.nn.functional.pad(logp[i, positions, :].gather(-1, ids),
                                                          (0, 0, 0, resp_len - ids.shape[0])))
        return torch.stack(rows), mask, torch.stack(extra_rows) if extra is not None else None

    @staticmethod
    def _padded(values: Sequence[Sequence[float] | None], fallback: torch.Tensor) -> torch.Tensor:
        """``values`` (per row, right-padded) where given, else ``fallback``; built on the CPU and
        sent in one copy."""
        if all(v is None for v in values):
            return fallback.detach().clone()
        rows = torch.zeros(fallback.shape, dtype=fallback.dtype)
        given = torch.zeros(fallback.shape, dtype=torch.bool)
        for i, v in enumerate(values):
            if v is not None:
                rows[i, : len(v)] = torch.tensor(v, dtype=rows.dtype)
                given[i, : len(v)] = True
        dev = fallback.device
        return torch.where(chunked.to_device(given, dev), chunked.to_device(rows, dev), fallback.detach())

    # -- one optimizer step ---------------------------------------------------------------------

    @staticmethod
    def _topk(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The teacher's top-k per response position of the samples that have it, right-padded to
        the longest response and the largest k: (ids (n, width, K) long, log-probs (n, width, K),
        valid (n, width, K) bool, rows (n,) bool: which samples have them); None when none has."""
        rows = [s.teacher_topk_ids is not None and s.teacher_topk_logprobs is not None for s in samples]
        if not any(rows):
            return None
        width = max(len(s.response_ids) for s in samples)
        k = max(len(x) for s, r in zip(samples, rows, strict=True) if r for x in s.teacher_topk_ids or [[]])
        ids = torch.zeros((len(samples), width, k), dtype=torch.long)
        lps = torch.zeros((len(samples), width, k))
        valid = torch.zeros((len(samples), width, k), dtype=torch.bool)
        for i, s in enumerate(samples):
            if not rows[i]:
                continue
            for t, (tok, lp) in enumerate(zip(s.teacher_topk_ids or [], s.teacher_topk_logprobs or [], strict=True)):
                ids[i, t, : len(tok)] = torch.tensor(tok, dtype=torch.long)
                lps[i, t, : len(lp)] = torch.tensor(lp)
                valid[i, t, : len(tok)] = True
        return ids, lps, valid, torch.tensor(rows)

    def _no_grad_logprobs(self, samples: Sequence[Sample], parts: Sequence[slice],
                          done: Callable[[Sequence[Sample]], None] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Response log-probs of *samples* without a graph, a micro-batch (*parts*) at a time;
        *done* is told each micro-batch as it finishes (the step's progress)."""
        width = max(len(s.response_ids) for s in samples)
        logps, masks = [], []
        with torch.no_grad():
            for where in parts:
                part = samples[where]
                lp, mask = self.response_logprobs(part)
                logps.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
                masks.append(torch.nn.functional.pad(mask, (0, width - mask.shape[1])))
                if done is not None:
                    done(part)
        return torch.cat(logps), torch.cat(masks)

    def micro_batches(self, samples: Sequence[Sample]) -> list[slice]:
        """*samples* cut into consecutive micro-batches of at most ``micro_batch_size`` turns and
        ``max_tokens_per_micro_batch`` tokens each (turns × the longest: padding counts); a turn
        longer than the budget is a micro-batch of its own."""
        budget = self.max_tokens_per_micro_batch
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        parts: list[slice] = []
        lo = 0
        for i in range(1, len(samples)):
            turns, longest = i + 1 - lo, max(lengths[lo: i + 1])
            if turns > self.micro_batch_size or (budget and turns * longest > budget):
                parts.append(slice(lo, i))
                lo = i
        if samples:
            parts.append(slice(lo, len(samples)))
        return parts

    def _fuse_no_grad_pass(self, parts: Sequence[slice]) -> bool:
        """Whether a step takes the current policy's log-probs before the step from its own
        forward instead of a separate no-grad pass: when the batch is one micro-batch (the whole
        graph is held anyway)."""
        return len(parts) == 1

    def step(self, samples: Sequence[Sample], *, correct: Sequence[bool] | None = None,
             ratio_cap: float = 2.0, progress: Callable[[StepProgress], None] | None = None) -> dict[str, float]:
        """One optimizer step over ``samples`` (in micro-batches, :meth:`micro_batches`); returns
        its metrics.

        Advantages are computed over the whole batch first (GRPO groups and per-step
        standardization span micro-batches), from a no-grad pass of the current policy where
        they need its log-probs (OPD, ``correct``); a batch of one micro-batch takes them from
        the step's own forward, detached, instead (the same values, one forward fewer).

        ``correct`` marks stale samples (produced by a policy several versions back): their PPO
        ratio is taken against the current policy instead, and the loss of each token is
        weighted by the exact importance ratio π_current / π_behaviour from the captured
        logprobs, capped at ``ratio_cap`` (truncated importance sampling, veRL's
        ``rollout_is_weights``).

        ``progress`` is called after each micro-batch's pass (a step over long agent turns takes
        minutes on a CPU) with the tokens (prompt and response) passed so far, of the step's
        whole work."""
        started = time.perf_counter()
        samples = list(samples)
        stale = correct is not None and any(correct)
        # the current policy's log-probs before the step are needed for OPD advantages and the
        # stale-sample correction; otherwise the no-grad pass is skipped and samples without
        # captured log-probs take the step's own (detached) forward values, the same policy's
        needs_student = self.objective.objective != "rl" or stale
        parts = self.micro_batches(samples)
        fused = needs_student and self._fuse_no_grad_pass(parts)
        self.last_step_no_grad_pass = needs_student and not fused
        done = self._progress_counter(samples, progress)
        batch = self._prepare(samples, parts, fused=fused, fill_old=not needs_student, done=done)
        if stale:
            batch.is_weights = self._correct_stale(samples, batch, correct or (), ratio_cap)
        batch.adv = self._advantages(samples, batch)
        totals = self._accumulate(batch, done)
        self._optimizer_step()
        self.step_count += 1
        adv_mean = (batch.adv * batch.mask).sum() / batch.mask.sum()
        keys = list(totals)
        # the step's one wait for the GPU: all metrics in one transfer
        values = torch.stack([totals[k].float() for k in keys] + [adv_mean.float()]).tolist()
        elapsed = time.perf_counter() - started
        tokens = float(sum(len(s.response_ids) for s in samples))
        return dict(zip(keys, values[:-1], strict=True)) | {
            "advantage_mean": values[-1], "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "samples": float(len(samples)), "micro_batches": float(len(parts)), "seconds": elapsed}

    def _progress_counter(self, samples: Sequence[Sample], progress: Callable[[StepProgress], None] | None
                          ) -> Callable[[Sequence[Sample]], None]:
        """What each pass calls with the samples it finished: counts their tokens, tells *progress*."""
        passes = 1 + self.last_step_no_grad_pass + (self.objective.kl_coef > 0 and self.cfg.lora)
        work = StepProgress(tokens_total=passes * sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))

        def done(part: Sequence[Sample]) -> None:
            work.tokens += sum(len(s.prompt_ids) + len(s.response_ids) for s in part)
            if progress is not None:
                progress(work)

        return done

    def _prepare(self, samples: list[Sample], parts: list[slice], *, fused: bool, fill_old: bool,
                 done: Callable[[Sequence[Sample]], None]) -> _StepBatch:
        """The step's inputs before advantages: the current policy's log-probs where needed (the
        no-grad pass, or the fused forward), the response mask, π_behaviour, the teacher's top-k."""
        cfg = self.objective
        # top-k OPD: per response position the teacher's top-k token ids and log-probs, whose
        # student log-probs the step's forward gathers beside the sampled token's
        topk = self._topk(samples) if cfg.opd_topk and cfg.objective != "rl" else None
        fused_out: tuple[torch.Tensor, ...] | None = None
        if fused:
            fused_out = (self.response_and_extra_logprobs(samples, topk[0]) if topk is not None
                         else self.response_logprobs(samples))
            student, mask = fused_out[0].detach(), fused_out[1]
        elif self.last_step_no_grad_pass:
            student, mask = self._no_grad_logprobs(samples, parts, done)
            student, mask = student.to(self.device), mask.to(self.device)
        else:
            # nothing here needs the GPU yet: mask, behaviour log-probs and advantages are built
            # on the CPU and sent over once, so the step does not wait on the GPU
            width = max(len(s.response_ids) for s in samples)
            mask = torch.zeros((len(samples), width))
            for i, s in enumerate(samples):
                mask[i, : len(s.response_ids)] = torch.tensor(s.loss_weights())
            student = torch.zeros_like(mask)
        # π_behaviour: vLLM's captured logprobs (exact importance ratio); black-box: on-policy
        old = self._padded([s.behaviour_logprobs for s in samples], student)
        fill = [fill_old and s.behaviour_logprobs is None for s in samples]
        return _StepBatch(samples, parts, student, mask, old, fill, topk, fused_out)

    @staticmethod
    def _correct_stale(samples: Sequence[Sample], batch: _StepBatch, correct: Sequence[bool],
                       ratio_cap: float) -> torch.Tensor:
        """Stale samples' ratio against the current policy, and their capped importance weights."""
        student, old = batch.student, batch.old
        is_weights = torch.ones_like(student)
        for i, is_stale in enumerate(correct):
            if is_stale and samples[i].behaviour_logprobs is not None:
                is_weights[i] = torch.exp(student[i] - old[i]).clamp(max=ratio_cap)
                old[i] = student[i]
        return is_weights

    def _advantages(self, samples: Sequence[Sample], batch: _StepBatch) -> torch.Tensor:
        """The whole batch's advantages (GRPO groups and standardization span micro-batches)."""
        cfg, mask, student, topk = self.objective, batch.mask, batch.student, batch.topk
        if cfg.integrated_norm == "dense":  # whole-batch advantages: trainer.offline.mini_batches
            raise ValueError('integrated_norm "dense" needs mini-batches: train_offline(mini_batch_size=...)')
        teacher = teacher_mask = None
        if cfg.objective != "rl":
            teacher = self._padded([s.teacher_logprobs for s in samples], student)
            # a sample distilled on the teacher's top-k takes no sampled-token OPD advantage, except on
            # the positions before opd_topk_from
            has = torch.tensor([[float(s.teacher_logprobs is not None)] for s in samples])
            on_topk = has * (topk[3][:, None].float() if topk is not None else torch.zeros_like(has))
            has, on_topk = chunked.to_device(has, mask.device), chunked.to_device(on_topk, mask.device)
            teacher_mask = (has - on_topk) * mask + on_topk * (mask - objectives.positions_from(mask, cfg.opd_topk_from))
        token_rewards = objectives.scores_to_token_rewards(
            objectives.sample_rewards(samples, by_group=cfg.integrated_norm == "group").to(mask.device), mask)
        groups = [s.group_id for s in samples]
        adv = objectives.compute_advantages(cfg, response_mask=mask, token_level_rewards=token_rewards,
                                            index=groups if cfg.grpo and any(g is not None for g in groups) else None,
                                            teacher_log_prob=teacher, student_log_prob=student, teacher_mask=teacher_mask)
        batch.old, adv, batch.mask = (chunked.to_device(t, self.device) for t in (batch.old, adv, mask))
        return adv

    def _accumulate(self, batch: _StepBatch, done: Callable[[Sequence[Sample]], None]) -> dict[str, torch.Tensor]:
        """Forward and backward over each micro-batch, gradients summed; the loss metrics,
        weighted by the micro-batches' shares of the samples (on the device until the step's sync)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p, _ in self._master:
            p.grad = None
        n = len(batch.samples)
        totals: dict[str, torch.Tensor] = {}
        topk_on_device = None
        if batch.topk is not None:
            _, lps, valid, rows = batch.topk
            topk_on_device = (chunked.to_device(lps, self.device), chunked.to_device(valid, self.device),
                              chunked.to_device(rows[:, None].float(), self.device)
                              * objectives.positions_from(batch.mask, self.objective.opd_topk_from))
        for part in batch.parts:
            loss, metrics, ran = self._micro_batch_loss(batch, part, topk_on_device)
            share = (part.stop - part.start) / n
            (loss * share).backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * share
            done(ran)
        return totals

    def _micro_batch_loss(self, batch: _StepBatch, part: slice, topk_on_device: tuple[torch.Tensor, ...] | None
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[Sample]]:
        """One micro-batch's loss and metrics (with its graph), and the samples its passes ran."""
        cfg, samples = self.objective, batch.samples[part]
        extra_logp = None
        if batch.fused_out is not None:
            log_prob, part_mask = batch.fused_out[0], batch.fused_out[1]
            extra_logp = batch.fused_out[2] if len(batch.fused_out) > 2 else None
        elif batch.topk is not None:
            log_prob, part_mask, extra_logp = self.response_and_extra_logprobs(samples, batch.topk[0][part])
        else:
            log_prob, part_mask = self.response_logprobs(samples)
        w = part_mask.shape[1]
        topk_args: dict[str, torch.Tensor] = {}
        if topk_on_device is not None and extra_logp is not None:
            t_lps, t_valid, t_mask = topk_on_device
            topk_args = {"topk_log_prob": extra_logp, "topk_teacher_log_prob": t_lps[part, :w],
                         "topk_valid": t_valid[part, :w], "topk_mask": t_mask[part, :w] * part_mask}
        for j, i in enumerate(range(part.start, part.stop)):
            if batch.fill_old[i]:
                batch.old[i, :w] = log_prob[j].detach()
        ref = self.response_logprobs(samples, adapter=False)[0] if cfg.kl_coef > 0 and self.cfg.lora else None
        loss, metrics = objectives.compute_loss(
            cfg, log_prob, batch.old[part, :w], batch.adv[part, :w], part_mask, ref_log_prob=ref,
            rollout_is_weights=batch.is_weights[part, :w] if batch.is_weights is not None else None,
            tensor_metrics=True, **topk_args)
        return loss, metrics, samples if ref is None else [*samples, *samples]

    def _optimizer_step(self) -> None:
        if self._master:
            for p, master in self._master:
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self._params, self.cfg.max_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if self._master:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self._master], [m for _, m in self._master])

    def release_device_memory(self) -> float | None:
        """Give the GPU memory the caching allocator holds and no tensor uses back to the device,
        and return the most it reserved since the last call (GiB; None on a CPU). An online
        trainer waits between rounds beside vLLM and, in the learning benchmark, 19 other
        trainers on the same GPU: kept, each one's peak stays reserved while it waits (two
        trainers of 40 ran out of memory on two H200s, benchmarks/gpu/results/README.md)."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_reserved(self.device) / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def save(self, out_dir: Path) -> Path:
        """The adapter (LoRA) or the full model, with the tokenizer, in ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir
