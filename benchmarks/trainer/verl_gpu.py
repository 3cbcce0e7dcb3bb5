"""The veRL backend on 1, 2 and 4 GPUs beside the local backend on 1 GPU: the same job.

    python benchmarks/trainer/verl_gpu.py all --out DIR [--models smollm2 qwen3-1.5b] [--gpus 1 2 4]
    python benchmarks/trainer/verl_gpu.py all --out DIR --models qwen3-1.5b --scaling weak \
        --per-gpu-batch 64 --micro-batch-size 8 --verl fused=1,2 --verl plain=1
    python benchmarks/trainer/verl_gpu.py table DIR/results.json [MORE.json ...] [--acceptance OUT.json]

``all`` runs, each in a fresh process (a fresh Ray cluster for veRL), one after another:

1. ``prepare`` per model: a randomly initialised model of that architecture (seed 0; the
   SmolLM2 tokenizer beside it, see bench.py) and the job's samples: ``--batch-size`` samples of
   ``--prompt-len`` + ``--response-len`` random token ids, reward +1 / −1 alternating (no task
   groups: A = r), behaviour logprobs = the initial model's own (so the PPO ratio starts at 1
   and moves as the policy moves, like turns captured from the version being trained).
2. ``run --backend local`` (``trainer.local.LocalTrainer``, 1 GPU) and ``run --backend verl
   --gpus N`` (``trainer.verl.backend.VerlTrainer``: veRL's Ray trainer, FSDP2 over N GPUs) for
   each mode (full fine-tuning; LoRA with ``--lora``) and each veRL variant (``--verl
   NAME=GPUS``; :data:`VARIANTS`: ``plain`` = veRL's default log-prob path, ``fused`` = its fused
   log-prob kernels, ``fused-rmpad`` = also padding-free packing). Each run does ``--warmup`` +
   ``--steps`` optimizer steps over the same batch (the same job: one batch, one step each) and
   records per step the wall time, veRL's own phase timings (``timing_s/*``: the log-prob pass,
   the update ...), pg_loss, and the mean per-token logprob of the +1 and of the −1 replies under
   the policy before that step (and after the last).

Scaling (``--scaling``): **strong** (default) = one batch of ``--batch-size`` samples, split over
the N GPUs; **weak** = ``--per-gpu-batch`` samples per GPU, so N GPUs train on N × that many
(the first N × per-GPU samples of one prepared set; the local backend on its 1 GPU takes the
per-GPU batch) — what issue #20's target asks: the 2-GPU throughput at a per-GPU batch that fills
the card against twice one GPU's.

Columns: tok/s = batch × (prompt + response) tokens ÷ mean timed step seconds; per GPU =
that ÷ GPUs; scaling = (tok/s on N GPUs) ÷ (N × tok/s of the same backend, mode and variant on 1
GPU); MFU (6N) = bench.py's definition (``bench.mfu``: 6 · N · tok/s per GPU ÷ the card's peak
dense bf16 rate, N = matrix-product parameters, ``bench.matmul_params``); "MFU + no-grad fwd" =
8N where the step also ran a no-grad forward over the batch (veRL's log-prob pass before the update:
under ``VerlConfig.old_logprob_pass`` "auto" it is skipped for this job, an ``rl`` objective on turns
with captured log-probs, and the ``fused-always`` variant runs it every step, as veRL did before; the
local backend runs one for ``rl`` only with stale turns);
log-prob pass / update / other = veRL's ``timing_s/old_log_prob``, ``timing_s/update_actor`` and
the rest of the step's wall time (driver: batch building, advantages, Ray round trips); peak
memory: ``torch.cuda.max_memory_allocated()`` of the local process, veRL's
``perf/max_memory_allocated_gb`` (rank 0's actor worker) for veRL. veRL's gradient clip is
disabled (``--clip-grad``, default 1e9) so both backends take the same optimizer step; both keep
fp32 master weights (veRL: FSDP mixed precision, bf16 compute; local: ``fp32_master``).

``--profile`` (``all``; ``run --profile-step N``): veRL's own torch profiler traces one more step
after the timed ones (itself not timed) of each veRL run (its ``global_profiler``,
:func:`profile_overrides`); the traces stay beside the run's JSON, and :func:`trace_summary` puts in
it, and in the tables, the GPU's busy share of the traced window and the kernels and CPU ops that
took longest: what an MFU far below the card's peak is spent on. ``--profile-stacks`` (with it):
the profiler also records Python stacks, and each of those ops (and the host syncs and dtype
copies of :data:`WATCHED_OPS`) is attributed to the code that called it: the innermost Python frame
outside torch itself (:func:`op_callers`).

``all`` writes ``results.json`` (each run), ``results.md`` (the tables) and ``acceptance.json``
(:func:`acceptance`: ``verl_mfu``, ``verl_weak_scaling_2`` as fractions, and each veRL run's); ``table
--acceptance`` writes the last for runs of several calls together.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)


def _samples(path: Path):  # noqa: ANN202
    from trainer.samples import Sample

    return [Sample(**d) for d in json.loads(path.read_text())]


# ------------------------------------------------------------------------------------ prepare


def prepare(args: argparse.Namespace) -> None:
    import dataclasses

    import torch

    import bench
    from trainer.local import LocalConfig, LocalTrainer
    from trainer.objectives import ObjectiveConfig

    out = Path(args.out)
    model_dir = bench.build_random_model_dir(args.model, Path(args.tokenizer_dir), [], out / "model", seed=0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    samples = bench.synthetic_samples(args.batch_size, args.prompt_len, args.response_len, vocab, seed=1)
    samples = [dataclasses.replace(s, group_id=None, reward=1.0 if i % 2 == 0 else -1.0)
               for i, s in enumerate(samples)]
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir, lora=False), ObjectiveConfig())
    with torch.no_grad():
        lp, mask = trainer.response_logprobs(samples)
    samples = [dataclasses.replace(s, behaviour_logprobs=lp[i, : int(mask[i].sum())].float().cpu().tolist())
               for i, s in enumerate(samples)]
    (out / "samples.json").write_text(json.dumps([dataclasses.asdict(s) for s in samples]))
    print(f"# prepared {args.model}: {model_dir}, {len(samples)} samples", flush=True)


# ---------------------------------------------------------------------------------------- run


def _direction(lp, mask, rewards) -> tuple[float, float]:  # noqa: ANN001
    import torch

    per = ((lp.float().cpu() * mask.cpu()).sum(-1) / mask.cpu().sum(-1))
    r = torch.tensor(rewards)
    return float(per[r > 0].mean()), float(per[r < 0].mean())


#: the class veRL's FSDP2 wrap policy names so that the root is the model's only unit with parameters:
#: Qwen3's rotary embedding, one module without parameters (``liger-onewrap-fusedadam``; Qwen3 models only)
ONE_UNIT_WRAP = "Qwen3RotaryEmbedding"

#: VerlConfig's settings at veRL's own defaults: the base every variant below changes (VerlConfig's own
#: defaults are liger-noreshard-fusedadam's without Liger, the fastest measured; the variants keep the
#: meaning they were measured with)
VERL_OWN_DEFAULTS = {"reshard_after_forward": True, "fused_adam": False, "liger": False}

#: the pieces the variants below are made of: veRL's fused-kernel log-prob path without remove-padding, and
#: the overrides (``run --override``, VerlConfig.overrides) the variants add to it
FUSED = ["--fused-kernels", "--remove-padding", "off"]
LIGER = "--override=actor_rollout_ref.model.use_liger=true"
NORESHARD = "--override=actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"
FUSED_ADAM = "--override=actor_rollout_ref.actor.optim.override_optimizer_config.fused=true"
FSDP1 = ["--override=actor_rollout_ref.actor.strategy=fsdp",
         "--override=actor_rollout_ref.actor.fsdp_config.strategy=fsdp"]
ONE_UNIT = ("--override=actor_rollout_ref.actor.fsdp_config.wrap_policy."
            f"transformer_layer_cls_to_wrap=[{ONE_UNIT_WRAP}]")

#: veRL variants ``all --verl NAME=GPUS`` runs: the ``run`` options of each
VARIANTS: dict[str, list[str]] = {
    "plain": ["--no-fused-kernels", "--remove-padding", "off"],
    "fused": [*FUSED],
    "fused-rmpad": ["--fused-kernels", "--remove-padding", "on"],
    # veRL's log-prob pass every step, as before VerlConfig.old_logprob_pass "auto" skipped it here
    "fused-always": [*FUSED, "--old-logprob-pass", "always"],
    # FSDP2 keeps the gathered parameters from the forward to the backward (memory for fewer all-gathers)
    "fused-noreshard": [*FUSED, NORESHARD],
    # veRL's torch.compile of the actor (trainer.verl.config turns it off: eager is what was measured)
    "fused-compile": [*FUSED, "--override=actor_rollout_ref.actor.fsdp_config.use_torch_compile=true"],
    # Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (veRL's model.use_liger; liger-kernel from
    # benchmarks/gpu/wheels.sh): the profiled fused step (micro-batch 16) spent more GPU time in elementwise
    # kernels (fp32 multiplies, dtype copies: RMSNorm's upcasts) than in its matmuls
    "fused-liger": [*FUSED, LIGER],
    # the liger step still waited on the host a third of the time, most of it dtype copies (aten::to): the
    # model built in bf16 (veRL's fsdp_config.model_dtype; parameters, gradients and Adam's moments in bf16,
    # no fp32 master) leaves FSDP2's mixed precision nothing to cast; and the same kept gathered
    "liger-bf16": [*FUSED, LIGER, "--override=actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"],
    "liger-noreshard": [*FUSED, LIGER, NORESHARD],
    # the same with torch's fused AdamW (one kernel for all parameters; veRL builds torch.optim.AdamW with
    # its default, the multi-tensor "foreach" path) through veRL's optim.override_optimizer_config
    "liger-noreshard-fusedadam": [*FUSED, LIGER, NORESHARD, FUSED_ADAM],
    # FSDP1 instead of FSDP2: one flat parameter per wrapped layer and no DTensors, so no per-parameter casts,
    # DTensor dispatch or FSDP2 post-backward hooks on the host (the liger steps' traces above: dtype copies,
    # PythonSubclass, RegisterPostBackwardFunctionBackward)
    "liger-fsdp1": [*FUSED, LIGER, *FSDP1],
    # the two together: FSDP1 (it has no FSDP2 post-backward hook per layer, 2.6 ms of host time each in the
    # traced liger-noreshard step) with the fused AdamW (30.6 % against 24.5-28.3 % without it)
    "liger-fsdp1-fusedadam": [*FUSED, LIGER, *FSDP1, FUSED_ADAM],
    # liger-noreshard-fusedadam with the whole model as one FSDP2 unit instead of one per decoder layer: on one
    # GPU sharding buys nothing, and each unit costs the host its hooks per micro-batch (the post-backward
    # one 2.6 ms a layer in the traced step). veRL wraps the classes its wrap policy names on their own, then
    # the root; naming Qwen3's rotary embedding (no parameters) leaves every parameter to the root
    "liger-onewrap-fusedadam": [*FUSED, LIGER, NORESHARD, FUSED_ADAM, ONE_UNIT],
    # the same in micro-batches of 32 turns instead of the run's (16 in the runs on the page): half the
    # launches and host hooks per token. The run's --micro-batch-size is given again after the run's own,
    # so the result's JSON records 32 (argparse keeps the last)
    "liger-onewrap-fusedadam-mb32": [*FUSED, LIGER, NORESHARD, FUSED_ADAM, ONE_UNIT, "--micro-batch-size", "32"],
    # liger-noreshard-fusedadam in micro-batches of 32 and of 64 (the whole per-GPU batch of the runs on the
    # page: one forward and backward a step); one FSDP2 unit gained nothing at 16 (32.1 % against 32.7 %)
    "liger-noreshard-fusedadam-mb32": [*FUSED, LIGER, NORESHARD, FUSED_ADAM, "--micro-batch-size", "32"],
    "liger-noreshard-fusedadam-mb64": [*FUSED, LIGER, NORESHARD, FUSED_ADAM, "--micro-batch-size", "64"],
}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "verl", "ray", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def run(args: argparse.Namespace) -> None:
    import torch

    import bench
    from trainer.objectives import ObjectiveConfig

    samples = _samples(Path(args.samples))
    if args.batch_size:
        if args.batch_size > len(samples):
            raise SystemExit(f"--batch-size {args.batch_size}: only {len(samples)} samples prepared")
        samples = samples[: args.batch_size]
    rewards = [s.reward for s in samples]
    objective = ObjectiveConfig(objective="rl", grpo=False)
    model_dir = Path(args.model_dir)
    lora = args.mode == "lora"
    n_steps = max(args.warmup + args.steps, args.profile_step + 1 if args.profile_step else 0)
    started = time.perf_counter()
    no_grad_pass = args.backend == "verl"  # veRL's log-prob pass; "auto" skips it for this rl job (below)
    if args.backend == "local":
        from trainer.local import LocalConfig, LocalTrainer

        trainer = LocalTrainer(LocalConfig(model_dir=model_dir, lora=lora, lr=args.lr, compile=args.local_compile,
                                           micro_batch_size=args.micro_batch_size), objective)

        def logprobs():  # noqa: ANN202
            with torch.no_grad():
                return trainer.response_logprobs(samples)
        gpus = 1
    else:
        from trainer.config import VerlConfig
        from trainer.verl.backend import VerlTrainer

        gpus = args.gpus
        remove_padding = {"auto": None, "on": True, "off": False}[args.remove_padding]
        trace_dir = Path(args.json).with_name(Path(args.json).stem + "-trace")  # beside the run's JSON
        profiling = profile_overrides(args.profile_step, trace_dir, args.profile_stacks) if args.profile_step else []
        cfg = VerlConfig(model_dir=model_dir, n_gpus_per_node=gpus, lora=lora, lr=args.lr,
                         micro_batch_size=args.micro_batch_size, clip_grad=args.clip_grad,
                         gradient_checkpointing=args.gradient_checkpointing, fused_kernels=args.fused_kernels,
                         remove_padding=remove_padding, max_tokens_per_gpu=args.max_tokens_per_gpu,
                         old_logprob_pass=args.old_logprob_pass, **VERL_OWN_DEFAULTS,
                         overrides=(*args.override, *profiling),
                         output_dir=Path(args.json).parent / f"verl-{args.mode}-{args.variant or 'x'}-{gpus}",
                         ray_address=None)
        trainer = VerlTrainer(cfg, objective, batch_size=len(samples), total_steps=n_steps)

        def logprobs():  # noqa: ANN202
            return trainer.response_logprobs(samples)
    setup_s = time.perf_counter() - started
    print(f"# {args.backend} {args.mode} {args.variant} gpus={gpus}: {len(samples)} samples, set up in "
          f"{setup_s:.1f}s", flush=True)
    steps = []
    for i in range(n_steps):
        # the policy before this step's update, outside the timing: veRL's own pass gives it in the step,
        # unless VerlConfig.old_logprob_pass "auto" skips that pass (this rl job of captured turns)
        lp, mask = logprobs() if args.backend == "local" or args.old_logprob_pass == "auto" else (None, None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = trainer.step(samples)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if args.backend != "local" and m.get("actor/old_log_prob_pass", 1.0):
            # the current policy's logprobs veRL computed in the step
            done = trainer.trainer.last_batch
            order = {tid: k for k, tid in enumerate(done.non_tensor_batch["turn_id"])}
            idx = torch.tensor([order[s.turn_id] for s in samples])
            lp, mask = done.batch["current_log_probs"][idx], done.batch["response_mask"][idx]
        elif args.backend != "local":  # the pass skipped: lp, mask from before the step
            no_grad_pass = False
        else:
            no_grad_pass = bool(getattr(trainer, "last_step_no_grad_pass", False))
        pos, neg = _direction(lp, mask, rewards)
        timing = {k.removeprefix("timing_s/"): v for k, v in m.items() if k.startswith("timing_s/")}
        steps.append({"step": i, "seconds": seconds, "pg_loss": m["pg_loss"], "lp_pos": pos, "lp_neg": neg,
                      "clipfrac": m.get("pg_clipfrac", 0.0), "warmup": i < args.warmup, "timing": timing,
                      "profiled": bool(args.profile_step) and i == args.profile_step,
                      "verl_mfu": {k: v for k, v in m.items() if k.startswith("perf/mfu/")},
                      "mem_gb": max((v for k, v in m.items() if "max_memory_allocated" in k), default=None)})
        phases = " ".join(f"{k} {timing[k]:.2f}s" for k in ("old_log_prob", "update_actor") if k in timing)
        print(f"# {time.strftime('%H:%M:%S')} {args.backend} {args.mode} {args.variant} gpus={gpus} step {i}: "
              f"{seconds:.3f}s {phases} loss {m['pg_loss']:+.5f} lp+ {pos:.5f} lp- {neg:.5f}", flush=True)
    pos, neg = _direction(*logprobs(), rewards)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if args.backend == "local"
            else max(s["mem_gb"] or 0.0 for s in steps))
    written = None
    if args.backend == "verl" and args.push:
        written = trainer.push(publish=False)
        print(f"# wrote {written['kind']} weights: {written['path']} ({written['tensors']} tensors, "
              f"{written['bytes'] / 2**20:.1f} MiB) in {written['seconds']:.2f}s", flush=True)
    cfg_json = json.loads((model_dir / "config.json").read_text())
    n_total, n_matmul, tied = bench.matmul_params_of_dir(model_dir)
    device = torch.cuda.get_device_name(0)
    result = {
        "backend": args.backend, "mode": args.mode, "gpus": gpus, "model": args.model,
        "variant": args.variant if args.backend == "verl" else ("compile" if args.local_compile else ""),
        "scaling": args.scaling, "micro_batch": args.micro_batch_size,
        "architecture": cfg_json["architectures"][0], "batch": len(samples),
        "prompt_len": len(samples[0].prompt_ids), "response_len": len(samples[0].response_ids),
        "setup_s": setup_s, "steps": steps, "final_lp_pos": pos, "final_lp_neg": neg, "peak_gb": peak,
        "device": device, "written": written, "n_params": n_total, "n_matmul": n_matmul, "tied": tied,
        "peak_tflops": bench.peak_tflops(device), "no_grad_pass": no_grad_pass, "versions": _versions(),
    }
    if args.backend == "verl" and args.profile_step:
        traces = sorted(trace_dir.glob("*.json*"))
        result["profile"] = {"step": args.profile_step, **trace_summary(traces)} if traces else {
            "step": args.profile_step, "traces": 0}
    if args.backend == "verl":
        result["verl_options"] = {"fused_kernels": args.fused_kernels, "remove_padding": args.remove_padding,
                                  "max_tokens_per_gpu": args.max_tokens_per_gpu, "override": list(args.override),
                                  "gradient_checkpointing": args.gradient_checkpointing}
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.backend == "verl":
        trainer.shutdown()


# ------------------------------------------------------------------------------------ profile


def profile_overrides(step: int, save_path: Path, stacks: bool = False) -> list[str]:
    """veRL's own torch profiler on the actor (``VerlConfig.overrides``) for step *step*: a chrome
    trace per rank, ``*.json.gz`` in *save_path*. Steps count from 0 as :func:`run`'s do (veRL's
    ``global_steps``, which our driver, ``trainer.verl.ppo``, advances after each step from 0, and
    whose profiler can start from the second step on: it decides at the end of one step whether to
    trace the next)."""
    if step < 1:
        raise ValueError(f"veRL's profiler traces step 1 or later, not {step}")
    # the actor's tool and save_path set on the actor too: its defaults point at global_profiler's, but the
    # worker gets actor_rollout_ref alone, where they resolve to null (a no-op profiler, no trace)
    return ["global_profiler.tool=torch", f"global_profiler.steps=[{step}]", f"global_profiler.save_path={save_path}",
            "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.all_ranks=true",
            "actor_rollout_ref.actor.profiler.tool=torch", f"actor_rollout_ref.actor.profiler.save_path={save_path}",
            # veRL's torch profiler records Python stacks only when its contents name them (empty: none)
            *(["actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cuda,stack]"] if stacks else [])]


#: CPU ops whose callers a traced step with stacks names whether or not they are among the longest: the
#: host's waits on the GPU (a nonzero's or an item's result read back) and the dtype copies
WATCHED_OPS = ("aten::_to_copy", "aten::nonzero", "aten::_local_scalar_dense", "aten::item")


def _trace_events(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        raw = gzip.open(path, "rt") if path.suffix == ".gz" else open(path)
        with raw as f:
            events = json.load(f)
        yield from events.get("traceEvents", events) if isinstance(events, dict) else events


def _own_frame(name: str) -> bool:
    """A Python frame of the code that calls torch, not of torch itself or a built-in."""
    return not name.startswith(("<", "torch/"))


def op_callers(events: list[dict[str, Any]], names: set[str], top: int = 4) -> dict[str, list[dict[str, Any]]]:
    """For each CPU op named in *names*, the Python frames that called it, most time first: the
    innermost frame outside torch and the built-ins (``_own_frame``) of the ``python_function``
    events enclosing the op on its thread (torch's profiler with ``with_stack``), "(no Python
    frame)" where none encloses it (autograd's backward runs on a thread of its own); and, where it
    is torch's own (an FSDP hook's cast, an optimizer's copy), the innermost frame that is not a
    built-in (``via``)."""
    threads: dict[tuple[Any, Any], list[tuple[float, int, float, str]]] = {}
    for ev in events:
        cat = ev.get("cat")
        if cat == "python_function" or (cat == "cpu_op" and ev.get("name") in names):
            ts, dur = float(ev["ts"]), float(ev["dur"])
            # at one instant: frames before ops, the outer (longer) frame first
            threads.setdefault((ev.get("pid"), ev.get("tid")), []).append(
                (ts, 1 if cat == "cpu_op" else 0, -dur, ev.get("name", "?")))
    found: dict[str, dict[tuple[str, str], list[float]]] = {}
    for items in threads.values():
        items.sort()
        stack: list[tuple[float, str]] = []  # the enclosing frames: (end, name), innermost last
        for ts, is_op, neg_dur, name in items:
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if not is_op:
                stack.append((ts - neg_dur, name))
                continue
            caller = next((frame for _, frame in reversed(stack) if _own_frame(frame)), "(no Python frame)")
            via = next((frame for _, frame in reversed(stack) if not frame.startswith("<")), caller)
            found.setdefault(name, {}).setdefault((caller, via), []).append(-neg_dur)
    return {op: [{"frame": frame, **({"via": via} if via != frame else {}), "calls": len(durs), "ms": sum(durs) / 1e3}
                 for (frame, via), durs in sorted(frames.items(), key=lambda kv: -sum(kv[1]))[:top]]
            for op, frames in found.items()}


def trace_summary(paths: list[Path], top: int = 12) -> dict[str, Any]:
    """Where a profiled step's time went, from torch's chrome traces (``.json`` or ``.json.gz``):
    the traced window, the GPU's busy time in it (the union of its kernels' intervals, so kernels
    overlapping on streams count once), and the kernels and CPU ops (each with its callees) that
    took longest in all. A GPU busy for a small share of the window is waiting on the CPU: on the
    host's launches, Python, or the data pipeline. A trace with Python stacks adds ``callers``:
    :func:`op_callers` of the six longest CPU ops and of :data:`WATCHED_OPS`."""
    kernels: dict[str, list[float]] = {}
    ops: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    start, end = float("inf"), float("-inf")
    events = list(_trace_events(paths))
    stacks = False
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat = ev.get("cat", "")
        if cat == "python_function":  # a frame of the stacks: not a span of the step's own work
            stacks = True
            continue
        ts, dur = float(ev["ts"]), float(ev["dur"])
        start, end = min(start, ts), max(end, ts + dur)
        table = kernels if cat == "kernel" else ops if cat == "cpu_op" else None
        if table is not None:
            table.setdefault(ev.get("name", "?"), []).append(dur)
        if cat == "kernel":
            spans.append((ts, ts + dur))
    busy, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    window = max(end - start, 0.0)

    def ranked(table: dict[str, list[float]]) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda kv: -sum(kv[1]))[:top]
        return [{"name": name, "calls": len(durs), "ms": sum(durs) / 1e3} for name, durs in rows]

    summary = {"traces": len(paths), "window_ms": window / 1e3, "gpu_busy_ms": busy / 1e3,
               "gpu_busy": busy / window if window else 0.0, "kernels": ranked(kernels), "cpu_ops": ranked(ops)}
    if stacks:
        named = {row["name"] for row in summary["cpu_ops"][:6]} | (set(WATCHED_OPS) & ops.keys())
        summary["callers"] = op_callers(events, named)
    return summary


# ---------------------------------------------------------------------------------------- all


def _sub(argv: list[str], env: dict[str, str], timeout: float, log) -> int:  # noqa: ANN001
    print(f"$ [{time.strftime('%H:%M:%S')}] " + " ".join(argv), flush=True)
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write(out)
        log.flush()
        print(f"# timed out after {timeout:.0f}s; last lines:\n" + "\n".join(out.splitlines()[-15:]), flush=True)
        return 124
    log.write(proc.stdout)
    log.flush()
    keep = [ln for ln in proc.stdout.splitlines() if ln.startswith("#") or "Error" in ln or "error" in ln]
    print("\n".join(keep[-40:]), flush=True)
    if proc.returncode:
        print(f"# exit status {proc.returncode}; last lines:\n" + "\n".join(proc.stdout.splitlines()[-30:]),
              flush=True)
    return proc.returncode


def parse_variants(specs: list[str], default_gpus: list[int]) -> list[tuple[str, list[int]]]:
    """``["fused=1,2", "plain=1", "fused"]`` → ``[("fused", [1, 2]), ("plain", [1]), ("fused", default)]``."""
    out = []
    for spec in specs:
        name, _, gpus = spec.partition("=")
        if name not in VARIANTS:
            raise SystemExit(f"unknown veRL variant {name!r}; known: {', '.join(VARIANTS)}")
        out.append((name, [int(g) for g in gpus.split(",")] if gpus else list(default_gpus)))
    return out


def plan_runs(args: argparse.Namespace, model: str) -> list[tuple[str, str, int, str, int]]:
    """(backend, mode, GPUs, variant, batch) of each run of ``all``, in order."""
    variants = parse_variants(args.verl or ["fused"], args.gpus)

    def batch(gpus: int) -> int:
        return args.per_gpu_batch * gpus if args.scaling == "weak" else args.batch_size

    plan = []
    for name, gpus_list in variants:
        plan += [("verl", "full", g, name, batch(g)) for g in gpus_list]
    if args.local:  # last: the reference, where a time budget cuts the plan short
        plan.append(("local", "full", 1, "", batch(1)))
    if args.lora and model == args.models[0]:
        plan += [("verl", "lora", 1, variants[0][0], batch(1))]
        if args.local_lora:
            plan += [("local", "lora", 1, "", batch(1))]
    return plan


def visible_devices(gpus: int, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a run on *gpus* GPUs: the first *gpus* of those the caller made
    visible (*visible*), else of all. A run on 1 GPU under ``CUDA_VISIBLE_DEVICES=1`` takes GPU 1, not
    GPU 0: the 2-GPU lease of 2026-11-30 ran this benchmark "on GPU 1" beside an agents run on GPU 0,
    and both shared GPU 0."""
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpus)]
    if len(ids) < gpus:
        raise SystemExit(f"a run on {gpus} GPU(s) but CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)}")
    return ",".join(ids[:gpus])


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    results = []
    deadline = time.monotonic() + args.budget_s
    with open(out / "runs.log", "a") as log:
        for model in args.models:
            mdir = out / model
            plan = plan_runs(args, model)
            prepared = max(b for *_, b in plan)
            if _sub(["prepare", "--model", model, "--out", str(mdir), "--tokenizer-dir", args.tokenizer_dir,
                     "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
                     "--batch-size", str(prepared)], env, args.prepare_timeout, log):
                continue
            for backend, mode, gpus, variant, batch in plan:
                left = deadline - time.monotonic()
                if left < 30:
                    print(f"# out of time budget: skipping {model} {backend} {mode} {variant} {gpus}", flush=True)
                    continue
                lr = args.lr_lora if mode == "lora" else args.lr
                res = out / f"{model}-{backend}-{mode}{'-' + variant if variant else ''}-{gpus}.json"
                run_env = dict(env, CUDA_VISIBLE_DEVICES=visible_devices(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")))
                argv = ["run", "--backend", backend, "--mode", mode, "--gpus", str(gpus), "--model", model,
                        "--model-dir", str(mdir / "model"), "--samples", str(mdir / "samples.json"),
                        "--batch-size", str(batch), "--scaling", args.scaling,
                        "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(lr),
                        "--micro-batch-size", str(args.micro_batch_size), "--clip-grad", str(args.clip_grad),
                        "--json", str(res)]
                if backend == "verl":
                    argv += ["--variant", variant, *VARIANTS[variant], *(f"--override={o}" for o in args.override)]
                    if args.max_tokens_per_gpu:
                        argv += ["--max-tokens-per-gpu", str(args.max_tokens_per_gpu)]
                    if args.profile or args.profile_stacks:  # one more step after the timed ones, traced
                        argv += ["--profile-step", str(args.warmup + args.steps)]
                        argv += ["--profile-stacks"] if args.profile_stacks else []
                    if args.push and (mode == "lora" or gpus == max(args.gpus)):
                        argv += ["--push"]
                elif args.local_compile:
                    argv += ["--local-compile"]
                if _sub(argv, run_env, min(args.run_timeout, left), log) == 0 and res.is_file():
                    results.append(json.loads(res.read_text()))
                    (out / "results.json").write_text(json.dumps(results, indent=1))
                    (out / "results.md").write_text(tables(results) + "\n")
                    (out / "acceptance.json").write_text(json.dumps(acceptance(results), indent=1))
    print(tables(results), flush=True)


# -------------------------------------------------------------------------------------- tables


def _timed(r: dict) -> list[dict]:
    return [s for s in r["steps"] if not s["warmup"] and not s.get("profiled")]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def summarise(results: list[dict]) -> list[dict]:
    """Per run: s/step (mean, min, max), tok/s, tok/s per GPU, scaling efficiency against the same backend,
    mode and variant on 1 GPU of the same card (``efficiency``; None where there is none, and for the local
    backend), MFU (6N per GPU, ``bench.mfu``), "hfu" (8N where the step ran a no-grad forward too, else = MFU)
    and veRL's mean phase seconds (log-prob pass, update, the rest)."""
    import bench

    def key(r: dict) -> tuple:
        return (r["model"], r["backend"], r["mode"], r.get("variant", ""), r.get("scaling", "strong"), r.get("device"))

    rows = []
    for r in results:
        timed = [s["seconds"] for s in _timed(r)]
        mean = _mean(timed)
        tok_s = r["batch"] * (r["prompt_len"] + r["response_len"]) / mean
        rows.append({**r, "s_mean": mean, "s_min": min(timed), "s_max": max(timed), "tok_s": tok_s,
                     "tok_s_gpu": tok_s / r["gpus"]})
    base = {key(r): r for r in rows if r["gpus"] == 1}
    for r in rows:
        b = r if r["gpus"] == 1 else base.get(key(r))  # a 1-GPU run against itself, not a repeat of it
        r["efficiency"] = (r["tok_s"] / (r["gpus"] * b["tok_s"])
                           if r["backend"] == "verl" and b is not None else None)
        n, peak = r.get("n_matmul"), r.get("peak_tflops")
        r["mfu"] = bench.mfu(n, r["tok_s_gpu"], peak) if n else None
        r["hfu"] = bench.mfu(n, r["tok_s_gpu"], peak, 8 if r.get("no_grad_pass") else 6) if n else None
        phases = [s.get("timing", {}) for s in _timed(r)]
        for name in ("old_log_prob", "update_actor"):
            vals = [p[name] for p in phases if name in p]
            r[f"t_{name}"] = _mean(vals) if vals else None
        known = [r[f"t_{n}"] for n in ("old_log_prob", "update_actor") if r[f"t_{n}"] is not None]
        r["t_other"] = r["s_mean"] - sum(known) if known else None
    return rows


def acceptance(results: list[dict]) -> dict:
    """The fields issue #45's acceptance compares runs by, as fractions: ``verl_mfu``, the best 6N MFU of a
    veRL full fine-tuning run on one GPU, with its variant, micro-batch, model and device; ``verl_weak_scaling_2``,
    the best weak-scaling efficiency of a veRL run on two GPUs against the same variant on one (None where
    no such pair ran); ``runs``: each veRL run's MFU and efficiency."""
    rows = [r for r in summarise(results) if r["backend"] == "verl" and r["mode"] == "full"]
    runs = [{"model": r["model"], "variant": r.get("variant", ""), "gpus": r["gpus"], "scaling": r.get("scaling"),
             "micro_batch": r.get("micro_batch"), "device": r.get("device"), "verl_mfu": r["mfu"],
             "efficiency": r["efficiency"]} for r in rows]
    one = [r for r in runs if r["gpus"] == 1 and r["verl_mfu"] is not None]
    two = [r for r in runs if r["gpus"] == 2 and r.get("scaling") == "weak" and r["efficiency"] is not None]
    best = max(one, key=lambda r: r["verl_mfu"], default=None)
    best2 = max(two, key=lambda r: r["efficiency"], default=None)
    return {"verl_mfu": best and best["verl_mfu"],
            "verl_mfu_run": best and {k: best[k] for k in ("model", "variant", "micro_batch", "device")},
            "verl_weak_scaling_2": best2 and best2["efficiency"],
            "verl_weak_scaling_2_run": best2 and {k: best2[k] for k in ("model", "variant", "micro_batch", "device")},
            "runs": runs}


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f} %"


def _pct1(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _sec(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _cell(row: dict | None) -> str:
    return f"{row['name'][:60]} | {row['calls']} | {row['ms']:,.1f}" if row else " | | "


def _label(r: dict, r0: dict) -> str:
    """A row's "mode, variant" cell; with its micro-batch where it is not the table's (a variant that sets its
    own, ``…-mb32``)."""
    label = r["mode"] + (f", {r['variant']}" if r.get("variant") else "")
    if r.get("micro_batch") != r0.get("micro_batch"):
        label += f", micro-batch {r['micro_batch']}"
    return label


def tables(results: list[dict]) -> str:
    lines = []
    rows = summarise(results)
    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        r0 = mrows[0]
        scaling = r0.get("scaling", "strong")
        per = ("the same batch split over the GPUs" if scaling == "strong"
               else "the same batch per GPU: N GPUs train on N × the 1-GPU batch")
        lines += [f"\n{model} (random init, {r0['architecture']}), {scaling} scaling ({per}), "
                  f"sequences of {r0['prompt_len']}+{r0['response_len']} tokens, device {r0['device']}"
                  + (f", micro-batch {r0['micro_batch']} per GPU" if "micro_batch" in r0 else "") + "\n",
                  ("| backend | mode, variant | GPUs | s/step (min–max) | tok/s | tok/s per GPU | scaling vs 1 GPU "
                   "| batch | MFU (6N) | MFU + no-grad fwd | peak mem GiB | log-prob pass s | update s | other s "
                   "| setup s |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mrows:
            label = _label(r, r0)
            hfu = _pct1(r["hfu"]) + (" (8N)" if r.get("no_grad_pass") and r["hfu"] is not None else "")
            lines.append(f"| {r['backend']} | {label} | {r['gpus']} | {r['s_mean']:.3f} ({r['s_min']:.3f}–"
                         f"{r['s_max']:.3f}) | {r['tok_s']:,.0f} | {r['tok_s_gpu']:,.0f} | {_pct(r['efficiency'])} | "
                         f"{r['batch']} | {_pct1(r['mfu'])} | {hfu} | {r['peak_gb']:.2f} | "
                         f"{_sec(r['t_old_log_prob'])} | {_sec(r['t_update_actor'])} | {_sec(r['t_other'])} | "
                         f"{r['setup_s']:.0f} |")
        lines += ["", ("Learning direction (same samples, same initial weights): mean per-token logprob of the "
                       "+1 replies (lp+) and −1 replies (lp−) before each step and after the last; pg_loss per step."),
                  "",
                  "| backend | mode, variant | GPUs | pg_loss per step | lp+ before → after | lp− before → after |",
                  "|---|---|---|---|---|---|"]
        for r in mrows:
            label = _label(r, r0)
            losses = " ".join(f"{s['pg_loss']:+.4f}" for s in r["steps"])
            s0 = r["steps"][0]
            lines.append(f"| {r['backend']} | {label} | {r['gpus']} | {losses} | {s0['lp_pos']:.4f} → "
                         f"{r['final_lp_pos']:.4f} ({r['final_lp_pos'] - s0['lp_pos']:+.4f}) | {s0['lp_neg']:.4f} → "
                         f"{r['final_lp_neg']:.4f} ({r['final_lp_neg'] - s0['lp_neg']:+.4f}) |")
    for r in (r for r in rows if r.get("profile", {}).get("traces")):
        prof, label = r["profile"], r["mode"] + (f", {r['variant']}" if r.get("variant") else "")
        lines += ["", (f"{r['model']} {r['backend']} {label} on {r['gpus']} GPU(s), step {prof['step']} traced "
                       f"({prof['traces']} trace(s)): window {prof['window_ms']:,.1f} ms, GPU busy "
                       f"{prof['gpu_busy_ms']:,.1f} ms ({_pct1(prof['gpu_busy'])})"), "",
                  "| GPU kernel | calls | ms | CPU op (with callees) | calls | ms |", "|---|---|---|---|---|---|"]
        for k in range(max(len(prof["kernels"]), len(prof["cpu_ops"]))):
            g = prof["kernels"][k] if k < len(prof["kernels"]) else None
            c = prof["cpu_ops"][k] if k < len(prof["cpu_ops"]) else None
            lines.append(f"| {_cell(g)} | {_cell(c)} |")
        if prof.get("callers"):
            lines += ["", "| CPU op | called from (innermost frame outside torch) | via (torch's own frame) "
                          "| calls | ms |", "|---|---|---|---|---|"]
            for op, frames in sorted(prof["callers"].items(), key=lambda kv: -sum(f["ms"] for f in kv[1])):
                lines += [f"| {op} | {f['frame'][:90]} | {f.get('via', '')[:90]} | {f['calls']} | {f['ms']:,.1f} |"
                          for f in frames]
    return "\n".join(lines)


def executable_ray() -> list[str]:
    """Ray's own programs (``ray/core/src``: the GCS server, the raylet) made executable where an
    archive lost their exec bit: gpu-bundle's ray wheel unpacked into a --target directory starts
    no cluster otherwise (``PermissionError`` on ``gcs_server``). Returns the files changed."""
    try:
        import ray
    except ImportError:
        return []
    changed = []
    for f in (Path(ray.__file__).parent / "core" / "src").rglob("*"):
        if f.is_file() and not os.access(f, os.X_OK):
            try:
                f.chmod(f.stat().st_mode | 0o111)
            except OSError:
                continue  # not ours to change: Ray says so itself when it starts
            changed.append(str(f))
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def job(p: argparse.ArgumentParser) -> None:
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--prompt-len", type=int, default=512)
        p.add_argument("--response-len", type=int, default=256)

    p = sub.add_parser("prepare")
    p.add_argument("--model", required=True, choices=["smollm2", "qwen3-1.5b"])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-dir", default=str(HERE / "smollm2-tokenizer"))
    job(p)
    p = sub.add_parser("run")
    p.add_argument("--backend", required=True, choices=["local", "verl"])
    p.add_argument("--mode", default="full", choices=["full", "lora"])
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--model", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--samples", required=True)
    p.add_argument("--batch-size", type=int, default=0, help="train on the first this many samples (0: all)")
    p.add_argument("--scaling", default="strong", choices=["strong", "weak"], help="recorded for the table")
    p.add_argument("--variant", default="", help="a label for the table (all: the VARIANTS name)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--clip-grad", type=float, default=1e9)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="veRL: VerlConfig.fused_kernels (log-probs from hidden states in chunks; on by default, "
                        "as in VerlConfig)")
    p.add_argument("--remove-padding", default="auto", choices=["auto", "on", "off"],
                   help="veRL: VerlConfig.remove_padding (auto: with flash-attn only)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=0, help="veRL: dynamic micro-batches of this many tokens")
    p.add_argument("--old-logprob-pass", default="auto", choices=["auto", "always"],
                   help="veRL: VerlConfig.old_logprob_pass (auto: skipped for this rl job of captured turns)")
    p.add_argument("--override", action="append", default=[], help="veRL: a Hydra key=value (VerlConfig.overrides)")
    p.add_argument("--local-compile", action="store_true", help="local: LocalConfig.compile")
    p.add_argument("--push", action="store_true", help="veRL: write the weights through the checkpoint engine")
    p.add_argument("--profile-step", type=int, default=0,
                   help="veRL: its torch profiler on this step (from 0; >= 1), run after the timed ones if beyond "
                        "them and not timed: traces beside --json, summed up in it")
    p.add_argument("--profile-stacks", action="store_true",
                   help="with --profile-step: Python stacks in the trace, and each long or watched CPU op's "
                        "callers in the summary")
    p.add_argument("--json", required=True)
    p = sub.add_parser("all")
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["smollm2", "qwen3-1.5b"])
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4], help="GPU counts of a --verl NAME without =")
    p.add_argument("--verl", action="append", default=[],
                   help=f"veRL runs: VARIANT=GPUS,... (repeatable; default fused on --gpus); variants: "
                        f"{', '.join(VARIANTS)}")
    p.add_argument("--scaling", default="strong", choices=["strong", "weak"])
    p.add_argument("--per-gpu-batch", type=int, default=64, help="weak scaling: samples per GPU")
    p.add_argument("--local", action=argparse.BooleanOptionalAction, default=True,
                   help="the local backend on 1 GPU (weak: at the per-GPU batch)")
    p.add_argument("--local-compile", action="store_true")
    p.add_argument("--tokenizer-dir", default=str(HERE / "smollm2-tokenizer"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--lr-lora", type=float, default=2e-4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-tokens-per-gpu", type=int, default=0)
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--clip-grad", type=float, default=1e9)
    p.add_argument("--lora", action="store_true", help="also LoRA (veRL, 1 GPU, weights pushed) for the first model")
    p.add_argument("--local-lora", action="store_true", help="with --lora: the local backend's LoRA run too")
    p.add_argument("--push", action=argparse.BooleanOptionalAction, default=True,
                   help="veRL: write the weights after the LoRA run and the largest GPU count's run")
    p.add_argument("--profile", action="store_true",
                   help="veRL runs: one more step after the timed ones, traced by torch's profiler, and where its "
                        "time went")
    p.add_argument("--profile-stacks", action="store_true",
                   help="--profile with Python stacks: which code calls the longest CPU ops, the dtype copies "
                        "and the host's waits on the GPU (implies --profile)")
    p.add_argument("--run-timeout", type=float, default=240)
    p.add_argument("--prepare-timeout", type=float, default=300)
    p.add_argument("--budget-s", type=float, default=540, help="start no run after this many seconds")
    job(p)
    p = sub.add_parser("table", help="the tables of results.json files (several: their runs together)")
    p.add_argument("results", nargs="+")
    p.add_argument("--acceptance", metavar="JSON",
                   help="also write the acceptance fields (verl_mfu, verl_weak_scaling_2: fractions) of those runs")
    args = ap.parse_args(argv)
    if args.cmd in ("run", "all") and (changed := executable_ray()):
        print(f"made {len(changed)} of Ray's programs executable (their archive had lost the exec bit)", flush=True)
    if args.cmd == "prepare":
        prepare(args)
    elif args.cmd == "run":
        run(args)
    elif args.cmd == "all":
        run_all(args)
    else:
        results = [r for path in args.results for r in json.loads(Path(path).read_text())]
        print(tables(results))
        if args.acceptance:
            Path(args.acceptance).write_text(json.dumps(acceptance(results), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
