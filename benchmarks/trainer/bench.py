"""Training-step throughput and peak memory of the local trainer (``trainer.local.LocalTrainer``).

    python benchmarks/trainer/bench.py --model-dir ~/.cache/nextstate/models/SmolLM2-135M-Instruct \\
        [--batch-size 4] [--prompt-len 128] [--response-len 64] [--steps 3] [--warmup 1]
    python benchmarks/trainer/bench.py --random-config qwen3-1.5b --batch-size 8 \\
        --prompt-len 512 --response-len 256            # on a GPU

Synthetic samples: ``--batch-size`` ``Sample``s of random token ids, a prompt of
``--prompt-len`` tokens and a response of ``--response-len`` tokens each, random behaviour
log-probs in (−2, 0], reward +1 / −1 alternating inside groups of two (so GRPO advantages are
non-zero). Each configuration (``--modes``, default LoRA and full fine-tuning) runs in its own
fresh Python process: a ``LocalTrainer`` (objective ``rl``), ``--warmup`` untimed steps, then
``--steps`` timed ``LocalTrainer.step`` calls (CUDA synchronised around each on a GPU).

Model: ``--model-dir DIR`` (a saved Hugging Face model with its tokenizer) or
``--random-config {smollm2,qwen3-1.5b}``: a randomly initialised model of that architecture is
saved, with the SmolLM2 tokenizer (``--tokenizer-dir``, default ``smollm2-tokenizer/`` beside this
file; the samples are synthetic ids, so only its pad id matters), to a temporary directory that
``LocalTrainer`` then loads like any other; trainer code is used unchanged.

Columns:
- tok/s (all): batch × (prompt + response) tokens per timed second; resp tok/s: response tokens
  only (what the trainer itself reports as ``tokens_per_s``); s/step: mean seconds per step.
- CPU s/step (CPU runs): process CPU time (user + sys, all threads) per timed step. This machine
  is shared, so wall time swings with other load; CPU time much less (with ``--threads 1`` it is
  close to the step's own work; with more threads it includes OpenMP spin-waiting).
- memory. CPU: "base" is the process RSS after the model is loaded, "peak" the RSS high-water mark
  over the warm-up and timed steps (Linux VmHWM, reset after loading through
  /proc/self/clear_refs; ``resource.getrusage`` ru_maxrss where that is unavailable), "Δ" = peak −
  base (optimizer state, gradients, activations, allocator slack). GPU: "base" is
  ``torch.cuda.memory_allocated()`` after loading, "peak" ``torch.cuda.max_memory_allocated()``
  over the warm-up and timed steps, "Δ" = peak − base.
- MFU (GPU only) = 6 · N · (all tokens/s) ÷ peak dense bf16 FLOP/s of the card (H100 SXM / H200:
  989 TFLOP/s; H100 PCIe 756; ``--peak-tflops`` overrides). N = parameters taking part in matrix
  products: all parameters of the base model, less the input embedding when it is not tied to the
  LM head (a lookup, no FLOPs); LoRA adapter parameters are not counted. 6N is the usual
  forward (2N) + backward (4N) count; it leaves out attention's score/value products.
  ``LocalTrainer.step`` also runs a no-grad forward over the batch first (the current policy's
  log-probs for the advantages), so its real matrix work is 8N per token; "HFU 8N" reports that.
  For LoRA the backward skips the weight gradients of the frozen weights (about 2N of the 4N), so
  its real work is ≈ 6N per token including the no-grad pass: compare LoRA's "HFU 8N" column with
  that in mind, and read its MFU as "the full-fine-tuning-equivalent rate".
- GPU busy (GPU, with ``--profile``): GPU kernel time of one profiled step ÷ the mean timed step;
  well under 100 % means the step waits on the CPU (Python and kernel launches).

``--rounds N`` repeats the modes, reversing their order every other round (one row per run), to
show the spread on a shared machine; ``--from-json FILE`` prints a saved ``--json`` table again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# A copy of SmolLM2's tokenizer files beside this script travels to a GPU machine (carry it: it is
# git-ignored); here the converted model in the cache has them.
_CARRIED_TOKENIZER_DIR = HERE / "smollm2-tokenizer"
DEFAULT_TOKENIZER_DIR = (_CARRIED_TOKENIZER_DIR if _CARRIED_TOKENIZER_DIR.is_dir() else
                         Path(os.environ.get("NEXTSTATE_CACHE_DIR", Path.home() / ".cache" / "nextstate"))
                         / "models" / "SmolLM2-135M-Instruct")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "vocab_size": 49152, "hidden_act": "silu", "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}
# Qwen3-1.7B's shape (Qwen3 has no 1.5B; this is the nearest): ~1.72 B parameters with tied embeddings
QWEN3_1_5B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 6144, "vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("GH200", 989.0), ("A100", 312.0))


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def matmul_params(model) -> tuple[int, int, bool]:
    """(all base-model parameters, N for MFU, tied embeddings) of a (PEFT-wrapped) causal LM: N =
    the parameters taking part in matrix products — all but LoRA's, less the input embedding when
    it is not tied to the LM head (a lookup, no FLOPs). Works on a meta-device model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n_total = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    emb = base.get_input_embeddings().weight
    out_emb = base.get_output_embeddings()
    tied = out_emb is not None and (out_emb.weight is emb or (
        emb.device.type != "meta" and out_emb.weight.data_ptr() == emb.data_ptr()))
    return n_total, n_total - (0 if tied else emb.numel()), tied


