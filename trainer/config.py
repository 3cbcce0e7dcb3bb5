"""The trainer's configuration dataclasses, free of torch and veRL so the CLI can read their
defaults (``nextstate train --help``) where the trainer's extra is not installed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from base.vocab import Objective

#: (reply text, prompt messages) -> score in [0, 1]: the online eval gate's scorer
Scorer = Callable[[str, list[dict[str, Any]]], float]

#: veRL's loss aggregation modes (``core_algos.agg_loss``).
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

ADV_BINARY = "nextstate_binary"
ADV_OPD = "nextstate_opd"
ADV_COMBINED = "nextstate_combined"

#: Baselines of the binary RL reward for samples outside a GRPO group (``ObjectiveConfig.rl_baseline``):
#: ``"batch"`` standardizes r within the batch (the batch is one GRPO group), ``"none"`` keeps A = r.
RL_BASELINES: tuple[str, ...] = ("batch", "none")

#: How the integrated reward R_t = O + mean votes is normalized before the advantage
#: (``ObjectiveConfig.integrated_norm``): ``"step"`` per step index across the batch, then the
#: group's baseline; ``"group"`` only the group's baseline for samples in a group (per step across
#: the batch for the others); ``"dense"`` the outcome's group advantage plus the turn's votes,
#: centred in the group and weighted by ``vote_weight`` (whole-batch advantages only:
#: ``trainer.offline.batch_advantages``, ``trainer.rewards.vote_credit``).
INTEGRATED_NORMS: tuple[str, ...] = ("step", "group", "dense")

#: Which registered advantage estimator each objective uses.
ADV_ESTIMATOR_FOR_OBJECTIVE: dict[str, str] = {
    "rl": ADV_BINARY,
    "opd": ADV_OPD,
    "combined": ADV_COMBINED,
}


@dataclass(frozen=True)
class ObjectiveConfig:
    """What to optimise and how.

    Attributes:
        objective: ``"rl"`` (binary / GRPO reward), ``"opd"`` (hindsight on-policy
            distillation) or ``"combined"`` (weighted sum of both advantages).
        w_rl: weight of the RL advantage under ``"combined"``.
        w_opd: weight of the OPD advantage under ``"combined"``.
        clip_low: ε_low of the PPO clip; the ratio is clipped below at 1 − clip_low.
        clip_high: ε_high of the PPO clip; the ratio is clipped above at 1 + clip_high.
        clip_ratio_c: veRL's dual-clip bound: for negative advantages the per-token loss is
            at most −A · clip_ratio_c (must be > 1; veRL's default 3.0).
        opd_clip: bound on |log π_teacher − log π_θ| per token (the OPD advantage).
        kl_coef: coefficient of the KL-to-base-policy term; 0 disables it (the KL is still
            reported as a metric when base log-probs are given).
        kl_type: veRL ``kl_penalty`` estimator; ``"low_var_kl"`` is k3.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        grpo: standardize the reward within task groups when group ids are given.
        grpo_norm_by_std: divide by the group std (GRPO); False only centres (Dr. GRPO). Also
            applies to the batch baseline.
        rl_baseline: what the binary reward of a sample outside a GRPO group (of at least two
            samples in the batch) is measured against: ``"batch"`` (default): the batch's other
            such samples, as one GRPO group, A = (r − mean) / (std + ε) — a batch whose rewards
            are all equal gives A = 0, a lone sample keeps A = r; ``"none"``: A = r (online, where
            turns have no groups, every token of a failed reply then gets −1).
        grpo_eps: ε added to the group std.
        integrated_norm: one of :data:`INTEGRATED_NORMS`. ``"step"`` (the design's) standardizes
            R_t per step index across the batch before the group's baseline: where the batch's
            step indices differ in their mix of successes, the turns of a group that all failed
            get different values, which the group's standardization turns into advantages of
            about ±1 (``trainer.rewards``). ``"group"`` leaves R_t of a grouped sample as it is,
            so such a group gets A = 0 when its votes agree, but the votes alone, standardized,
            when they differ. ``"dense"`` takes the outcome and the votes apart: A_t = the GRPO
            advantage of O in the group + ``vote_weight`` · (v_t − the group's mean vote), so
            a group whose episodes all failed gets only the bounded credit of its votes, on the
            steps they fell on (``trainer.rewards.vote_credit``; the iteration's advantages at
            once, ``trainer.offline.batch_advantages`` and ``mini_batches``).
        vote_weight: the votes' weight in ``integrated_norm="dense"``.
        policy_loss: veRL policy-loss name (``core_algos.get_policy_loss_fn``);
            ``"vanilla"`` is the PPO clipped surrogate the design calls for.
        opd_topk: top-k OPD (``"opd"``, ``"combined"``): samples whose teacher pass kept its
            top-k tokens per position (``TeacherConfig.top_k``) are distilled on the k+1-way
            distribution (k tokens and the tail) with ``w_opd · KL(student ‖ teacher)``
            (``trainer.objectives.topk_opd_kl``) instead of the sampled token's OPD advantage;
            samples with only the sampled token's teacher log-prob keep that advantage.
        opd_topk_tail: the tail outcome (1 − Σ of the k probabilities); off, the k tokens are
            renormalised among themselves.
        opd_topk_temperature: the teacher's k+1-way distribution tempered, p_i ∝ p_i^(1/T): above
            1 it spreads the teacher's mass over its lower tokens and the tail, so the student is
            pulled less hard into the hinted teacher's mode; 1 is the KL to the teacher as it is.
        opd_topk_tail_weight: the weight of the tail's term in the top-k KL (1: the KL); under
            1 the student keeps more of its mass outside the teacher's top k.
        opd_topk_from: top-k OPD from this reply position on (0: every position); a top-k sample's
            first positions take the sampled token's OPD advantage instead. A reply's opening
            tokens decide what it is about, its later ones how long it runs: distilling the hinted
            teacher's whole top k on the opening is where short replies leave the topic.
    """

    objective: Objective = Objective.RL
    w_rl: float = 1.0
    w_opd: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0
    opd_clip: float = 5.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    grpo: bool = True
    grpo_norm_by_std: bool = True
    grpo_eps: float = 1e-6
    rl_baseline: str = "batch"
    integrated_norm: str = "step"
    vote_weight: float = 0.25
    policy_loss: str = "vanilla"
    opd_topk: bool = False
    opd_topk_tail: bool = True
    opd_topk_temperature: float = 1.0
    opd_topk_tail_weight: float = 1.0
    opd_topk_from: int = 0

    def __post_init__(self) -> None:
        if self.objective not in ADV_ESTIMATOR_FOR_OBJECTIVE:
            raise ValueError(f"objective must be one of {sorted(ADV_ESTIMATOR_FOR_OBJECTIVE)}, "
                             f"got {self.objective!r}")
        if self.rl_baseline not in RL_BASELINES:
            raise ValueError(f"rl_baseline must be one of {RL_BASELINES}, got {self.rl_baseline!r}")
        if self.integrated_norm not in INTEGRATED_NORMS:
            raise ValueError(f"integrated_norm must be one of {INTEGRATED_NORMS}, got {self.integrated_norm!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.opd_clip <= 0.0:
            raise ValueError(f"opd_clip must be > 0, got {self.opd_clip}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.opd_topk_temperature <= 0.0 or self.opd_topk_tail_weight < 0.0:
            raise ValueError(f"need opd_topk_temperature > 0 and opd_topk_tail_weight >= 0, got "
                             f"{self.opd_topk_temperature}, {self.opd_topk_tail_weight}")
        if self.opd_topk and self.objective == Objective.RL:
            raise ValueError("opd_topk distils the teacher: it needs objective opd or combined, not rl")
        if self.opd_topk_from < 0:
            raise ValueError(f"opd_topk_from is a reply position >= 0 (0: every position), got {self.opd_topk_from}")


#: torch.compile modes LocalConfig.compile_mode takes (None: torch's default)
COMPILE_MODES: tuple[str | None, ...] = (None, "default", "reduce-overhead", "max-autotune",
                                         "max-autotune-no-cudagraphs")

#: LocalConfig.bf16 for each compute dtype a command line offers (auto: the device decides)
COMPUTE_DTYPES: dict[str, bool | None] = {"auto": None, "bf16": True, "fp32": False}


@dataclass
class LocalConfig:
    model_dir: Path
    lora: bool = True
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float = 5e-5
    #: the learning rate rises linearly over this many optimizer steps of a trainer (lr/N, 2·lr/N,
    #: … lr): AdamW's first steps move every weight by about lr whatever the gradient's size
    warmup_steps: int = 0
    #: clip the gradient's global norm to this before each step (None: no clipping)
    max_grad_norm: float | None = None
    #: turns per forward pass; None: 4 on the CPU, on a GPU sized to its free memory
    #: (``trainer.local.gpu_micro_batch``: the largest power of two up to 8 whose activations fit)
    micro_batch_size: int | None = None
    device: str | None = None  # default: cuda if available, else cpu
    bf16: bool | None = None  # default: on CUDA with bf16 support; fp32 on the CPU
    seed: int = 0
    init_adapter: Path | None = None  # continue training this adapter (the active version)
    #: the most tokens (prompt and response, counted as the micro-batch's turns times its longest)
    #: one forward pass takes: a step's peak memory grows with this, not with its round. Turns are
    #: added to a micro-batch while both this and ``micro_batch_size`` allow; a turn longer than
    #: the budget is a micro-batch of its own. None: 8,192 on the CPU (SmolLM2-135M's step peaks
    #: at ~2 GB RSS, benchmarks/trainer/README.md), on a GPU ``micro_batch_size`` turns of
    #: ``trainer.local.TURN_TOKENS`` (what that micro-batch was sized for); 0: no budget
    max_tokens_per_micro_batch: int | None = None
    #: recompute each decoder layer's activations in backward instead of keeping them (about a
    #: third more compute; a turn of 8k tokens keeps ~0.6 GB instead of ~15 GB for SmolLM2-135M in
    #: fp32). None: on on the CPU (the trainer shares the machine's memory with vLLM), off on a GPU
    gradient_checkpointing: bool | None = None
    #: pack each micro-batch into one row with position ids instead of padding: "auto" packs
    #: when padding would be at least a quarter of the micro-batch's tokens, "on" always, "off" never
    packing: str = "auto"
    #: tokens per chunk of the LM head in the chunked log-prob path; None: as many as make
    #: 256 MiB of fp32 logits (441 for a 151,936-token vocabulary, 1,365 for 49,152)
    logprob_chunk: int | None = None
    #: torch.compile each decoder layer; None: on with CUDA (the first step takes ~10-20 s longer
    #: for a 1.7 B model on an H100, then ~2x the tokens/s), off on the CPU (it rarely pays there)
    compile: bool | None = None
    #: torch.compile mode when ``compile``: None (default fusion) or "reduce-overhead" (CUDA graphs)
    compile_mode: str | None = None
    #: full fine-tuning of a bf16 model: keep fp32 master weights and fp32 AdamW states (as veRL
    #: does), copied to the bf16 weights after each step. Off: AdamW updates the bf16 weights and
    #: keeps bf16 states (12 bytes a parameter less, a ~15 % faster step), but an update smaller
    #: than half a weight's bf16 spacing (2⁻⁹ of its magnitude) is lost, which at lr 2e-5 is most
    #: of them: on by default. bf16 LoRA adapters always get fp32 masters.
    fp32_master: bool = True
    #: with ``compile``: the share (0 … 1) of a compiled layer's activations that backward may keep;
    #: under 1, torch.compile's partitioner recomputes the cheapest ops instead of saving their
    #: outputs (``torch._functorch.config.activation_memory_budget``, a process-wide setting)
    activation_memory_budget: float | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or (self.max_grad_norm is not None and self.max_grad_norm <= 0):
            raise ValueError(f"need warmup_steps >= 0 and max_grad_norm > 0, got {self.warmup_steps}, "
                             f"{self.max_grad_norm}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 0 (0: no budget), "
                             f"got {self.max_tokens_per_micro_batch}")
        if self.packing not in ("auto", "on", "off"):
            raise ValueError(f"packing must be auto, on or off, got {self.packing!r}")
        if self.logprob_chunk is not None and self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1 or None, got {self.logprob_chunk}")
        if self.activation_memory_budget is not None and not 0.0 <= self.activation_memory_budget <= 1.0:
            raise ValueError(f"activation_memory_budget must be in [0, 1], got {self.activation_memory_budget}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")


@dataclass
class VerlConfig:
    """What ``nextstate train --backend verl`` sets in veRL's ``ppo_trainer`` config; anything
    else is reachable through ``overrides`` (Hydra ``key=value`` strings, applied last)."""

    model_dir: Path
    n_gpus_per_node: int = 1
    nnodes: int = 1
    lora: bool = True
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float = 5e-5
    micro_batch_size: int = 4  # per GPU
    gradient_checkpointing: bool = True
    bf16: bool = True  # bf16 compute (FSDP mixed precision); False: fp32 throughout
    param_offload: bool = False
    optimizer_offload: bool = False
    strategy: str = "fsdp2"  # veRL's actor strategy: fsdp (FSDP1) or fsdp2
    clip_grad: float = 1.0  # veRL's gradient-norm clip (the local backend does not clip)
    # None: flash_attention_2 where flash-attn is installed, else sdpa
    attn_implementation: str | None = None
    #: veRL's padding-free packing (``model.use_remove_padding``): a micro-batch's sequences in one
    #: row with position ids restarting per sequence. None: on with flash-attn (varlen kernels),
    #: off otherwise. True with sdpa is exact too — transformers (>= 4.53) builds a block-diagonal
    #: causal mask from the restarting position ids when the attention mask is None (checked in
    #: tests/trainer/test_verl_backend.py) — but sdpa then runs with an explicit mask over the whole packed
    #: row (no flash/cuDNN causal path, attention cost ∝ (micro-batch tokens)²): worth it only where
    #: much of a micro-batch would be padding.
    remove_padding: bool | None = None
    #: veRL's fused log-prob kernels (``model.use_fused_kernels``, torch backend): the log-probs (and
    #: the entropy veRL always computes in its log-prob pass) of the sampled tokens from the hidden
    #: states and the LM head in chunks of 512 tokens, fp32 log-sum-exp, as the local backend's
    #: ``trainer.logprobs`` does. Without it veRL materialises the logits of every token
    #: and, with neither flash-attn nor an NPU, takes ``logprobs_from_logits_v2``: a Python loop of
    #: one log_softmax per *token* (bf16), forward and backward — see benchmarks/trainer/README.md,
    #: "Where a veRL step's time goes". On by default since 2026-11-27: on one H100 the 1.7 B
    #: model's step (64 × 768 tokens) took 4.2 s with it and 15 s without, same trajectory
    #: (tests/trainer/test_verl_kernels.py: same log-probs to 2e-5 and same gradients on the CPU).
    fused_kernels: bool = True
    #: veRL's dynamic micro-batches (``use_dynamic_bsz``): micro-batches packed up to this many
    #: tokens per GPU (prompt + response) instead of ``micro_batch_size`` samples; 0: off
    max_tokens_per_gpu: int = 0
    #: veRL's no-grad log-prob pass over each batch before the update (π_old): "auto" skips it where
    #: nothing reads it — an ``rl`` objective on turns that all carry vLLM's captured log-probs, whose
    #: PPO ratio divides by those (trainer.verl.batch.add_advantages), as the local backend's does; the
    #: pass is a forward over the batch, a fifth to a quarter of a step. "always": veRL's every step
    #: (OPD reads it as the student's log-probs; black-box turns as their own π_old).
    old_logprob_pass: str = "auto"
    #: FSDP2 keeps a layer's gathered parameters from its forward to its backward
    #: (``fsdp_config.reshard_after_forward``; veRL's default True gathers them again for the
    #: backward): one all-gather a layer and micro-batch fewer, for the unsharded parameters held
    #: meanwhile (nothing more on one GPU): 26.0 → 28.3 % MFU with Liger's kernels on one H200, and
    #: 30.6-32.7 % with fused_adam besides (benchmarks/trainer/README.md section 3).
    reshard_after_forward: bool = False
    #: torch's fused AdamW (``optim.override_optimizer_config.fused``: one kernel for every parameter)
    #: instead of veRL's default, the multi-tensor ``foreach`` path; the same update.
    fused_adam: bool = True
    #: Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (veRL's ``model.use_liger``; needs the
    #: ``liger-kernel`` package, which benchmarks/gpu/wheels.sh stages): 19.5 → 26.0 % MFU in
    #: veRL's step on one H200. Off by default: the package is not a dependency.
    liger: bool = False
    ray_address: str | None = None  # None: start a local Ray; "auto" or ray://host:10001: join one
    output_dir: Path = Path("verl-runs")
    seed: int = 0
    overrides: tuple[str, ...] = ()


#: ``nextstate train --online``'s OnlineConfig.siblings_wait_s when the worker makes shadow siblings
#: (NEXTSTATE_SIBLINGS_K > 0): four of its sweeps at their default interval (30 s), which resample a
#: round of the default k = 16 turns at the default 4 a sweep
SIBLINGS_WAIT_S = 120.0


@dataclass
class OnlineConfig:
    """How the loop trains, gates and monitors."""

    k: int = 16  # new scored turns per round
    max_wait_s: float = 600.0  # ... or train on what there is (>= min_turns) after this long
    min_turns: int = 1
    poll_s: float = 2.0
    updates_per_round: int = 1  # optimizer steps over each round's batch
    #: also train each round on the turns of the last N rounds (kept in the trainer's memory, their
    #: loss weighted by the capped importance ratio as stale turns are): a few scored turns a round
    #: teach more than once, and a round whose candidate the gate held back still teaches. 0: none
    replay_rounds: int = 0
    lease_s: float = 600.0
    staleness: int = 2  # S: turns more than S versions behind are stale
    stale_policy: Literal["correct", "drop"] = "correct"
    ratio_cap: float = 2.0  # cap of the importance ratio of corrected stale turns
    # eval gate: held-out prompts (lists of messages) and a scorer (reply, messages) -> [0, 1]
    eval_prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    eval_sessions: int = 0  # also take prompts from the newest N sessions with mode "eval"
    eval_scorer: Scorer | None = None
    eval_threshold: float = 0.05  # refuse a candidate scoring more than this below the active one
    eval_max_tokens: int = 64
    #: replies per held-out prompt, sampled at eval_temperature with the same seeds for every
    #: version (1 at 0: greedy). Sampled replies are what users get, and what drifts off topic first
    eval_samples: int = 1
    eval_temperature: float = 0.0
    # topicality check (trainer.eval_gate): refuse a candidate whose on-topic share on the held-out
    # prompts, scored by topic_scorer (reply, messages) -> [0, 1], is more than topic_margin below
    # that of topic_reference (a served name; None: the base model)
    topic_scorer: Scorer | None = None
    topic_margin: float = 0.05
    topic_reference: str | None = None
    #: what the loop does with the update of a candidate the gate refused: "drop" it (the next round
    #: starts again from the version serving, so the refused round's turns teach nothing) or "keep"
    #: training on top of it while the last promoted version goes on serving, so the gate only decides
    #: what serves (a restarted trainer starts from the version serving either way). The next
    #: candidate's metrics name the refused ones it carries (``carried``)
    refused_update: Literal["drop", "keep"] = "drop"
    # per round, the candidate's drift from the base on the round's tokens (trainer.drift: KL,
    # entropy, top-k mass) into the step's metrics: two no-grad passes over the round's turns
    drift_metrics: bool = False
    #: the KL anchor adapted per round toward this KL(candidate ‖ base) per reply token (k3, on the
    #: round's turns; veRL's AdaptiveKLController, Ziegler et al. 2019): after each round the
    #: objective's kl_coef, its starting value, is multiplied by 1 + clip(KL / kl_target − 1, ±0.2) /
    #: kl_horizon. A fixed coefficient slows the drift from the base without bounding it (GPU runs:
    #: k3 0.06-0.14 after one round, 0.43-0.65 after five, as the replies leave the topic). None:
    #: the coefficient stays fixed. Needs kl_coef > 0; computes the drift metrics every round
    kl_target: float | None = None
    kl_horizon: float = 1.0  # rounds: at 1, the coefficient moves at most 20 % a round
    #: with kl_target: the coefficient never falls below its starting value, so the anchor only
    #: tightens. veRL's controller moves both ways alike; a faster one (kl_horizon 0.25: up to ×1.8 a
    #: round) then also drops the coefficient ×0.2 a round while the drift is under the target, and
    #: cannot rise fast enough once it is over (GPU runs, kl_horizon 1: KL 0.75 at round 6 against a
    #: target of 0.3, the coefficient at 0.095 from 0.1)
    kl_floor: bool = False
    #: with a top-k OPD objective (ObjectiveConfig.opd_topk): top-k OPD for the first N rounds, then the
    #: sampled-token OPD advantage from round N + 1 on (the same teacher passes, their sampled tokens'
    #: log-probs). Top-k learns fastest at first and then leaves the topic; sampled-token combined keeps
    #: it (GPU runs, 60 interactions: combined+topk 0.64 at 12 against 0.47, on topic 0.65-0.92 against
    #: 0.96 for combined). 0: top-k every round
    opd_topk_rounds: int = 0
    #: shadow siblings (the worker's NEXTSTATE_SIBLINGS_K): after leasing a round, wait up to this long for
    #: its turns' siblings to be resampled and scored, so they train in their turn's group; a sibling scored
    #: after its turn trained never trains (leases never hand one out). On the GPU, four siblings a turn took
    #: the personal agent's curve from 0.72 to 0.81 at 18 interactions (benchmarks/gpu/results/README.md,
    #: "Shadow siblings on plain combined"). 0: train on what is scored when the round is leased
    siblings_wait_s: float = 0.0
    # live monitor
    rollback_window: int = 16  # live scored turns of a version before it is judged
    rollback_threshold: float = 0.5  # roll back when its mean reward is this far below its parent's
    version_prefix: str = "online"
    max_rounds: int | None = None
    # a round a vLLM could not take (down, restarting): its turns go back to the pool and the
    # loop tries again after poll_s * 2^n seconds (n failures in a row), at most this long
    retry_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.kl_target is not None and self.kl_target <= 0:
            raise ValueError(f"kl_target must be > 0 (or None: a fixed kl_coef), got {self.kl_target}")
        if self.kl_horizon <= 0:
            raise ValueError(f"kl_horizon must be > 0, got {self.kl_horizon}")
        if self.siblings_wait_s < 0:
            raise ValueError(f"siblings_wait_s must be >= 0 (0: no wait), got {self.siblings_wait_s}")
        if self.eval_samples < 1 or self.eval_temperature < 0:
            raise ValueError(f"eval_samples must be >= 1 and eval_temperature >= 0, got {self.eval_samples}, "
                             f"{self.eval_temperature}")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError("eval_samples > 1 samples each held-out prompt: give an eval_temperature > 0 "
                             "(at 0 every sample is the greedy reply)")
        if self.refused_update not in ("drop", "keep"):
            raise ValueError(f"refused_update is 'drop' or 'keep', got {self.refused_update!r}")
        if self.opd_topk_rounds < 0:
            raise ValueError(f"opd_topk_rounds is a number of rounds >= 0 (0: every round), got {self.opd_topk_rounds}")


@dataclass(frozen=True)
class RunLimits:
    """How an offline run (either backend) walks the pool: its defaults, shared by the CLI and
    ``trainer.offline.train_offline`` / ``trainer.verl.backend.train_verl``."""

    batch_size: int = 8  # turns per optimizer step
    epochs: int = 1  # passes over the pool
    lease_s: float = 600.0  # a leased batch not acked this long goes back to the pool
    push_every: int = 0  # veRL: push the weights every N steps; 0: at the end only
