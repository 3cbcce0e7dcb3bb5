"""Publish under load: adapter written → loaded in vLLM → every gateway serving it, while
--concurrency streaming chats run through the gateways' `policy` alias.

    python benchmarks/gpu/publish_load.py --upstream http://127.0.0.1:8501/v1 --model-dir DIR \
        [--gateways 2] [--concurrency 200] [--publishes 10] [--kind lora|full] [--out DIR]

Real parts: `nextstate gateway` processes on one SQLite pool (the switch reaches them through
``datapool.policy_signal``: the file's data_version), vLLM with runtime LoRA loading, the
official publish path (``publishing.publish.publish``: load into vLLM, then activate in the pool).
Each round writes a fresh PEFT LoRA adapter (random B, so it really changes the output) for
the base model in --model-dir, publishes it, and polls every gateway's ``GET /v1/models``
until its ``policy`` alias points at the new version. Reported per publish: load (vLLM),
pool (activation committed), all gateways serving (end to end from the adapter written);
and for the load: requests, failed, time to first token and total p50/p99. Writes
publish_load.json to --out and prints a table.

``--kind full``: each round writes a whole checkpoint instead (the base's weights with fixed
noise on the attention's q projections) and publishes it as a full version: every server
pauses (``--pause-mode``), reloads the weights in place and resumes (vLLM needs
``VLLM_SERVER_DEV_MODE=1``); the load is the reload column. Files get ``-full`` (``--tag``).

``--kind full --transfer nccl``: the same checkpoints, but the servers get the tensors over NCCL
from this process (``vllm_client.transfer``: vLLM's weight-transfer engine, the server started
with ``--weight-transfer-config '{"backend": "nccl"}'``; ``WEIGHT_TRANSFER=nccl`` in
``benchmarks/gpu/run.sh``), this process holding the model on a GPU of its own: what a trainer
on another GPU of the host does. The checkpoint is still written, and recorded as the version's
directory. Files get ``-full-nccl``.

    LORA=0 WEIGHT_TRANSFER=nccl PUBLISH_ARGS="--kind full --transfer nccl --pause-mode keep" \
        bash benchmarks/gpu/run.sh publish
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datapool import versions  # noqa: E402
from vllm_client.adapters import unload
from datapool.db import make_engine, upgrade  # noqa: E402
from base.vocab import PauseMode, VersionKind  # noqa: E402
from tests.support.processes import GatewayProcess  # noqa: E402
from publishing.publish import PublishRequest, activate, publish  # noqa: E402

QUESTIONS = ["What is photosynthesis?", "Why is the sky blue?", "How do vaccines work?", "What is gravity?",
             "How does a compass work?", "What is DNA?", "Why do cats purr?", "What is a galaxy?"]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def write_adapter(model_dir: Path, out: Path, seed: int) -> None:
    """A LoRA adapter (r=8, q/v projections) with random, non-zero B: a version that answers
    differently from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    model.save_pretrained(out)


