"""vLLM with LoRA under load: adapter churn, many concurrent streamed decodes across adapters,
and (optionally) ``prompt_logprobs`` requests on the same server, until the engine dies or
--duration ends. The reproducer of the CUDA illegal memory access seen with vLLM 0.26.0, and the
check that a server configuration holds.

    python benchmarks/gpu/lora_churn.py --model-dir /tmp/smollm2 --out DIR --tag NAME \\
        [--streams 128] [--adapters 12] [--live 8] [--load-every 1.0] \\
        [--prompt-logprobs 4] [--duration 180] [--vllm-args "--enable-lora ..."]

It starts vLLM itself (``python -m vllm.entrypoints.openai.api_server`` with --vllm-args, the
environment passed through; ``CUDA_LAUNCH_BLOCKING=1`` for synchronous launches, --probe to load
``lora_probe/``, which names the LoRA call that faults), or uses --upstream. Load, all at once:

* churn: every --load-every seconds one more adapter name is loaded (``/v1/load_lora_adapter``,
  a fresh name over one of --adapters PEFT folders written here, rank 8 on q/k/v/o with random
  non-zero B); beyond --live names the oldest is unloaded. With ``--max-loras`` below --live,
  vLLM's GPU slots are LRU-reused while other adapters decode. --load-every 0: the --live
  adapters are loaded once, before the load starts, and never again.
* --streams workers, each streaming ``/v1/completions`` (random 16-160 tokens) on a random live
  adapter, one after another.
* --prompt-logprobs workers, each sending the teacher's request shape (``prompt_logprobs=0``,
  ``max_tokens=1``, the base model) over random token ids of --pl-min..--pl-max tokens: prompts
  that straddle vLLM's 1,024-row chunk of the batch's hidden states beside the running decodes.

The engine counts as dead when vLLM's process exits or ``/health`` stops answering. Writes
``lora-churn-TAG.json`` (engine_deaths, requests, failed, per-kind counts, the first CUDA error
in vLLM's log and the vLLM frames of its traceback) and the vLLM log's tail to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def write_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8) -> None:
    """A PEFT LoRA adapter for the Llama-shaped model in *model_dir*: rank *rank* on q/k/v/o,
    A and B random (B non-zero, so the adapter changes the output). Written with safetensors
    directly, without loading the base model."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(shapes), "modules_to_save": None, "use_rslora": False, "use_dora": False}))


class Stats:
    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self.errors: dict[str, int] = {}

    def add(self, kind: str, ok: bool, error: str = "") -> None:
        c = self.counts.setdefault(kind, {"requests": 0, "failed": 0})
        c["requests"] += 1
        if not ok:
            c["failed"] += 1
            key = f"{kind}: {error[:120]}"
            self.errors[key] = self.errors.get(key, 0) + 1


class Churn:
    """The live adapter names, oldest first; loads and unloads through vLLM's runtime routes."""

    def __init__(self, client: httpx.AsyncClient, root: str, dirs: list[Path], live: int, stats: Stats) -> None:
        self.client, self.root, self.dirs, self.live_max, self.stats = client, root, dirs, live, stats
        self.live: list[str] = []
        self.n = 0

    async def load_next(self) -> None:
        name = f"churn-{self.n}"
        path = self.dirs[self.n % len(self.dirs)]
        self.n += 1
        try:
            r = await self.client.post(f"{self.root}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            self.stats.add("load", r.status_code == 200, f"{r.status_code} {r.text}")
            if r.status_code == 200:
                self.live.append(name)
        except httpx.HTTPError as exc:
            self.stats.add("load", False, type(exc).__name__)
        while len(self.live) > self.live_max:
            old = self.live.pop(0)
            # requests still decoding on it finish first: vLLM only forgets the name
            try:
                r = await self.client.post(f"{self.root}/v1/unload_lora_adapter", json={"lora_name": old})
                self.stats.add("unload", r.status_code == 200, f"{r.status_code} {r.text}")
            except httpx.HTTPError as exc:
                self.stats.add("unload", False, type(exc).__name__)


async def stream_worker(client: httpx.AsyncClient, root: str, churn: Churn, stats: Stats, stop: asyncio.Event,
                        rng: random.Random) -> None:
    while not stop.is_set():
        if not churn.live:
            await asyncio.sleep(0.2)
            continue
        model = rng.choice(churn.live)
        body = {"model": model, "prompt": f"Story {rng.randrange(10**6)}: once upon a time", "stream": True,
                "max_tokens": rng.randint(16, 160), "temperature": 1.0, "ignore_eos": True}
        try:
            async with client.stream("POST", f"{root}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    # an adapter unloaded between choosing it and the request arriving: not a failure
                    # of the engine, and not counted as a request
                    if r.status_code == 404 and "does not exist" in text:
                        continue
                    stats.add("stream", False, f"{r.status_code} {text}")
                    await asyncio.sleep(0.2)
                    continue
                done = False
                async for line in r.aiter_lines():
                    if line.strip() == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"error"' in line[:40]:
                        break
                stats.add("stream", done, "" if done else "stream ended without [DONE]")
        except httpx.HTTPError as exc:
            stats.add("stream", False, type(exc).__name__)
            await asyncio.sleep(0.2)


async def prompt_logprobs_worker(client: httpx.AsyncClient, root: str, model: str, lo: int, hi: int, stats: Stats,
                                 stop: asyncio.Event, rng: random.Random) -> None:
    while not stop.is_set():
        ids = [rng.randrange(200, 40000) for _ in range(rng.randint(lo, hi))]
        body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
        try:
            r = await client.post(f"{root}/v1/completions", json=body)
            ok = r.status_code == 200 and len(r.json()["choices"][0].get("prompt_logprobs") or []) == len(ids)
            stats.add("prompt_logprobs", ok, f"{r.status_code} {r.text}")
            if not ok:
                await asyncio.sleep(0.2)
        except httpx.HTTPError as exc:
            stats.add("prompt_logprobs", False, type(exc).__name__)
            await asyncio.sleep(0.2)


async def healthy(client: httpx.AsyncClient, root: str) -> bool:
    """vLLM's /health, on its own connection (the load's pool may be full)."""
    try:
        async with httpx.AsyncClient(timeout=10) as own:
            return (await own.get(f"{root}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def cuda_error(log_text: str) -> dict[str, Any] | None:
    """The first CUDA error in vLLM's log, the vLLM frames of the traceback printed with it, and
    the Triton kernel named there (with CUDA_LAUNCH_BLOCKING=1 the raising frame is the faulting
    launch)."""
    lines = log_text.splitlines()
    hit = next((i for i, line in enumerate(lines) if "illegal memory access" in line or "CUDA error" in line), None)
    if hit is None:
        return None
    start = hit
    while start > 0 and hit - start < 200 and "Traceback (most recent call last)" not in lines[start]:
        start -= 1
    frames = [re.sub(r"^.*?File \"", 'File "', line).strip() for line in lines[start:hit + 1]
              if 'File "' in line and ("/vllm/" in line or "/triton/" in line or "/torch/" in line)]
    return {"line": re.sub(r"^\(\S+ pid=\d+\) ", "", lines[hit]).strip(), "frames": frames[-16:]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir)
    adir = Path(args.adapter_dir)
    dirs = []
    t0 = time.monotonic()
    for i in range(args.adapters):
        d = adir / f"a{i}"
        if not (d / "adapter_model.safetensors").exists():
            write_adapter(model_dir, d, seed=i)
        dirs.append(d)
    print(f"[churn] {len(dirs)} adapters in {adir} ({time.monotonic() - t0:.1f} s)", flush=True)

    proc = None
    log_path = out / f"vllm-{args.tag}.full.log"
    root = args.upstream.rstrip("/").removesuffix("/v1") if args.upstream else f"http://127.0.0.1:{args.port}"
    if not args.upstream:
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        if args.probe:
            probe = str(Path(__file__).resolve().parent / "lora_probe")
            env["PYTHONPATH"] = os.pathsep.join(x for x in (probe, env.get("PYTHONPATH")) if x)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", args.served_name, "--port", str(args.port), *shlex.split(args.vllm_args)]
        print(f"[churn] starting: {shlex.join(cmd)} (CUDA_LAUNCH_BLOCKING={env.get('CUDA_LAUNCH_BLOCKING', '')})",
              flush=True)
        log_file = open(log_path, "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    stats = Stats()
    limits = httpx.Limits(max_connections=args.streams + args.prompt_logprobs + 16, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:
        t_up = time.monotonic()
        while not await healthy(client, root):
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"vLLM exited while starting ({proc.returncode}); see {log_path}")
            if time.monotonic() - t_up > args.start_timeout:
                raise SystemExit(f"vLLM not up after {args.start_timeout} s; see {log_path}")
            await asyncio.sleep(1)
        up_s = time.monotonic() - t_up
        print(f"[churn] vLLM up after {up_s:.0f} s", flush=True)

        churn = Churn(client, root, dirs, args.live, stats)
        if args.load_every <= 0:
            for _ in range(args.live):
                await churn.load_next()
        else:
            await churn.load_next()
        stop = asyncio.Event()
        rng = random.Random(args.seed)
        tasks = [asyncio.create_task(stream_worker(client, root, churn, stats, stop, random.Random(rng.random())))
                 for _ in range(args.streams)]
        tasks += [asyncio.create_task(prompt_logprobs_worker(client, root, args.served_name, args.pl_min, args.pl_max,
                                                             stats, stop, random.Random(rng.random())))
                  for _ in range(args.prompt_logprobs)]
        t_start = time.monotonic()

        async def churn_loop() -> None:
            # its own task: a load that hangs (a dead engine behind a live API server) must not
            # hold up the health checks below
            while args.load_every > 0 and not stop.is_set():
                await asyncio.sleep(args.load_every)
                await churn.load_next()

        tasks.append(asyncio.create_task(churn_loop()))
        next_report = t_start + 30
        died_at = None
        while time.monotonic() - t_start < args.duration:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if (proc is not None and proc.poll() is not None) or not await healthy(client, root):
                died_at = now - t_start
                print(f"[churn] engine dead at {died_at:.1f} s", flush=True)
                break
            if now >= next_report:
                next_report = now + 30
                print(f"[churn] {now - t_start:.0f} s: {json.dumps(stats.counts)}", flush=True)
        stop.set()
        elapsed = time.monotonic() - t_start
        # in-flight requests end by themselves (or fail, if the engine died)
        await asyncio.wait(tasks, timeout=60 if died_at is None else 5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if proc is not None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log_file.close()
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    counts = stats.counts
    fault = cuda_error(log_text)
    if died_at is None and fault is not None:
        died_at = float("nan")  # the engine failed, though the API server's /health kept answering
    served = [k for k in ("stream", "prompt_logprobs") if k in counts]
    result = {
        "tag": args.tag,
        "engine_deaths": 0 if died_at is None else 1,
        "died_at_s": None if died_at is None or died_at != died_at else round(died_at, 1),
        "duration_s": round(elapsed, 1),
        "requests": sum(counts[k]["requests"] for k in served),
        "failed": sum(counts[k]["failed"] for k in served),
        "counts": counts,
        "adapters_loaded": counts.get("load", {}).get("requests", 0),
        "errors": dict(sorted(stats.errors.items(), key=lambda kv: -kv[1])[:12]),
        "cuda_error": fault,
        "probe": [re.sub(r"^\(\S+ pid=\d+\) ", "", line) for line in log_text.splitlines() if "lora_probe:" in line][:20],
        "vllm_up_s": round(up_s, 1),
        "vllm_args": args.vllm_args,
        "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", ""),
        "load": {"streams": args.streams, "adapters": args.adapters, "live": args.live,
                 "load_every_s": args.load_every, "prompt_logprobs_workers": args.prompt_logprobs,
                 "prompt_tokens": [args.pl_min, args.pl_max]},
        "command": shlex.join([sys.argv[0], *sys.argv[1:]]),
    }
    try:
        import vllm

        result["vllm"] = vllm.__version__
    except ImportError:
        pass
    (out / f"lora-churn-{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    if log_text:
        # vLLM's log, shortened: the probe's lines, the first CUDA error's traceback, then the tail
        lines = log_text.splitlines()
        probe_lines = [line for line in lines if "lora_probe:" in line]
        (out / f"vllm-{args.tag}.log").write_text("\n".join(
            probe_lines[:60] + ["...", *lines[-300:]]) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="the base model (Llama-shaped HF folder)")
    p.add_argument("--out", default="benchmarks/gpu/results", help="where the JSON and vLLM's log tail go")
    p.add_argument("--tag", default="run", help="names the files: lora-churn-TAG.json, vllm-TAG.log")
    p.add_argument("--upstream", help="an already running vLLM (http://host:port); default: start one")
    p.add_argument("--port", type=int, default=8511, help="port of the vLLM started here")
    p.add_argument("--served-name", default="smollm2", help="the base model's served name")
    p.add_argument("--vllm-args", default="--enable-lora --max-lora-rank 16 --max-loras 4 --max-cpu-loras 8 "
                   "--max-model-len 4096 --gpu-memory-utilization 0.5 --enforce-eager",
                   help="vLLM's flags after --model/--served-model-name/--port (one string)")
    p.add_argument("--probe", action="store_true",
                   help="load benchmarks/gpu/lora_probe into vLLM: it logs LoRA calls whose kernels would touch "
                        "rows past their input and synchronises after each, naming the call that faults (slow)")
    p.add_argument("--start-timeout", type=float, default=400, help="seconds vLLM may take to come up")
    p.add_argument("--adapter-dir", default="/tmp/lora-churn-adapters", help="where the adapters are written")
    p.add_argument("--adapters", type=int, default=12, help="distinct adapter folders, loaded in turn")
    p.add_argument("--live", type=int, default=8, help="adapter names loaded at once (oldest unloaded beyond)")
    p.add_argument("--load-every", type=float, default=1.0, help="seconds between loads; 0: load --live once")
    p.add_argument("--streams", type=int, default=128, help="concurrent streamed decodes on the live adapters")
    p.add_argument("--prompt-logprobs", type=int, default=4, help="concurrent prompt_logprobs requests (0: none)")
    p.add_argument("--pl-min", type=int, default=880, help="prompt_logprobs prompt length, fewest tokens")
    p.add_argument("--pl-max", type=int, default=1100, help="prompt_logprobs prompt length, most tokens")
    p.add_argument("--duration", type=float, default=180, help="seconds of load (less if the engine dies)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps({k: result[k] for k in ("tag", "engine_deaths", "died_at_s", "duration_s", "requests", "failed",
                                              "adapters_loaded", "counts", "cuda_error")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