def matmul_params_of_dir(model_dir: Path) -> tuple[int, int, bool]:
    """:func:`matmul_params` of the model saved in ``model_dir``, built on the meta device (no
    weights read, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return matmul_params(model)


def mfu(n_matmul: int, tokens_per_s: float, peak: float | None, flops_per_token: int = 6) -> float | None:
    """Model-FLOPs utilisation: ``flops_per_token`` · N · tokens/s ÷ the peak dense bf16 rate
    (TFLOP/s, :func:`peak_tflops`) of one card; None without a peak. 6N: forward + backward; 8N:
    with a no-grad forward over the batch too. On several GPUs pass one GPU's tokens/s."""
    if not peak:
        return None
    return flops_per_token * n_matmul * tokens_per_s / (peak * 1e12)


# ----------------------------------------------------------------------------- model sources


def random_config_dict(name: str, tokenizer_dir: Path, overrides: list[str]) -> dict:
    if name == "smollm2":
        cfg = dict(SMOLLM2_135M)
        src = tokenizer_dir / "config.json"
        if src.is_file():  # the real model's own config, where we have it
            cfg = json.loads(src.read_text())
    elif name == "qwen3-1.5b":
        cfg = dict(QWEN3_1_5B)
    else:
        raise SystemExit(f"unknown --random-config {name!r}")
    for item in overrides:
        key, _, value = item.partition("=")
        cfg[key] = json.loads(value)
    return cfg


