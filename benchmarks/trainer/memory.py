"""Peak memory (RSS) on the CPU of one online-training step against the tokens of a turn.

    python benchmarks/trainer/memory.py                     # the table in benchmarks/trainer/README.md
    python benchmarks/trainer/memory.py --rows 1024x16 8192x2 --settings after --cap-gib 8

Each row is one fresh Python process that builds a ``LocalTrainer`` (LoRA, the CPU's fp32,
objective ``combined`` with teacher log-probs, so the step runs its no-grad pass as the online
trainer's does), takes one ``LocalTrainer.step`` over a round of synthetic turns (``--rows``:
``TxN`` is N turns of T tokens each: prompt T − R, response R = min(512, T / 4)), and reports
its peak RSS:
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end of the step (model loading included:
"base" is the RSS before the step). The parent watches each child's RSS and kills it past
``--cap-gib`` (other work shares the machine): such a row reads "> cap".

Settings, side by side in one run (``--settings``):
- ``before``: what the trainer did before micro-batches had a token budget: 4 turns a forward,
  whatever their length, no gradient checkpointing (``max_tokens_per_micro_batch=0``,
  ``gradient_checkpointing=False``), glibc's malloc left at its defaults
  (``trainer.local.release_freed_memory`` not called);
- ``after``: the defaults (a micro-batch holds at most ``max_tokens_per_micro_batch`` tokens,
  gradient checkpointing on the CPU, freed memory given back);
- ``after-4k``: the same with a budget of 4,096 tokens.

The model: the converted SmolLM2-135M-Instruct in the cache (``~/.cache/nextstate``, what the
tests use) where it is; otherwise SmolLM2-135M's config with random weights and a word-level
tokenizer (the same shapes, so the same memory; the samples are random ids either way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.trainer.bench import SMOLLM2_135M  # noqa: E402

CACHED_MODEL = Path(os.environ.get("NEXTSTATE_CACHE_DIR", Path.home() / ".cache" / "nextstate")) / "models" \
    / "SmolLM2-135M-Instruct"
SETTINGS: dict[str, dict] = {
    "before": {"micro_batch_size": 4, "max_tokens_per_micro_batch": 0, "gradient_checkpointing": False,
               "release_freed_memory": False},
    "after": {},
    "after-4k": {"max_tokens_per_micro_batch": 4096},
}
RESULTS = HERE / "results"


def build_model(out: Path) -> Path:
    """SmolLM2-135M's shape with random weights and a word-level tokenizer, saved to *out*."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = dict(SMOLLM2_135M)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    vocab = {"<pad>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, 1024)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(out)
    return out


def samples(turns: int, tokens: int, vocab: int, seed: int = 0) -> list:
    from trainer.samples import Sample

    rng = random.Random(seed)
    response = min(512, tokens // 4)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randint(3, vocab - 1) for _ in range(tokens - response)],
                   response_ids=[rng.randint(3, vocab - 1) for _ in range(response)],
                   behaviour_logprobs=[-2.0 * rng.random() for _ in range(response)],
                   teacher_logprobs=[-2.0 * rng.random() for _ in range(response)],
                   reward=1.0 if i % 2 == 0 else 0.0, integrated_reward=None, capture="white-box")
            for i in range(turns)]


