"""The local backend: torch + transformers + peft on the CPU or one GPU.

LoRA by default (full fine-tuning by flag), bf16 where the device supports it, gradient
accumulation over micro-batches. Each step: the current policy's logprobs of the samples'
response tokens, advantages and the clipped PPO loss from ``trainer.objectives`` (veRL's
core_algos), one optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer import objectives
from trainer.config import LocalConfig
from trainer.samples import Sample


def _device(cfg: LocalConfig) -> torch.device:
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


class LocalTrainer:
    def __init__(self, cfg: LocalConfig, objective: objectives.ObjectiveConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.objective = objective
        self.device = _device(cfg)
        bf16 = cfg.bf16 if cfg.bf16 is not None else (self.device.type == "cuda" and torch.cuda.is_bf16_supported())
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=self.dtype)
        if cfg.lora:
            from peft import LoraConfig, PeftModel, get_peft_model

            if cfg.init_adapter is not None:
                model = PeftModel.from_pretrained(model, cfg.init_adapter, is_trainable=True)
            else:
                model = get_peft_model(model, LoraConfig(
                    r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_targets),
                    lora_dropout=0.0, task_type="CAUSAL_LM"))
        self.model = model.to(self.device)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr)
        self.step_count = 0

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
            mask[i, : len(s.response_ids)] = 1
        return ids.to(self.device), attn.to(self.device), mask.to(self.device), resp_len

    def response_logprobs(self, samples: Sequence[Sample], *, adapter: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(a_t | prefix) for each response token, response mask), both (batch, resp_len).
        ``adapter=False`` gives the base policy's (for the KL term), without gradients."""
        ids, attn, mask, resp_len = self._batch(samples)
        if adapter:
            logits = self.model(input_ids=ids, attention_mask=attn).logits
        else:
            with torch.no_grad(), self.model.disable_adapter():
                logits = self.model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        rows = []
        for i, s in enumerate(samples):
            # the logits at position p predict token p + 1
            start = len(s.prompt_ids)
            positions = torch.arange(start - 1, start - 1 + len(s.response_ids), device=self.device)
            targets = torch.tensor(s.response_ids, device=self.device)
            row = logp[i, positions, :].gather(-1, targets[:, None]).squeeze(-1)
            rows.append(torch.nn.functional.pad(row, (0, resp_len - row.shape[0])))
        return torch.stack(rows), mask

    @staticmethod
    def _padded(values: Sequence[Sequence[float] | None], fallback: torch.Tensor) -> torch.Tensor:
        out = fallback.detach().clone()
        for i, v in enumerate(values):
            if v is not None:
                out[i, : len(v)] = torch.tensor(v, dtype=out.dtype)
        return out

    # -- one optimizer step ---------------------------------------------------------------------

    def _no_grad_logprobs(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s.response_ids) for s in samples)
        parts, masks = [], []
        with torch.no_grad():
            for lo in range(0, len(samples), self.cfg.micro_batch_size):
                lp, mask = self.response_logprobs(samples[lo: lo + self.cfg.micro_batch_size])
                parts.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
                masks.append(torch.nn.functional.pad(mask, (0, width - mask.shape[1])))
        return torch.cat(parts), torch.cat(masks)

    def step(self, samples: Sequence[Sample], *, correct: Sequence[bool] | None = None,
             ratio_cap: float = 2.0) -> dict[str, float]:
        """One optimizer step over ``samples`` (in micro-batches); returns its metrics.

        Advantages are computed over the whole batch first (GRPO groups and per-step
        standardization span micro-batches), from a no-grad pass of the current policy.

        ``correct`` marks stale samples (produced by a policy several versions back): their PPO
        ratio is taken against the current policy instead, and the loss of each token is
        weighted by the exact importance ratio π_current / π_behaviour from the captured
        logprobs, capped at ``ratio_cap`` (truncated importance sampling, veRL's
        ``rollout_is_weights``)."""
        started = time.perf_counter()
        samples = list(samples)
        cfg = self.objective
        student, mask = self._no_grad_logprobs(samples)
        student, mask = student.to(self.device), mask.to(self.device)
        # π_behaviour: vLLM's captured logprobs (exact importance ratio); black-box: on-policy
        old = self._padded([s.behaviour_logprobs for s in samples], student)
        is_weights = None
        if correct is not None and any(correct):
            is_weights = torch.ones_like(student)
            for i, stale in enumerate(correct):
                if stale and samples[i].behaviour_logprobs is not None:
                    is_weights[i] = torch.exp(student[i] - old[i]).clamp(max=ratio_cap)
                    old[i] = student[i]
        teacher = teacher_mask = None
        if cfg.objective != "rl":
            teacher = self._padded([s.teacher_logprobs for s in samples], student)
            teacher_mask = torch.tensor([[1.0] if s.teacher_logprobs is not None else [0.0] for s in samples],
                                        device=self.device) * mask
        token_rewards = objectives.scores_to_token_rewards(objectives.sample_rewards(samples).to(self.device), mask)
        groups = [s.group_id for s in samples]
        adv = objectives.compute_advantages(
            cfg, response_mask=mask, token_level_rewards=token_rewards,
            index=groups if cfg.grpo and any(g is not None for g in groups) else None,
            teacher_log_prob=teacher, student_log_prob=student, teacher_mask=teacher_mask)

        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        n, mb = len(samples), self.cfg.micro_batch_size
        for lo in range(0, n, mb):
            part = samples[lo: lo + mb]
            log_prob, part_mask = self.response_logprobs(part)
            w = part_mask.shape[1]
            ref = (self.response_logprobs(part, adapter=False)[0]
                   if cfg.kl_coef > 0 and self.cfg.lora else None)
            loss, metrics = objectives.compute_loss(
                cfg, log_prob, old[lo: lo + mb, :w], adv[lo: lo + mb, :w], part_mask, ref_log_prob=ref,
                rollout_is_weights=is_weights[lo: lo + mb, :w] if is_weights is not None else None)
            (loss * len(part) / n).backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value) * len(part) / n
        self.optimizer.step()
        self.step_count += 1
        elapsed = time.perf_counter() - started
        tokens = float(mask.sum())
        return totals | {"advantage_mean": float((adv * mask).sum() / mask.sum()), "tokens": tokens,
                         "tokens_per_s": tokens / elapsed, "samples": float(n), "seconds": elapsed}

    def save(self, out_dir: Path) -> Path:
        """The adapter (LoRA) or the full model, with the tokenizer, in ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir
