"""The veRL backend on 1, 2 and 4 GPUs beside the local backend on 1 GPU: the same job.

    python benchmarks/trainer/verl_gpu.py all --out DIR [--models smollm2 qwen3-1.5b] [--gpus 1 2 4]
    python benchmarks/trainer/verl_gpu.py table DIR/results.json

``all`` runs, each in a fresh process (a fresh Ray cluster for veRL), one after another:

1. ``prepare`` per model: a randomly initialised model of that architecture (seed 0; the
   SmolLM2 tokenizer beside it, see bench.py) and the job's samples: ``--batch-size`` samples of
   ``--prompt-len`` + ``--response-len`` random token ids, reward +1 / −1 alternating (no task
   groups: A = r), behaviour logprobs = the initial model's own (so the PPO ratio starts at 1
   and moves as the policy moves, like turns captured from the version being trained).
2. ``run --backend local`` (``trainer.local.LocalTrainer``, 1 GPU) and ``run --backend verl
   --gpus N`` (``trainer.verl_backend.VerlTrainer``: veRL's Ray trainer, FSDP2 over N GPUs) for
   each mode (full fine-tuning; LoRA with ``--lora``). Each run does ``--warmup`` + ``--steps``
   optimizer steps over the same batch (the same job: one batch, one step each) and records per
   step the wall time, pg_loss, and the mean per-token logprob of the +1 and of the −1 replies
   under the policy before that step (and after the last).

Columns: tok/s = batch × (prompt + response) tokens ÷ mean timed step seconds; per GPU =
that ÷ GPUs; scaling efficiency = (tok/s on N GPUs) ÷ (N × tok/s of veRL on 1 GPU); peak memory:
``torch.cuda.max_memory_allocated()`` of the local process, veRL's ``perf/max_memory_allocated_gb``
(rank 0's actor worker) for veRL. veRL's gradient clip is disabled (``--clip-grad``, default
1e9) so both backends take the same optimizer step; veRL keeps fp32 master weights (FSDP mixed
precision, bf16 compute), the local backend bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def run(args: argparse.Namespace) -> None:
    import torch

    from trainer.objectives import ObjectiveConfig

    samples = _samples(Path(args.samples))
    rewards = [s.reward for s in samples]
    objective = ObjectiveConfig(objective="rl", grpo=False)
    model_dir = Path(args.model_dir)
    lora = args.mode == "lora"
    started = time.perf_counter()
    if args.backend == "local":
        from trainer.local import LocalConfig, LocalTrainer

        trainer = LocalTrainer(LocalConfig(model_dir=model_dir, lora=lora, lr=args.lr,
                                           micro_batch_size=args.micro_batch_size), objective)

        def logprobs():  # noqa: ANN202
            with torch.no_grad():
                return trainer.response_logprobs(samples)
        gpus = 1
    else:
        from trainer.verl_backend import VerlConfig, VerlTrainer

        gpus = args.gpus
        cfg = VerlConfig(model_dir=model_dir, n_gpus_per_node=gpus, lora=lora, lr=args.lr,
                         micro_batch_size=args.micro_batch_size, clip_grad=args.clip_grad,
                         gradient_checkpointing=args.gradient_checkpointing,
                         output_dir=Path(args.json).parent / f"verl-{args.mode}-{gpus}", ray_address=None)
        trainer = VerlTrainer(cfg, objective, batch_size=len(samples), total_steps=args.warmup + args.steps)

        def logprobs():  # noqa: ANN202
            return trainer.response_logprobs(samples)
    setup_s = time.perf_counter() - started
    steps = []
    for i in range(args.warmup + args.steps):
        lp, mask = logprobs() if args.backend == "local" else (None, None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = trainer.step(samples)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if args.backend != "local":  # the current policy's logprobs veRL computed in the step
            done = trainer.trainer.last_batch
            order = {tid: k for k, tid in enumerate(done.non_tensor_batch["turn_id"])}
            idx = torch.tensor([order[s.turn_id] for s in samples])
            lp, mask = done.batch["current_log_probs"][idx], done.batch["response_mask"][idx]
        pos, neg = _direction(lp, mask, rewards)
        steps.append({"step": i, "seconds": seconds, "pg_loss": m["pg_loss"], "lp_pos": pos, "lp_neg": neg,
                      "clipfrac": m.get("pg_clipfrac", 0.0), "warmup": i < args.warmup,
                      "mem_gb": max((v for k, v in m.items() if "max_memory_allocated" in k), default=None)})
        print(f"# {args.backend} {args.mode} gpus={gpus} step {i}: {seconds:.3f}s loss {m['pg_loss']:+.5f} "
              f"lp+ {pos:.5f} lp- {neg:.5f}", flush=True)
    pos, neg = _direction(*logprobs(), rewards)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if args.backend == "local"
            else max(s["mem_gb"] or 0.0 for s in steps))
    written = None
    if args.backend == "verl" and args.push:
        written = trainer.push(publish=False)
        print(f"# wrote {written['kind']} weights: {written['path']} ({written['tensors']} tensors, "
              f"{written['bytes'] / 2**20:.1f} MiB) in {written['seconds']:.2f}s", flush=True)
    cfg_json = json.loads((model_dir / "config.json").read_text())
    result = {
        "backend": args.backend, "mode": args.mode, "gpus": gpus, "model": args.model,
        "architecture": cfg_json["architectures"][0], "batch": len(samples),
        "prompt_len": len(samples[0].prompt_ids), "response_len": len(samples[0].response_ids),
        "setup_s": setup_s, "steps": steps, "final_lp_pos": pos, "final_lp_neg": neg, "peak_gb": peak,
        "device": torch.cuda.get_device_name(0), "written": written,
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.backend == "verl":
        trainer.shutdown()


# ---------------------------------------------------------------------------------------- all


def _sub(argv: list[str], env: dict[str, str], timeout: float, log) -> int:  # noqa: ANN001
    print("$ " + " ".join(argv), flush=True)
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write(out)
        print(f"# timed out after {timeout:.0f}s; last lines:\n" + "\n".join(out.splitlines()[-15:]), flush=True)
        return 124
    log.write(proc.stdout)
    log.flush()
    keep = [ln for ln in proc.stdout.splitlines() if ln.startswith("#") or "Error" in ln or "error" in ln]
    print("\n".join(keep[-40:]), flush=True)
    if proc.returncode:
        print("\n".join(proc.stdout.splitlines()[-30:]), flush=True)
    return proc.returncode


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    common = ["--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
              "--batch-size", str(args.batch_size)]
    results = []
    deadline = time.monotonic() + args.budget_s
    with open(out / "runs.log", "a") as log:
        for model in args.models:
            mdir = out / model
            if _sub(["prepare", "--model", model, "--out", str(mdir), "--tokenizer-dir", args.tokenizer_dir, *common],
                    env, 300, log):
                continue
            plan = [("local", "full", 1)] + [("verl", "full", g) for g in args.gpus]
            if args.lora and model == args.models[0]:
                plan += [("verl", "lora", 1)] + ([("local", "lora", 1)] if args.local_lora else [])
            for backend, mode, gpus in plan:
                left = deadline - time.monotonic()
                if left < 30:
                    print(f"# out of time budget: skipping {model} {backend} {mode} {gpus}", flush=True)
                    continue
                lr = args.lr_lora if mode == "lora" else args.lr
                res = out / f"{model}-{backend}-{mode}-{gpus}.json"
                run_env = dict(env, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(gpus)))
                argv = ["run", "--backend", backend, "--mode", mode, "--gpus", str(gpus), "--model", model,
                        "--model-dir", str(mdir / "model"), "--samples", str(mdir / "samples.json"),
                        "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(lr),
                        "--micro-batch-size", str(args.micro_batch_size), "--clip-grad", str(args.clip_grad),
                        "--json", str(res)] + (["--push"] if backend == "verl" and (gpus == max(args.gpus) or mode == "lora")
                                               else [])
                if _sub(argv, run_env, min(args.run_timeout, left), log) == 0 and res.is_file():
                    results.append(json.loads(res.read_text()))
                    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(tables(results), flush=True)


# -------------------------------------------------------------------------------------- tables


def tables(results: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        base = {r["mode"]: r for r in rows if r["backend"] == "verl" and r["gpus"] == 1}
        r0 = rows[0]
        lines += [f"\n{model} (random init, {r0['architecture']}), batch {r0['batch']} × "
                  f"({r0['prompt_len']}+{r0['response_len']}) tokens, device {r0['device']}\n",
                  "| backend | mode | GPUs | s/step (min–max) | tok/s | tok/s per GPU | scaling vs veRL 1 GPU "
                  "| peak mem GiB | setup s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            timed = [s["seconds"] for s in r["steps"] if not s["warmup"]]
            mean = sum(timed) / len(timed)
            tok_s = r["batch"] * (r["prompt_len"] + r["response_len"]) / mean
            b = base.get(r["mode"])
            eff = ""
            if r["backend"] == "verl" and b is not None:
                bt = [s["seconds"] for s in b["steps"] if not s["warmup"]]
                b_tok = b["batch"] * (b["prompt_len"] + b["response_len"]) / (sum(bt) / len(bt))
                eff = f"{tok_s / (r['gpus'] * b_tok) * 100:.0f} %"
            lines.append(f"| {r['backend']} | {r['mode']} | {r['gpus']} | {mean:.3f} ({min(timed):.3f}–{max(timed):.3f}) "
                         f"| {tok_s:,.0f} | {tok_s / r['gpus']:,.0f} | {eff} | {r['peak_gb']:.2f} | {r['setup_s']:.0f} |")
        lines += ["", "Learning direction (same samples, same initial weights): mean per-token logprob of the "
                  "+1 replies (lp+) and −1 replies (lp−) before each step and after the last; pg_loss per step.", "",
                  "| backend | mode | GPUs | pg_loss per step | lp+ before → after | lp− before → after |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            losses = " ".join(f"{s['pg_loss']:+.4f}" for s in r["steps"])
            s0 = r["steps"][0]
            lines.append(f"| {r['backend']} | {r['mode']} | {r['gpus']} | {losses} | {s0['lp_pos']:.4f} → "
                         f"{r['final_lp_pos']:.4f} ({r['final_lp_pos'] - s0['lp_pos']:+.4f}) | {s0['lp_neg']:.4f} → "
                         f"{r['final_lp_neg']:.4f} ({r['final_lp_neg'] - s0['lp_neg']:+.4f}) |")
    return "\n".join(lines)


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
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--clip-grad", type=float, default=1e9)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--push", action="store_true", help="veRL: write the weights through the checkpoint engine")
    p.add_argument("--json", required=True)
    p = sub.add_parser("all")
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["smollm2", "qwen3-1.5b"])
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--tokenizer-dir", default=str(HERE / "smollm2-tokenizer"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--lr-lora", type=float, default=2e-4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--clip-grad", type=float, default=1e9)
    p.add_argument("--lora", action="store_true", help="also LoRA (veRL, 1 GPU, weights pushed) for the first model")
    p.add_argument("--local-lora", action="store_true", help="with --lora: the local backend's LoRA run too")
    p.add_argument("--run-timeout", type=float, default=240)
    p.add_argument("--budget-s", type=float, default=540, help="start no run after this many seconds")
    job(p)
    p = sub.add_parser("table")
    p.add_argument("results")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args)
    elif args.cmd == "run":
        run(args)
    elif args.cmd == "all":
        run_all(args)
    else:
        print(tables(json.loads(Path(args.results).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