def build_random_model_dir(name: str, tokenizer_dir: Path, overrides: list[str], out: Path, seed: int) -> Path:
    """Save a randomly initialised model of config ``name`` plus the tokenizer files to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = random_config_dict(name, tokenizer_dir, overrides)
    model_type = cfg_dict.pop("model_type")
    for drop in ("_model_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg_dict.pop(drop, None)
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):  # initialise on the GPU where there is one: much faster for 1.5 B
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy(tokenizer_dir / f, out / f)
    print(f"# built random {name} ({config.architectures[0]}) in {out} in {time.perf_counter() - started:.1f} s",
          flush=True)
    return out


# ----------------------------------------------------------------------------- measuring memory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux ≥ 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_rss_kib(reset_ok: bool) -> int:
    hwm = _status_kib("VmHWM") if reset_ok else None
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss // 1024 if sys.platform == "darwin" else maxrss


def _rss_kib() -> int:
    rss = _status_kib("VmRSS")
    if rss is not None:
        return rss
    return _peak_rss_kib(False)


# ----------------------------------------------------------------------------- one configuration


def synthetic_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list:
    from trainer.samples import Sample

    rng = random.Random(seed)
    hi = min(vocab, 49152) - 1  # ids valid for the model and (for decoding, if ever) the tokenizer
    out = []
    for i in range(n):
        out.append(Sample(
            turn_id=f"t{i}", session_id=f"s{i}", group_id=f"g{i // 2}", step_index=0,
            prompt_ids=[rng.randint(3, hi) for _ in range(prompt_len)],
            response_ids=[rng.randint(3, hi) for _ in range(response_len)],
            behaviour_logprobs=[-2.0 * rng.random() for _ in range(response_len)],
            teacher_logprobs=None, reward=1.0 if i % 2 == 0 else -1.0, integrated_reward=None,
            capture="white-box"))
    return out


MATMUL_KERNEL_MARKS = ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "sm90_", "sm80_", "ampere_")


def is_matmul_kernel(name: str) -> bool:
    """GEMM kernels by name (cuBLAS/cuBLASLt nvjet, CUTLASS, xmma); attention and the rest not."""
    low = name.lower()
    return any(mark in low for mark in MATMUL_KERNEL_MARKS) and "flash" not in low and "fmha" not in low


def profile_step(trainer, samples, cuda: bool, sync) -> tuple[str, float, float]:
    """One ``trainer.step`` under torch.profiler: (op table, seconds of GPU kernels, wall seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        trainer.step(samples)
        sync()
        wall = time.perf_counter() - t
    averages = prof.key_averages()
    kernel_us = matmul_us = 0.0
    if cuda:
        for e in averages:
            # kernels only: user annotations such as "Optimizer.step#AdamW.step" also show as CUDA ranges
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
                us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
                kernel_us += us
                if is_matmul_kernel(e.key):
                    matmul_us += us
    profile_step.matmul_s = matmul_us / 1e6
    sort = "self_cpu_time_total"
    if cuda:
        sort = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    return averages.table(sort_by=sort, row_limit=25, max_name_column_width=70), kernel_us / 1e6, wall


def run_worker(args: argparse.Namespace, mode: str) -> dict:
    import torch

    from trainer import objectives
    from trainer.local import LocalConfig, LocalTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = {"auto": None, "on": True, "off": False}[args.bf16]
    cfg = LocalConfig(model_dir=Path(args.model_dir), lora=(mode == "lora"), lora_rank=args.lora_rank,
                      micro_batch_size=None if args.path == "default" else args.micro_batch_size,
                      device=args.device, bf16=bf16, seed=args.seed,
                      compile=None if args.path == "default" else args.path.startswith("compile"),
                      compile_mode="reduce-overhead" if args.path == "compile-cg" else None,
                      fp32_master=args.fp32_master if mode == "full" else True,
                      **({"logprob_chunk": args.logprob_chunk} if args.logprob_chunk else {}),
                      **({"activation_memory_budget": args.activation_memory_budget}
                         if args.activation_memory_budget is not None else {}))
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    t0 = time.perf_counter()
    trainer = LocalTrainer(cfg, objectives.ObjectiveConfig(objective="rl"))
    load_s = time.perf_counter() - t0
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n_total, n_matmul, tied = matmul_params(model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = base.get_input_embeddings().weight.shape[0]
    samples = synthetic_samples(args.batch_size, args.prompt_len, args.response_len, vocab, args.seed)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        sync()
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        reset_ok = False
    else:
        reset_ok = _reset_peak_rss()
        base_mem = _rss_kib() * 1024
    metrics = {}
    t_warm = time.perf_counter()
    for _ in range(args.warmup):
        metrics = trainer.step(samples)
    sync()
    warmup_s = time.perf_counter() - t_warm
    times, cpu_times = [], []
    for _ in range(args.steps):
        sync()
        t, c = time.perf_counter(), time.process_time()
        metrics = trainer.step(samples)
        sync()
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
    profile_text = None
    if args.profile:  # one more step under torch.profiler, after the measured ones
        profile_text, kernel_s, prof_wall = profile_step(trainer, samples, cuda, sync)
    if cuda:
        peak_mem = torch.cuda.max_memory_allocated()
        device_name = torch.cuda.get_device_name()
    else:
        peak_mem = _peak_rss_kib(reset_ok) * 1024
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    step_s = sum(times) / len(times)
    all_tokens = args.batch_size * (args.prompt_len + args.response_len)
    resp_tokens = args.batch_size * args.response_len
    result = {
        "mode": mode, "device": device_name, "cuda": cuda, "dtype": str(trainer.dtype).removeprefix("torch."),
        "arch": base.config.architectures[0] if base.config.architectures else type(base).__name__,
        "n_params": n_total, "n_matmul": n_matmul, "n_trainable": n_trainable, "tied_embeddings": tied,
        "batch": args.batch_size, "prompt_len": args.prompt_len, "response_len": args.response_len,
        "micro_batch": trainer.micro_batch_size, "compiled": trainer.compile, "steps": args.steps, "warmup": args.warmup,
        "load_s": load_s, "warmup_s": warmup_s, "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
        "cpu_s": sum(cpu_times) / len(cpu_times), "threads": torch.get_num_threads(),
        "tokens_per_s": all_tokens / step_s, "response_tokens_per_s": resp_tokens / step_s,
        "mem_base": base_mem, "mem_peak": peak_mem, "mem_kind": "cuda allocated" if cuda else "RSS",
        "peak_source": "max_memory_allocated" if cuda else ("VmHWM after clear_refs" if reset_ok else "ru_maxrss"),
        "last_loss": metrics.get("loss"), "torch": torch.__version__,
    }
    result["path"] = args.path
    result["fp32_master"] = mode == "full" and bool(getattr(trainer, "_master", None))
    if args.logprob_chunk:
        result["logprob_chunk"] = args.logprob_chunk
    if args.activation_memory_budget is not None:
        result["activation_memory_budget"] = args.activation_memory_budget
    result["no_grad_pass"] = trainer.last_step_no_grad_pass
    if profile_text is not None:
        result["profile"] = profile_text
        result["profiled_step_s"] = prof_wall
        if cuda:  # GPU kernel time of one step (from the profiled step)
            result["gpu_kernel_s"] = kernel_s
            result["gpu_matmul_s"] = profile_step.matmul_s
    if cuda:
        peak = args.peak_tflops or peak_tflops(device_name)
        result["peak_tflops"] = peak
        if peak:
            result["mfu_6n"] = mfu(n_matmul, result["tokens_per_s"], peak)
            # with the step's no-grad forward (2N more per token) where it ran
            extra = 2 if trainer.last_step_no_grad_pass else 0
            result["hfu_8n"] = mfu(n_matmul, result["tokens_per_s"], peak, 6 + extra)
    return result


# ----------------------------------------------------------------------------- table


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def table(results: list[dict], model_label: str) -> str:
    gpu = any(r["cuda"] for r in results)
    head = ["model", "mode", "params (trainable)", "dtype", "batch × (P+R)", "s/step (min–max)", "tok/s (all)",
            "resp tok/s", "mem base GiB", "mem peak GiB", "Δ GiB"]
    if gpu:
        head += ["MFU (6N)", "MFU + no-grad fwd"]
    else:
        head += ["CPU s/step"]
    busy = any("gpu_kernel_s" in r for r in results)
    if busy:
        head += ["GPU busy", "matmul share of GPU time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        mode = r["mode"] + ({"main": " (main)", "compile": " +compile", "compile-cg": " +compile+CUDA graphs"}.get(r.get("path", ""), "") or (" (defaults" + (", compiled)" if r.get("compiled") else ")") if r.get("path") == "default" else "")) + (
            " +fp32 master" if r.get("fp32_master") and r["mode"] == "full" else "") + (
            f" +act. budget {r['activation_memory_budget']}" if "activation_memory_budget" in r else "") + (
            f" (round {r['round']})" if "round" in r else "")
        row = [model_label, mode, f"{_params(r['n_params'])} ({_params(r['n_trainable'])})", r["dtype"],
               f"{r['batch']} × ({r['prompt_len']}+{r['response_len']}), mb {r['micro_batch']}",
               f"{r['step_s']:.3f} ({r['step_s_min']:.3f}–{r['step_s_max']:.3f})", f"{r['tokens_per_s']:,.0f}", f"{r['response_tokens_per_s']:,.0f}",
               _gib(r["mem_base"]), _gib(r["mem_peak"]), _gib(r["mem_peak"] - r["mem_base"])]
        if gpu:
            row += [f"{100 * r['mfu_6n']:.1f} %" if "mfu_6n" in r else "n/a",
                    (f"{100 * r['hfu_8n']:.1f} %" + (" (8N)" if r.get("no_grad_pass", True) else " (no pass)"))
                    if "hfu_8n" in r else "n/a"]
        if not gpu:
            row += [f"{r['cpu_s']:.2f}" if "cpu_s" in r else "n/a"]
        if busy:
            row += [f"{100 * r['gpu_kernel_s'] / r['step_s']:.0f} %" if "gpu_kernel_s" in r else "n/a",
                    f"{100 * r['gpu_matmul_s'] / r['gpu_kernel_s']:.0f} %" if r.get("gpu_matmul_s") is not None
                    else "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Prints a markdown table.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="a saved model with its tokenizer (e.g. the converted SmolLM2)")
    src.add_argument("--random-config", choices=["smollm2", "qwen3-1.5b"],
                     help="build a randomly initialised model of this architecture")
    src.add_argument("--from-json", metavar="FILE", help="print the table of a --json file again, run nothing")
    p.add_argument("--tokenizer-dir", default=str(DEFAULT_TOKENIZER_DIR),
                   help="tokenizer files (and SmolLM2's config.json) for --random-config (default: %(default)s)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                   help="override a --random-config field, e.g. num_hidden_layers=2 (repeatable)")
    p.add_argument("--keep-dir", help="save the random model here (reused if it exists) instead of a temp dir")
    p.add_argument("--modes", default="lora,full", help="comma-separated: lora, full (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="LocalConfig.micro_batch_size (default: %(default)s)")
    p.add_argument("--paths", default="new",
                   help="comma-separated code paths, each mode run once per path: default (LocalConfig's own "
                        "choices: torch.compile on CUDA, the micro-batch sized to the device; --micro-batch-size "
                        "ignored), new (without compile), compile (new + torch.compile "
                        "of each decoder layer), compile-cg (the same with CUDA graphs: mode "
                        "reduce-overhead) (default: %(default)s)")
    p.add_argument("--path", default="new", help=argparse.SUPPRESS)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--fp32-master", action=argparse.BooleanOptionalAction, default=True,
                   help="full mode: LocalConfig.fp32_master (fp32 master weights and AdamW states; the default); "
                        "--no-fp32-master: bf16 weights and AdamW states, as the rows before 2026-11-27 ran")
    p.add_argument("--activation-memory-budget", type=float, default=None,
                   help="LocalConfig.activation_memory_budget (with a compile path)")
    p.add_argument("--logprob-chunk", type=int, default=0,
                   help="LocalConfig.logprob_chunk (default 0: the trainer's own choice)")
    p.add_argument("--device", default=None, help="LocalConfig.device (default: cuda if available, else cpu)")
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="auto: LocalTrainer's default (bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense bf16 TFLOP/s for MFU (default: from the GPU's name; H100 SXM 989)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here as JSON")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes this many times, the order reversed every other round (for noisy "
                        "shared CPUs); one row per run (default: %(default)s)")
    p.add_argument("--profile", metavar="PREFIX",
                   help="after the timed steps, profile one more step with torch.profiler: op table to "
                        "PREFIX-MODE.txt, and on a GPU a 'GPU busy' column: that step's total GPU kernel "
                        "time ÷ the mean timed (unprofiled) step")
    p.add_argument("--in-process", action="store_true", help="run every mode in this process (memory less clean)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker_argv(args: argparse.Namespace, model_dir: str, mode: str, result: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--model-dir", model_dir, "--worker", mode,
            "--result", result, "--batch-size", str(args.batch_size), "--prompt-len", str(args.prompt_len),
            "--response-len", str(args.response_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch-size", str(args.micro_batch_size), "--lora-rank", str(args.lora_rank),
            "--bf16", args.bf16, "--threads", str(args.threads), "--seed", str(args.seed), "--path", args.path,
            "--logprob-chunk", str(args.logprob_chunk)] + (["--fp32-master" if args.fp32_master else "--no-fp32-master"]) + (
                ["--activation-memory-budget", str(args.activation_memory_budget)]
                if args.activation_memory_budget is not None else [])
    if args.device:
        argv += ["--device", args.device]
    if args.peak_tflops:
        argv += ["--peak-tflops", str(args.peak_tflops)]
    if args.profile:
        argv += ["--profile", args.profile]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(run_worker(args, args.worker)))
        return 0
    if args.from_json:
        print_report(json.loads(Path(args.from_json).read_text()))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("lora", "full") for m in modes):
        raise SystemExit(f"--modes takes lora and/or full, got {args.modes!r}")
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if any(x not in ("default", "new", "compile", "compile-cg") for x in paths):
        raise SystemExit(f"--paths takes default, new, compile and/or compile-cg, got {args.paths!r}")
    with tempfile.TemporaryDirectory(prefix="nextstate-bench-") as tmp:
        if args.random_config:
            model_dir = Path(args.keep_dir) if args.keep_dir else Path(tmp) / "model"
            if not (model_dir / "config.json").is_file():
                build_random_model_dir(args.random_config, Path(args.tokenizer_dir), args.override, model_dir,
                                       args.seed)
            label = f"{args.random_config} (random init)"
        else:
            model_dir = Path(args.model_dir).expanduser()
            label = model_dir.name
        results = []
        combos = [(m, x) for m in modes for x in paths]
        runs = [(i, m, x) for i in range(args.rounds) for m, x in (combos if i % 2 == 0 else combos[::-1])]
        for round_index, mode, path in runs:
            args.path = path
            if args.in_process:
                args.model_dir = str(model_dir)
                r = run_worker(args, mode)
            else:
                out = Path(tmp) / f"result-{mode}.json"
                out.unlink(missing_ok=True)
                subprocess.run(worker_argv(args, str(model_dir), mode, str(out)), check=True)
                r = json.loads(out.read_text())
            if args.rounds > 1:
                r["round"] = round_index + 1
            if args.profile and r.get("profile"):
                Path(f"{args.profile}-{mode}-{path}" + (f"-{round_index + 1}" if args.rounds > 1 else "") + ".txt"
                     ).write_text(r.pop("profile"))
            results.append(r)
            print(f"# {mode} ({path}): {r['step_s']:.3f} s/step (min {r['step_s_min']:.3f}, max {r['step_s_max']:.3f}), "
                  f"load {r['load_s']:.1f} s, warm-up {r.get('warmup_s', float('nan')):.1f} s, last loss {r['last_loss']:.4f}, peak from {r['peak_source']}",
                  flush=True)
    import torch
    import transformers
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    try:
        import peft
        versions += f", peft {peft.__version__}"
    except ImportError:
        pass
    report = {"label": label, "versions": versions,
              "loadavg": f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", "results": results}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def print_report(report: dict) -> None:
    r0 = report["results"][0]
    print(f"\n{report['label']}: {r0['arch']}, {r0['n_params']:,} parameters (N for MFU: {r0['n_matmul']:,}; "
          f"tied embeddings: {r0['tied_embeddings']}); device: {r0['device']}; {report['versions']}; "
          f"{r0['steps']} timed steps after {r0['warmup']} warm-up, micro-batch {r0['micro_batch']}"
          + (f"; MFU peak {r0.get('peak_tflops')} TFLOP/s bf16 dense" if r0["cuda"] else "")
          + (f"; load average {report['loadavg']}" if report.get("loadavg") else "") + "\n")
    print(table(report["results"], report["label"]))


if __name__ == "__main__":
    sys.exit(main())