def write_checkpoint(model_dir: Path, out: Path, seed: int, device: str = "cpu") -> Any:
    """A whole checkpoint of the base model whose q projections carry fixed noise: other weights
    of the same architecture, as full fine-tuning would write (tests/publishing/test_publish_full.py).
    Returns the model (on *device*: the tensors a trainer there would send)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_proj.weight"):
                p.add_(torch.randn_like(p) * p.std() * 0.1)
    model.save_pretrained(out)
    for f in model_dir.iterdir():  # the tokenizer and chat template travel with the weights
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return model


class Load:
    """--concurrency workers, each streaming chats through the gateways in turn until stopped."""

    def __init__(self, gateways: list[str], concurrency: int, max_tokens: int):
        self.gateways, self.concurrency, self.max_tokens = gateways, concurrency, max_tokens
        self.ttft: list[float] = []
        self.total: list[float] = []
        self.failed: list[str] = []
        self.failed_at: list[float] = []  # time.time() of each failure
        self.started_at: list[float] = []  # time.time() each request started (successes and failures)
        self.stop = asyncio.Event()

    def fail(self, what: str) -> None:
        self.failed.append(what)
        self.failed_at.append(time.time())

    async def one(self, http: httpx.AsyncClient, worker: int, i: int) -> None:
        url = f"{self.gateways[(worker + i) % len(self.gateways)]}/chat/completions"
        body = {"model": "policy", "stream": True, "max_tokens": self.max_tokens, "temperature": 0.7,
                "messages": [{"role": "user", "content": QUESTIONS[(worker + i) % len(QUESTIONS)]}]}
        t0 = time.perf_counter()
        self.started_at.append(time.time())
        first = None
        try:
            async with http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    self.fail(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                done = False
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if first is None:
                            first = time.perf_counter() - t0
                        if line == "data: [DONE]":
                            done = True
                        elif '"error"' in line[:20]:
                            self.fail(line[:200])
                            return
                if not done:
                    self.fail("stream ended without [DONE]")
                    return
        except httpx.HTTPError as exc:
            self.fail(f"{type(exc).__name__}: {exc}")
            return
        self.ttft.append(first or 0.0)
        self.total.append(time.perf_counter() - t0)

    async def worker(self, http: httpx.AsyncClient, w: int) -> None:
        i = 0
        while not self.stop.is_set():
            await self.one(http, w, i)
            i += 1

    async def run(self, first_worker: int = 0) -> None:
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            await asyncio.gather(*(self.worker(http, first_worker + w) for w in range(self.concurrency)))

    def results(self) -> dict[str, list[Any]]:
        return {"ttft": self.ttft, "total": self.total, "failed": self.failed, "failed_at": self.failed_at,
                "started_at": self.started_at}


def _load_process(gateways: list[str], concurrency: int, first_worker: int, max_tokens: int, stop: Any,
                  out: Any) -> None:
    """One load process: *concurrency* workers until *stop* (a multiprocessing Event) is set; then
    its measurements go to *out* (a multiprocessing Queue)."""
    async def go() -> dict[str, list[Any]]:
        load = Load(gateways, concurrency, max_tokens)
        task = asyncio.create_task(load.run(first_worker))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        load.stop.set()
        await task
        return load.results()

    out.put(asyncio.run(go()))


class LoadProcesses:
    """The load in *procs* processes of its own: 200 streams parsed in the publishing process
    held its event loop and the GIL, so the publish (a thread there) measured the benchmark's own
    contention too. A trainer publishes from its own process, beside clients elsewhere."""

    def __init__(self, gateways: list[str], concurrency: int, max_tokens: int, procs: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.stop, self.queue = ctx.Event(), ctx.Queue()
        shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
        starts = [sum(shares[:i]) for i in range(procs)]
        self.procs = [ctx.Process(target=_load_process, args=(gateways, n, start, max_tokens, self.stop, self.queue),
                                  daemon=True) for n, start in zip(shares, starts, strict=True) if n]

    def start(self) -> None:
        for p in self.procs:
            p.start()

    async def finish(self) -> Load:
        """Stops the processes; their measurements merged into one :class:`Load`'s lists."""
        self.stop.set()
        merged = Load([], 0, 0)
        for _ in self.procs:
            part = await asyncio.to_thread(self.queue.get, True, 300)
            for key, values in part.items():
                getattr(merged, key).extend(values)
        for p in self.procs:
            await asyncio.to_thread(p.join, 30)
        return merged