def worker(args: argparse.Namespace) -> None:
    import torch

    from trainer import local
    from trainer.local import LocalConfig, LocalTrainer
    from trainer.objectives import ObjectiveConfig

    settings = json.loads(args.local)
    if not settings.pop("release_freed_memory", True):
        local.release_freed_memory = lambda: False  # glibc's malloc as it was
    cfg = LocalConfig(model_dir=Path(args.model_dir), device="cpu", **settings)
    trainer = LocalTrainer(cfg, ObjectiveConfig(objective="combined"))
    vocab = trainer._causal_lm().get_input_embeddings().weight.shape[0]
    batch = samples(args.turns, args.tokens, vocab)
    base = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") \
        if Path("/proc/self/statm").exists() else None
    started = time.perf_counter()
    metrics = trainer.step(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    Path(args.out).write_text(json.dumps({
        "peak_rss": peak, "base_rss": base, "micro_batches": metrics.get("micro_batches"),
        "max_tokens_per_micro_batch": trainer.max_tokens_per_micro_batch,
        "gradient_checkpointing": trainer.gradient_checkpointing, "micro_batch_size": trainer.micro_batch_size,
        "step_s": time.perf_counter() - started, "loss": metrics.get("loss"),
        "threads": torch.get_num_threads(), "torch": torch.__version__}))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_row(args: argparse.Namespace, model_dir: Path, setting: str, tokens: int, turns: int) -> dict:
    row = {"setting": setting, "tokens_per_turn": tokens, "turns": turns, "local": SETTINGS[setting]}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, __file__, "--worker", "--model-dir", str(model_dir), "--tokens", str(tokens),
                "--turns", str(turns), "--local", json.dumps(SETTINGS[setting]), "--out", out.name]
        child = subprocess.Popen(argv, cwd=REPO)
        cap, seen, killed = args.cap_gib * 2**30, 0, False
        while child.poll() is None:
            seen = max(seen, _rss(child.pid))
            if seen > cap:
                child.send_signal(signal.SIGKILL)
                killed = True
                child.wait()
                break
            time.sleep(0.02)
        if killed:
            return row | {"peak_rss": None, "over_cap": cap, "watched_rss": seen}
        if child.returncode != 0:
            return row | {"peak_rss": None, "error": f"exit {child.returncode}"}
        return row | json.loads(Path(out.name).read_text())


def table(report: dict) -> str:
    lines = ["| turns × tokens | setting | a micro-batch holds | micro-batches | peak RSS GiB | step s |",
             "|---|---|---|---|---|---|"]
    for r in sorted(report["rows"], key=lambda r: (r["turns"], r["tokens_per_turn"])):
        local = r["local"]
        holds = (f"≤ {local['micro_batch_size']} turns, no token budget" if local.get("max_tokens_per_micro_batch") == 0
                 else f"≤ 4 turns and ≤ {local.get('max_tokens_per_micro_batch', 8192):,} tokens")
        holds += "" if local.get("gradient_checkpointing") is False else ", checkpointing, malloc trimmed"
        peak = (f"**{r['peak_rss'] / 2**30:.2f}**" if r.get("peak_rss") else
                f"> {r['over_cap'] / 2**30:.0f} (killed)" if r.get("over_cap") else r.get("error", "?"))
        step = f"{r['step_s']:.0f}" if r.get("step_s") else "–"
        mbs = f"{r['micro_batches']:.0f}" if r.get("micro_batches") else "–"
        lines.append(f"| {r['turns']} × {r['tokens_per_turn']:,} | {r['setting']} | {holds} | {mbs} | {peak} | {step} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=["8192x1", "2048x4", "4096x1", "2048x1", "1024x1"],
                   help="rounds as TOKENSxTURNS: that many turns of that many tokens (default: %(default)s)")
    p.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--turns", type=int, help=argparse.SUPPRESS)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["before", "after"])
    p.add_argument("--cap-gib", type=float, default=8.0, help="kill a row's process past this RSS")
    p.add_argument("--model-dir", help="a saved model (default: the cached SmolLM2, else its shape, random)")
    p.add_argument("--json", default=str(RESULTS / "cpu-memory.json"))
    p.add_argument("--from-json", help="print the table of a saved --json and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            model_dir, label = Path(args.model_dir), args.model_dir
        elif CACHED_MODEL.is_dir():
            model_dir, label = CACHED_MODEL, "SmolLM2-135M-Instruct (cached)"
        else:
            model_dir, label = build_model(Path(tmp) / "smollm2"), "SmolLM2-135M's config, random weights"
        rows = []
        for spec in args.rows:
            tokens, _, turns = spec.partition("x")
            for setting in args.settings:
                row = run_row(args, model_dir, setting, int(tokens), int(turns or 1))
                print(json.dumps(row), flush=True)
                rows.append(row)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    report = {"model": label, "rows": rows,
              "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {memory:.0f} GiB"}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
