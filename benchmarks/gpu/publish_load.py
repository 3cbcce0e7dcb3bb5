"""Publish under load: adapter written → loaded in vLLM → every gateway serving it, while
--concurrency streaming chats run through the gateways' `policy` alias.

    python benchmarks/gpu/publish_load.py --upstream http://127.0.0.1:8501/v1 --model-dir DIR \
        [--gateways 2] [--concurrency 200] [--publishes 10] [--out DIR]

Real parts: `nextstate gateway` processes on one SQLite pool (the switch reaches them through
``datapool.policy_signal``: the file's data_version), vLLM with runtime LoRA loading, the
official publish path (``trainer.publish.publish``: load into vLLM, then activate in the pool).
Each round writes a fresh PEFT LoRA adapter (random B, so it really changes the output) for
the base model in --model-dir, publishes it, and polls every gateway's ``GET /v1/models``
until its ``policy`` alias points at the new version. Reported per publish: load (vLLM),
pool (activation committed), all gateways serving (end to end from the adapter written);
and for the load: requests, failed, time to first token and total p50/p99. Writes
publish_load.json to --out and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datapool import versions, vllm_admin  # noqa: E402
from datapool.db import make_engine, upgrade  # noqa: E402
from tests.processes import GatewayProcess  # noqa: E402
from trainer.publish import PublishRequest, publish  # noqa: E402

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


class Load:
    """--concurrency workers, each streaming chats through the gateways in turn until stopped."""

    def __init__(self, gateways: list[str], concurrency: int, max_tokens: int):
        self.gateways, self.concurrency, self.max_tokens = gateways, concurrency, max_tokens
        self.ttft: list[float] = []
        self.total: list[float] = []
        self.failed: list[str] = []
        self.stop = asyncio.Event()

    async def one(self, http: httpx.AsyncClient, worker: int, i: int) -> None:
        url = f"{self.gateways[(worker + i) % len(self.gateways)]}/chat/completions"
        body = {"model": "policy", "stream": True, "max_tokens": self.max_tokens, "temperature": 0.7,
                "messages": [{"role": "user", "content": QUESTIONS[(worker + i) % len(QUESTIONS)]}]}
        t0 = time.perf_counter()
        first = None
        try:
            async with http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    self.failed.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                done = False
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if first is None:
                            first = time.perf_counter() - t0
                        if line == "data: [DONE]":
                            done = True
                        elif '"error"' in line[:20]:
                            self.failed.append(line[:200])
                            return
                if not done:
                    self.failed.append("stream ended without [DONE]")
                    return
        except httpx.HTTPError as exc:
            self.failed.append(f"{type(exc).__name__}: {exc}")
            return
        self.ttft.append(first or 0.0)
        self.total.append(time.perf_counter() - t0)

    async def worker(self, http: httpx.AsyncClient, w: int) -> None:
        i = 0
        while not self.stop.is_set():
            await self.one(http, w, i)
            i += 1

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            await asyncio.gather(*(self.worker(http, w) for w in range(self.concurrency)))


def load_seconds(engine: Any, name: str) -> float | None:
    """vLLM's adapter load time, as the publish event recorded it."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session as OrmSession

    from datapool.models import PolicyEvent, PolicyVersion

    with OrmSession(engine) as db:
        ev = db.scalars(select(PolicyEvent).join(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
                        .where(PolicyVersion.name == name)).first()
        seconds = (ev.metrics or {}).get("lora_load_s") if ev is not None else None
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
        load = Load(gateways, args.concurrency, args.max_tokens)
        task = asyncio.create_task(load.run())
        await asyncio.sleep(args.warmup_s)  # the load reaches its steady state first
        async with httpx.AsyncClient(timeout=30) as http:
            for k in range(args.publishes):
                directory = work / f"adapter-{k}"
                await asyncio.to_thread(write_adapter, Path(args.model_dir), directory, k)
                name = f"gpu-load-{k}-{os.getpid()}"
                t0 = time.perf_counter()  # the adapter is written
                watchers = [asyncio.create_task(serving(http, g, name)) for g in gateways]
                await asyncio.to_thread(publish, engine, PublishRequest(
                    directory=directory, base_model=args.model, vllm_urls=[args.upstream], name=name,
                    activate=True, copy=False, actor="bench", reason="publish under load"))
                t_pool = time.perf_counter()
                seen = await asyncio.wait_for(asyncio.gather(*watchers), 60)
                rounds.append({"name": name, "load_s": load_seconds(engine, name),
                               "pool_s": t_pool - t0, "gateways_s": [s - t0 for s in seen],
                               "all_serving_s": max(seen) - t0})
                print(f"publish {k}: {rounds[-1]}", flush=True)
                await asyncio.sleep(args.gap_s)
        load.stop.set()
        await task
        # leave the server as it was: the base serves, the adapters are unloaded
        await asyncio.to_thread(versions.activate, engine, versions.BASE, [args.upstream])
        with httpx.Client(timeout=30) as sync:
            for r in rounds:
                vllm_admin.unload(sync, [args.upstream], r["name"])
    finally:
        for gw in with_gws:
            gw.__exit__(None, None, None)
        engine.dispose()
    ends = [r["all_serving_s"] for r in rounds]
    return {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rounds": rounds,
            "switch_p50_s": pct(ends, 0.5), "switch_p99_s": pct(ends, 0.99), "switch_max_s": max(ends),
            "requests": len(load.total) + len(load.failed), "failed": len(load.failed),
            "failures": load.failed[:20], "ttft_p50_s": pct(load.ttft, 0.5), "ttft_p99_s": pct(load.ttft, 0.99),
            "total_p50_s": pct(load.total, 0.5), "total_p99_s": pct(load.total, 0.99)}


def table(res: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    loads = [r["load_s"] for r in res["rounds"] if r["load_s"] is not None]
    c = res["config"]
    return "\n".join([
        f"publish under load: {c['publishes']} publishes, {c['gateways']} gateways, {c['concurrency']} concurrent "
        f"streams ({c['max_tokens']} tokens each)",
        "",
        "| what | p50 | p99 | max |",
        "|---|---|---|---|",
        f"| vLLM load_lora_adapter s | {f(pct(loads, .5))} | {f(pct(loads, .99))} | {f(max(loads) if loads else None)} |",
        f"| adapter written → active in the pool s | {f(pct([r['pool_s'] for r in res['rounds']], .5))} | "
        f"{f(pct([r['pool_s'] for r in res['rounds']], .99))} | {f(max(r['pool_s'] for r in res['rounds']))} |",
        f"| adapter written → every gateway serving it s | {f(res['switch_p50_s'])} | {f(res['switch_p99_s'])} | "
        f"{f(res['switch_max_s'])} |",
        f"| load: time to first token s | {f(res['ttft_p50_s'])} | {f(res['ttft_p99_s'])} | |",
        f"| load: whole stream s | {f(res['total_p50_s'])} | {f(res['total_p99_s'])} | |",
        "",
        f"requests during the run: {res['requests']}, failed: {res['failed']}",
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
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--gap-s", type=float, default=1.0, help="pause between publishes")
    p.add_argument("--out", type=Path, default=Path("benchmarks/gpu/results"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="publish-load-"))
    res = asyncio.run(main_async(args, work))
    (args.out / "publish_load.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (args.out / "publish_load.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