def event_metrics(engine: Any, name: str) -> dict[str, Any]:
    """The metrics of version *name*'s publish event ({} if none)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session as OrmSession

    from datapool.models import PolicyEvent, PolicyVersion

    with OrmSession(engine) as db:
        ev = db.scalars(select(PolicyEvent).join(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
                        .where(PolicyVersion.name == name)).first()
        return dict(ev.metrics or {}) if ev is not None else {}


def reload_parts(metrics: dict[str, Any]) -> dict[str, float]:
    """The slowest server's reload steps (vllm_client.weights.Reload: pause_s, before_s, reload_s,
    confirm_s, digest_s), from the publish event."""
    reloads = metrics.get("reloads") or []
    if not reloads:
        return {}
    slowest = max(reloads, key=lambda r: r.get("total_s") or 0.0)
    return {k: float(slowest.get(k) or 0.0) for k in ("pause_s", "before_s", "reload_s", "confirm_s", "digest_s")}


def load_seconds(metrics: dict[str, Any]) -> float | None:
    """vLLM's adapter load time (a full version: pause + reload + resume), as the publish event
    recorded it; the slowest server's."""
    seconds = metrics.get("lora_load_s")
    if seconds is None and metrics.get("reloads"):
        seconds = {r.get("url", str(i)): r.get("total_s") for i, r in enumerate(metrics["reloads"])}
    # one number per server: the slowest is what the switch waited for
    return max(seconds.values()) if isinstance(seconds, dict) and seconds else seconds


async def serving(http: httpx.AsyncClient, gateway: str, name: str) -> float:
    """Seconds (perf_counter) at which *gateway*'s `policy` alias first points at *name*."""
    while True:
        r = await http.get(f"{gateway}/models")
        if r.status_code == 200 and any(m["id"] == "policy" and m.get("root") == name for m in r.json()["data"]):
            return time.perf_counter()
        await asyncio.sleep(0.005)


async def main_async(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    pool = f"sqlite:///{work / 'pool.db'}"
    upgrade(pool)
    engine = make_engine(pool)
    rounds: list[dict[str, Any]] = []
    with_gws = [GatewayProcess(work / f"gw{i}", database_url=pool, upstream_url=args.upstream)
                for i in range(args.gateways)]
    for gw in with_gws:
        gw.__enter__()
    try:
        gateways = [gw.base_url for gw in with_gws]
        procs = None
        if args.load_procs:
            procs = LoadProcesses(gateways, args.concurrency, args.max_tokens, args.load_procs)
            procs.start()
        else:
            load = Load(gateways, args.concurrency, args.max_tokens)
            task = asyncio.create_task(load.run())
        await asyncio.sleep(args.warmup_s)  # the load reaches its steady state first
        group = None
        if args.transfer == "nccl":  # this process is the trainer's end of the group (its own GPU)
            from vllm_client.transfer import NcclWeights, TransferGroup

            # 120 s: the group forms in seconds; one that does not says who it still waited for
            print(f"joining the NCCL group with {args.upstream} ...", flush=True)
            t0 = time.perf_counter()
            group = await asyncio.to_thread(TransferGroup([args.upstream], timeout_s=120).connect)
            print(f"joined in {time.perf_counter() - t0:.1f} s", flush=True)
        async with httpx.AsyncClient(timeout=30) as http:
            for k in range(args.publishes):
                directory = work / f"{args.kind}-{k}"
                if args.kind == VersionKind.LORA:
                    await asyncio.to_thread(write_adapter, Path(args.model_dir), directory, k)
                else:
                    model = await asyncio.to_thread(write_checkpoint, Path(args.model_dir), directory, k,
                                                    "cuda" if group is not None else "cpu")
                transfer = None
                if group is not None:
                    tensors = [(n, t.detach()) for n, t in model.state_dict().items()
                               if not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
                    transfer = NcclWeights(group, lambda tensors=tensors: tensors)
                name = f"gpu-load-{args.kind}-{k}-{os.getpid()}"
                t0 = time.perf_counter()  # the adapter is written
                written_at = time.time()
                watchers = [asyncio.create_task(serving(http, g, name)) for g in gateways]
                await asyncio.to_thread(publish, engine, PublishRequest(
                    directory=directory, base_model=args.model, vllm_urls=[args.upstream], name=name,
                    kind=VersionKind(args.kind), pause_mode=PauseMode(args.pause_mode),
                    activate=True, copy=False, actor="bench", reason="publish under load", transfer=transfer))
                t_pool = time.perf_counter()
                seen = await asyncio.wait_for(asyncio.gather(*watchers), 60)
                metrics = event_metrics(engine, name)
                rounds.append({"name": name, "written_at": written_at, "load_s": load_seconds(metrics),
                               "phases_s": dict(metrics.get("phases_s") or {}), "reload_parts_s": reload_parts(metrics),
                               "pool_s": t_pool - t0, "gateways_s": [s - t0 for s in seen],
                               "all_serving_s": max(seen) - t0})
                print(f"publish {k}: {rounds[-1]}", flush=True)
                await asyncio.sleep(args.gap_s)
        if procs is not None:
            load = await procs.finish()
        else:
            load.stop.set()
            await task
        # leave the server as it was: the base serves (its own weights), the adapters are unloaded
        await asyncio.to_thread(activate, engine, versions.BASE, [args.upstream])
        if args.kind == VersionKind.LORA:
            with httpx.Client(timeout=30) as sync:
                for r in rounds:
                    unload(sync, [args.upstream], r["name"])
    finally:
        for gw in with_gws:
            gw.__exit__(None, None, None)
        engine.dispose()
    ends = [r["all_serving_s"] for r in rounds]
    windows = [(r["written_at"], r["written_at"] + r["all_serving_s"] + 1.0) for r in rounds]
    return {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rounds": rounds,
            "switch_p50_s": pct(ends, 0.5), "switch_p99_s": pct(ends, 0.99), "switch_max_s": max(ends),
            # the production-shape acceptance's names (#45), for a full version
            **({"full_weights_p50_s": pct(ends, 0.5), "full_weights_p99_s": pct(ends, 0.99)}
               if args.kind == VersionKind.FULL else {}),
            "requests": len(load.total) + len(load.failed), "failed": len(load.failed),
            "failed_during_publishes": failed_in(load.failed_at, windows),
            "failures": load.failed[:20], "ttft_p50_s": pct(load.ttft, 0.5), "ttft_p99_s": pct(load.ttft, 0.99),
            "total_p50_s": pct(load.total, 0.5), "total_p99_s": pct(load.total, 0.99)}


def failed_in(failed_at: list[float], windows: list[tuple[float, float]]) -> int:
    """Failures that happened inside any of the (start, end) windows (time.time())."""
    return sum(any(a <= t <= b for a, b in windows) for t in failed_at)


def _outside_parts(rounds: list[dict[str, Any]]) -> list[tuple[str, list[float]]]:
    """publish() outside vLLM, by step (publish()'s phases_s): the checks, the serving step
    around vLLM's own part (pause, label, resume, confirm), and the rest (the pool's commit)."""
    done = [r for r in rounds if r.get("phases_s") and r.get("load_s") is not None]
    ph = [r["phases_s"] for r in done]
    return [
        ("checks (files, shapes, name)", [p.get("check_s", 0.0) + p.get("place_s", 0.0) for p in ph]),
        ("serving step around vLLM's part", [r["phases_s"].get("serve_s", 0.0) - r["load_s"] for r in done]),
        *[(f"… {label}", [(r.get("reload_parts_s") or {}).get(key, 0.0) for r in done])
          for label, key in (("the pause (vLLM's /pause answered)", "pause_s"),
                             ("what it holds, read (NCCL: once paused, the pause included)", "before_s"),
                             ("the weights: start, sent, finish, label (NCCL; from disk: the reload)", "reload_s"),
                             ("confirming (label, not paused, one-token completion)", "confirm_s"),
                             ("weights checksum", "digest_s"))
          if any((r.get("reload_parts_s") or {}).get(key) for r in done)],
        ("registering it in the pool, and the rest", [
            r["pool_s"] - sum(r["phases_s"].get(k, 0.0) for k in ("check_s", "place_s", "serve_s")) for r in done]),
    ]


def table(res: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    loads = [r["load_s"] for r in res["rounds"] if r["load_s"] is not None]
    outside = [r["pool_s"] - r["load_s"] for r in res["rounds"] if r["load_s"] is not None]
    after = [r["all_serving_s"] - r["pool_s"] for r in res["rounds"]]
    c = res["config"]
    kind = c.get("kind", "lora")
    what = ("vLLM load_lora_adapter s" if kind == "lora"
            else f"vLLM pause ({c.get('pause_mode')}) + weights over NCCL + resume s" if c.get("transfer") == "nccl"
            else f"vLLM pause ({c.get('pause_mode')}) + reload_weights + resume s")
    thing = "adapter" if kind == "lora" else "checkpoint"
    return "\n".join([
        f"publish under load ({kind}): {c['publishes']} publishes, {c['gateways']} gateways, {c['concurrency']} "
        f"concurrent streams ({c['max_tokens']} tokens each)",
        "",
        "| what | p50 | p99 | max |",
        "|---|---|---|---|",
        f"| {what} | {f(pct(loads, .5))} | {f(pct(loads, .99))} | {f(max(loads) if loads else None)} |",
        f"| {thing} written → active in the pool s | {f(pct([r['pool_s'] for r in res['rounds']], .5))} | "
        f"{f(pct([r['pool_s'] for r in res['rounds']], .99))} | {f(max(r['pool_s'] for r in res['rounds']))} |",
        f"| {thing} written → every gateway serving it s | {f(res['switch_p50_s'])} | {f(res['switch_p99_s'])} | "
        f"{f(res['switch_max_s'])} |",
        # where the rest goes: publish() around vLLM (checks, the pool's commit), then the gateways' switch
        f"| of which publish() outside vLLM s | {f(pct(outside, .5))} | {f(pct(outside, .99))} | "
        f"{f(max(outside) if outside else None)} |",
        *[f"| … {label} s | {f(pct(xs, .5))} | {f(pct(xs, .99))} | {f(max(xs))} |"
          for label, xs in _outside_parts(res["rounds"]) if xs],
        f"| of which active in the pool → every gateway s | {f(pct(after, .5))} | {f(pct(after, .99))} | "
        f"{f(max(after) if after else None)} |",
        f"| load: time to first token s | {f(res['ttft_p50_s'])} | {f(res['ttft_p99_s'])} | |",
        f"| load: whole stream s | {f(res['total_p50_s'])} | {f(res['total_p99_s'])} | |",
        "",
        f"requests during the run: {res['requests']}, failed: {res['failed']} "
        f"({res.get('failed_during_publishes', '–')} of them between a {kind} written and every gateway serving it)",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="vLLM …/v1 serving --model with runtime LoRA loading")
    p.add_argument("--model", default="smollm2", help="served name of the base model")
    p.add_argument("--model-dir", required=True, help="the base model's directory (adapters are made for it)")
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--publishes", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--load-procs", type=int, default=4,
                   help="processes the streams run in (0: in this one, beside the publish, as before 2026-11-30)")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--gap-s", type=float, default=1.0, help="pause between publishes")
    p.add_argument("--kind", choices=[VersionKind.LORA, VersionKind.FULL], default=VersionKind.LORA,
                   help="publish LoRA adapters, or whole checkpoints (vLLM needs VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--pause-mode", choices=[m.value for m in PauseMode], default=PauseMode.WAIT,
                   help="full: what requests in flight do during a reload (base.vocab.PauseMode)")
    p.add_argument("--transfer", choices=["disk", "nccl"], default="disk",
                   help="full: the servers reload each checkpoint from disk, or get its tensors over NCCL from this "
                        "process (on a GPU of its own; vLLM started with --weight-transfer-config)")
    p.add_argument("--tag", help="file name suffix (default: the kind, and -nccl, for full)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/gpu/results"))
    args = p.parse_args()
    if args.transfer == "nccl" and args.kind != VersionKind.FULL:
        p.error("--transfer nccl sends full weights: use it with --kind full")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="publish-load-"))
    res = asyncio.run(main_async(args, work))
    tag = args.tag or ("" if args.kind == VersionKind.LORA else args.kind + ("-nccl" if args.transfer == "nccl" else ""))
    stem = f"publish_load-{tag}" if tag else "publish_load"
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (args.out / f"{stem}.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
