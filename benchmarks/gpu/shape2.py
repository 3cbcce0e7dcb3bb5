"""The mission's own shape (issue 19): a trainer process pulling scored batches from the pool and
pushing weights to a vLLM it does not share anything else with, while gateways serve.

    python benchmarks/gpu/shape2.py --upstream http://127.0.0.1:8501/v1 --model-dir DIR \\
        [--backend verl|local] [--modes lora,full] [--trainer-gpu 1] [--concurrency 200] [--out DIR]

On the GPU machine (2 × H100, ``benchmarks/gpu/run.sh shape2``): vLLM on GPU 0 (LoRA, and
``VLLM_SERVER_DEV_MODE=1`` so full weights can be reloaded in place), ``--gateways`` `nextstate
gateway` processes on one SQLite pool, and ``CUDA_VISIBLE_DEVICES=1 nextstate train --backend
verl --publish --push-every 1`` as a separate process: it shares only the pool (SQLite file)
and HTTP (vLLM's admin endpoints) with the serving side. On the CPU, ``--backend local`` runs
the same orchestration with the local trainer (one publish per run, at its end).

Phases:

1. **fill** — ``--fill`` interactions of the learning benchmark's simulated user (a question on
   the `policy` alias at temperature 1, then the user's reaction, which is the reply's next
   state) through the gateways, each scored by the python judge
   (``benchmarks.learning.preference:judge`` through ``scoring.score.score_turn``):
   white-box turns with token ids, behaviour logprobs and a reward, as the trainer leases them.
2. **load** — ``--concurrency`` streaming chats on `policy` through the gateways (the load of
   ``publish_load.py``) from here to the end of the last trainer run; the simulated user keeps
   interacting and scoring (``--live-users``) so the pool grows while the trainer pulls from it.
3. **a trainer run per mode** (``lora``, ``full``): ``nextstate train --objective rl --steps N
   --publish`` (veRL: ``--push-every 1``: every step writes the weights through the checkpoint
   engine and publishes them). Meanwhile a watcher polls every gateway's ``GET /v1/models``
   (which version ``policy`` serves). Per push: weights written (the mtime of the weight files
   in the directory the trainer wrote, found by the version's step or run) → vLLM loaded and
   the version active in the pool (the publish event) → each gateway serving it; vLLM's own
   load / reload time (the event's metrics); requests of the load that failed between weights
   written and every gateway serving it (+1 s).
4. **proof** — after each run a chat on `policy` through a gateway: its recorded turn names the
   version the trainer published last (the pool's ``policy_version``), and the load's turns are
   counted per version; for full weights the label of vLLM's weights names it as well
   (``weight_label``: ``/weight_info``, or the workers' label on vLLM 0.26).
5. **full publish under load** (``--full-publishes``, issue 19's "full-weight publish through
   vLLM's weight-update API"): ``publish_load.py --kind full`` in a subprocess, if the budget
   allows.

Writes ``shape2.json`` and ``shape2.md`` (and publish_load-full.*, logs.tgz) to --out; prints
progress with timestamps. ``--budget-s`` skips phases that would not end in time.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402
from sqlalchemy.orm import Session as OrmSession  # noqa: E402

from benchmarks.gpu.publish_load import Load, failed_in, pct  # noqa: E402
from benchmarks.learning import preference  # noqa: E402
from benchmarks.learning.bench import TRAIN  # noqa: E402
from datapool import versions  # noqa: E402
from publishing.publish import activate  # noqa: E402
from vllm_client.adapters import unload
from base.errors import WeightsError
from vllm_client.weights import labels, require_weight_labels
from datapool.db import make_engine, upgrade  # noqa: E402
from datapool.models import Judgement, PolicyEvent, PolicyVersion, TrainingRun, TrainingStep, Turn  # noqa: E402
from scoring.judge import PythonJudge  # noqa: E402
from scoring.score import score_turn  # noqa: E402
from tests.support.processes import GatewayProcess, wait_for  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[shape2 {datetime.now(UTC):%H:%M:%S} +{time.time() - T0:5.0f}s] {msg}", flush=True)


def left(args: argparse.Namespace) -> float:
    return args.budget_s - (time.time() - T0)


# ------------------------------------------------------------------------ the simulated user


class User:
    """The learning benchmark's simulated user: asks, reacts (the next state), and the python
    judge scores the reply from that reaction."""

    def __init__(self, gateways: list[str], engine: Any, max_tokens: int):
        self.gateways, self.engine, self.max_tokens = gateways, engine, max_tokens
        self.judge = PythonJudge("benchmarks.learning.preference:judge")
        self.scored: list[tuple[str, float, float]] = []  # (turn id, reward, time scored)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def interact(self, i: int) -> None:
        question = TRAIN[i % len(TRAIN)]
        gw = self.gateways[i % len(self.gateways)]
        sid = f"shape2-{uuid.uuid4().hex}"
        headers = {"X-Session-Id": sid}
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        try:
            with httpx.Client(timeout=120) as http:
                r = http.post(f"{gw}/chat/completions", headers=headers, json={
                    "model": "policy", "messages": messages, "max_tokens": self.max_tokens, "temperature": 1.0,
                    "seed": i})
                r.raise_for_status()
                tid = r.headers["x-turn-id"]
                reply = r.json()["choices"][0]["message"]["content"] or ""
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": preference.reaction(question, reply)}]
                http.post(f"{gw}/chat/completions", headers=headers, json={
                    "model": "policy", "messages": messages, "max_tokens": 1}).raise_for_status()

            def has_next_state() -> bool:
                with OrmSession(self.engine) as db:
                    t = db.get(Turn, tid)
                    return t is not None and t.next_state is not None

            wait_for(has_next_state, timeout=60, interval=0.02)
            status = score_turn(self.engine, tid, self.judge, 1, None)
            with OrmSession(self.engine) as db:
                j = db.get(Judgement, tid)
                reward = float(j.reward) if j is not None and j.reward is not None else float("nan")
            if status != "scored":
                raise RuntimeError(f"turn {tid}: judgement {status}")
            with self._lock:
                self.scored.append((tid, reward, time.time()))
        except Exception as exc:  # noqa: BLE001 - counted and reported
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    def fill(self, n: int, parallel: int, start: int = 0) -> None:
        with ThreadPoolExecutor(parallel) as ex:
            list(ex.map(self.interact, range(start, start + n)))

    def live(self, parallel: int) -> threading.Thread:
        """Keep interacting until ``stop`` is set (the pool grows while the trainer pulls)."""
        def run(w: int) -> None:
            i = 100_000 + w
            while not self.stop.is_set():
                self.interact(i)
                i += parallel

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(parallel)]
        for t in threads:
            t.start()
        return threads[0] if threads else threading.Thread()


# ---------------------------------------------------------------------------- the watcher


class Watcher:
    """Polls every gateway's ``/v1/models``, recording when each gateway first served each
    version as `policy` (time.time())."""

    def __init__(self, gateways: list[str], interval: float = 0.01):
        self.gateways, self.interval = gateways, interval
        self.seen: list[dict[str, float]] = [{} for _ in gateways]  # per gateway: root → first seen
        self.polls = 0
        self.stop = asyncio.Event()

    async def poll_gateway(self, http: httpx.AsyncClient, k: int) -> None:
        while not self.stop.is_set():
            try:
                r = await http.get(f"{self.gateways[k]}/models")
                now = time.time()
                if r.status_code == 200:
                    for m in r.json()["data"]:
                        if m["id"] == "policy" and m.get("root"):
                            self.seen[k].setdefault(m["root"], now)
                self.polls += 1
            except httpx.HTTPError:
                pass
            await asyncio.sleep(self.interval)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(*(self.poll_gateway(http, k) for k in range(len(self.gateways))))


def written_at(directory: Path) -> float | None:
    """When the weights were written: the newest mtime among the directory's weight files."""
    files = [f for f in directory.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".bin")]
    files = files or [f for f in directory.rglob("*") if f.is_file()]
    return max(f.stat().st_mtime for f in files) if files else None


def as_ts(iso: str | None) -> float | None:
    if not iso:
        return None
    d = datetime.fromisoformat(iso)
    return (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()


def publish_event(engine: Any, name: str) -> dict[str, Any]:
    with OrmSession(engine) as db:
        ev = db.scalars(select(PolicyEvent).join(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
                        .where(PolicyVersion.name == name, PolicyEvent.action == "publish")).first()
        if ev is None:
            return {}
        created = ev.created_at if ev.created_at.tzinfo else ev.created_at.replace(tzinfo=UTC)
        return {"at": created.timestamp(), "metrics": dict(ev.metrics or {})}


def vllm_seconds(metrics: dict[str, Any]) -> dict[str, float | None]:
    """The slowest server's adapter load, or (full) pause / reload_weights / whole reload."""
    lora = metrics.get("lora_load_s")
    if isinstance(lora, dict):
        lora = max(lora.values()) if lora else None
    reloads = metrics.get("reloads") or []
    return {"lora_load_s": lora,
            "reload_total_s": max((r.get("total_s") or 0 for r in reloads), default=None) if reloads else None,
            "pause_s": max((r.get("pause_s") or 0 for r in reloads), default=None) if reloads else None,
            "reload_s": max((r.get("reload_s") or 0 for r in reloads), default=None) if reloads else None}


def turns_per_version(engine: Any, since: float) -> dict[str, int]:
    """Turns captured since *since* (time.time()) per recorded policy version."""
    with OrmSession(engine) as db:
        rows = db.execute(select(Turn.policy_version, func.count()).where(
            Turn.created_at >= datetime.fromtimestamp(since, UTC))
            .group_by(Turn.policy_version)).all()
    return {str(v): int(n) for v, n in rows}


def train_steps(engine: Any, since: float) -> list[dict[str, Any]]:
    """The optimizer steps of the runs started since *since*: seconds, loss, turns, tokens/s."""
    keys = ("seconds", "pg_loss", "samples", "tokens_per_s", "advantage_mean")
    with OrmSession(engine) as db:
        runs = list(db.scalars(select(TrainingRun.id).where(
            TrainingRun.created_at >= datetime.fromtimestamp(since, UTC))))
        rows = db.scalars(select(TrainingStep).where(TrainingStep.run_id.in_(runs))
                          .order_by(TrainingStep.created_at, TrainingStep.id)).all()
        return [{"step": r.step, **{k: (r.metrics or {}).get(k) for k in keys}} for r in rows]


def policy_turn(gateway: GatewayProcess) -> dict[str, Any]:
    """One chat on `policy` through *gateway*: the version its recorded turn names."""
    r = httpx.post(f"{gateway.base_url}/chat/completions", timeout=60, json={
        "model": "policy", "messages": [{"role": "user", "content": "What is gravity?"}], "max_tokens": 24,
        "temperature": 0})
    r.raise_for_status()
    tid = r.headers["x-turn-id"]
    turn = wait_for(lambda: (t := httpx.get(f"{gateway.url}/api/turns/{tid}", timeout=5)).status_code == 200
                    and t.json(), timeout=30, interval=0.05)
    body = r.json()
    return {"turn_id": tid, "policy_version": turn.get("policy_version"), "upstream_model": turn.get("upstream_model"),
            "response_model": body.get("model"), "reply": (body["choices"][0]["message"]["content"] or "")[:120]}


# ------------------------------------------------------------------------------ a trainer run


def trainer_command(args: argparse.Namespace, mode: str, pool: str) -> list[str]:
    full = mode == "full"
    cmd = [sys.executable, "-m", "nextstate.cli", "train", "--backend", args.backend, "--objective", "rl",
           "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--micro-batch-size", str(args.micro_batch_size),
           "--lr", str(args.lr_full if full else args.lr_lora), "--model-dir", str(args.model_dir),
           "--vllm-url", args.upstream, "--database-url", pool, "--publish"]
    if full:
        cmd += ["--full", "--pause-mode", args.pause_mode, "--weight-transfer", args.weight_transfer]
    if args.backend == "verl":
        cmd += ["--gpus", "1", "--push-every", str(args.push_every)]
    return cmd


async def train_run(args: argparse.Namespace, mode: str, pool: str, engine: Any, work: Path, watcher: Watcher,
                    load: Load, gws: list[GatewayProcess]) -> dict[str, Any]:
    data = work / f"train-{mode}"
    data.mkdir(parents=True, exist_ok=True)
    before = {v["name"] for v in versions.list_versions(engine)}
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(data), "NEXTSTATE_UPSTREAM_MODEL": args.model,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONUNBUFFERED": "1"}
    env.pop("NEXTSTATE_TEACHER_URL", None)
    # no network on the GPU machine; one GPU per process, so no NVLink multicast (KINDS.md)
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("NCCL_NVLS_ENABLE", "0")):
        env.setdefault(k, v)
    if args.trainer_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.trainer_gpu
    cmd = trainer_command(args, mode, pool)
    log_path = work / f"trainer-{mode}.log"
    log(f"trainer {mode}: {' '.join(cmd[2:])} (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')}, "
        f"log {log_path})")
    started = time.time()
    failed_before = len(load.failed)
    requests_before = len(load.started_at)
    with open(log_path, "wb") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
        timeout = max(30.0, min(args.run_timeout, left(args) - args.reserve_s))
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            log(f"trainer {mode}: still running after {timeout:.0f} s: killed")
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            await proc.wait()
            rc = "timeout"
    ended = time.time()
    tail = log_path.read_text(errors="replace").splitlines()
    tail = [ln for ln in tail if "INFO" not in ln or "published" in ln][-40:]
    log(f"trainer {mode}: exit {rc} after {ended - started:.0f} s")
    if rc != 0:
        print("\n".join(tail[-25:]), flush=True)
    await asyncio.sleep(0.5)  # the watcher sees the last switch

    pushes = []
    new = [v for v in versions.list_versions(engine) if v["name"] not in before]
    for v in new:
        ev = publish_event(engine, v["name"])
        step = (v.get("stats") or {}).get("step")
        run_id = (v.get("stats") or {}).get("run_id")
        # the directory the trainer wrote (the version's own path is the publish's copy of it)
        cands = ([*(data / "runs" / "weights").glob(f"step-{int(step):06d}-*")] if step is not None else []) + \
            ([data / "runs" / f"run-{run_id}"] if run_id is not None and (data / "runs" / f"run-{run_id}").is_dir()
             else [])
        src = cands[0] if cands else None
        t_written = written_at(src) if src is not None else None
        seen = [s.get(v["name"]) for s in watcher.seen]
        row: dict[str, Any] = {"name": v["name"], "kind": v["kind"], "step": step,
                               "weights_dir": str(src) if src else None, "written_at": t_written,
                               **vllm_seconds(ev.get("metrics", {}))}
        if t_written is not None:
            row["active_in_pool_s"] = ev["at"] - t_written if ev.get("at") else None
            row["gateways_s"] = [s - t_written if s is not None else None for s in seen]
            row["all_serving_s"] = (max(seen) - t_written) if seen and all(s is not None for s in seen) else None
            end = (max(seen) if row["all_serving_s"] is not None else (ev.get("at") or t_written)) + 1.0
            row["failed_during"] = failed_in(load.failed_at, [(t_written, end)])
            row["requests_during"] = sum(t_written <= t <= end for t in load.started_at)
        pushes.append(row)
        log(f"  push {v['name']} step {step}: " + ", ".join(
            f"{k} {row[k]:.3f}" for k in ("active_in_pool_s", "all_serving_s", "lora_load_s", "reload_total_s")
            if isinstance(row.get(k), float)) + f", failed {row.get('failed_during')}")

    proof: dict[str, Any] = {}
    if new:
        last = new[-1]["name"]
        try:
            proof = policy_turn(gws[-1])
            proof["expected"] = last
            proof["ok"] = proof["policy_version"] == last
            if mode == "full":
                proof["vllm_label"] = labels([args.upstream])[args.upstream]
                proof["ok"] = proof["ok"] and proof["vllm_label"] == last
        except Exception as exc:  # noqa: BLE001 - reported
            proof = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        log(f"proof ({mode}): a chat on `policy` was recorded under {proof.get('policy_version')} "
            f"(last published {last}): {'OK' if proof.get('ok') else 'NOT OK'}")
    served = turns_per_version(engine, started)
    steps = train_steps(engine, started)
    if steps:
        log(f"trainer {mode}: {len(steps)} steps, s/step " + " ".join(f3(x.get("seconds")) for x in steps)
            + ", pg_loss " + " ".join(f3(x.get("pg_loss")) for x in steps))
    return {"mode": mode, "backend": args.backend, "command": " ".join(cmd[2:]), "rc": rc,
            "seconds": ended - started, "steps": steps, "pushes": pushes, "proof": proof,
            "turns_per_version": {k: n for k, n in served.items() if k in {v["name"] for v in new}},
            "turns_total_during_run": sum(served.values()),
            "requests_during_run": len(load.started_at) - requests_before,
            "failed_during_run": len(load.failed) - failed_before,
            "failures": load.failed[failed_before:failed_before + 10], "log_tail": tail[-25:]}


# ------------------------------------------------------------------------------------- main


async def main_async(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "started": datetime.now(UTC).isoformat(), "runs": [], "skipped": []}
    label = labels([args.upstream])[args.upstream]
    res["vllm_dev_mode"] = label is not None
    if "full" in args.modes and label is None:
        with httpx.Client(timeout=30, trust_env=False) as http:
            try:
                require_weight_labels(http, args.upstream)
            except WeightsError as exc:  # no dev mode: full weights cannot be reloaded
                raise SystemExit(f"{exc}. Pass --modes lora") from exc
    pool = f"sqlite:///{work / 'pool.db'}"
    upgrade(pool)
    engine = make_engine(pool)
    gws = [GatewayProcess(work / f"gw{i}", database_url=pool, upstream_url=args.upstream)
           for i in range(args.gateways)]
    try:
        for gw in gws:
            gw.start(timeout=240)
        gateways = [gw.base_url for gw in gws]
        log(f"{len(gws)} gateways up on {pool}")

        user = User(gateways, engine, args.max_tokens)
        t = time.time()
        await asyncio.to_thread(user.fill, args.fill, args.fill_parallel)
        rewards = [r for _, r, _ in user.scored]
        res["fill"] = {"interactions": args.fill, "scored": len(user.scored), "errors": user.errors[:10],
                       "seconds": time.time() - t, "reward_mean": statistics.fmean(rewards) if rewards else None,
                       "positive": sum(r > 0 for r in rewards)}
        log(f"fill: {len(user.scored)} scored turns ({res['fill']['positive']} with reward > 0) in "
            f"{res['fill']['seconds']:.1f} s; {len(user.errors)} errors {user.errors[:2]}")
        if len(user.scored) < args.batch_size:
            raise SystemExit(f"only {len(user.scored)} scored turns: not one batch of {args.batch_size}")

        load = Load(gateways, args.concurrency, args.max_tokens)
        load_task = asyncio.create_task(load.run())
        watcher = Watcher(gateways, interval=args.poll_s)
        watch_task = asyncio.create_task(watcher.run())
        live = user.live(args.live_users) if args.live_users else None
        load_started = time.time()
        await asyncio.sleep(args.warmup_s)
        log(f"load: {args.concurrency} streams on `policy` through {len(gws)} gateways, {len(load.total)} done, "
            f"{len(load.failed)} failed so far; {args.live_users} live users")
        try:
            for mode in args.modes:
                need = args.min_run_s
                if left(args) - args.reserve_s < need:
                    res["skipped"].append(f"trainer {mode}: {left(args):.0f} s left of the budget")
                    log(f"skip trainer {mode}: {left(args):.0f} s left")
                    continue
                res["runs"].append(await train_run(args, mode, pool, engine, work, watcher, load, gws))
        finally:
            load.stop.set()
            user.stop.set()
            await load_task
            watcher.stop.set()
            await watch_task
        load_s = time.time() - load_started
        res["load"] = {"concurrency": args.concurrency, "seconds": load_s,
                       "requests": len(load.total) + len(load.failed), "failed": len(load.failed),
                       "failures": load.failed[:20],
                       "ttft_p50_s": pct(load.ttft, .5), "ttft_p99_s": pct(load.ttft, .99),
                       "total_p50_s": pct(load.total, .5), "total_p99_s": pct(load.total, .99),
                       "watcher_polls": watcher.polls}
        res["live_user"] = {"scored": len(user.scored) - args.fill, "errors": len(user.errors)}
        log(f"load: {res['load']['requests']} requests in {load_s:.0f} s, {len(load.failed)} failed")
        del live

        # leave the servers as they were: the base weights, no adapters of ours
        with OrmSession(engine) as db:
            names = [(n, k) for n, k in db.execute(select(PolicyVersion.name, PolicyVersion.kind))]
        try:
            await asyncio.to_thread(activate, engine, versions.BASE, [args.upstream], timeout_s=300)
            with httpx.Client(timeout=30) as http:
                for n, k in names:
                    if k == "lora":
                        unload(http, [args.upstream], n)
            log("vLLM back on the base weights, adapters unloaded")
        except Exception as exc:  # noqa: BLE001 - reported
            log(f"could not put vLLM back on its base: {exc}")
    finally:
        for gw in gws:
            gw.stop()
        engine.dispose()

    if args.full_publishes:
        if left(args) < args.full_publish_s:
            res["skipped"].append(f"full publish under load: {left(args):.0f} s left of the budget")
            log(f"skip full publish under load: {left(args):.0f} s left")
        else:
            cmd = [sys.executable, str(ROOT / "benchmarks/gpu/publish_load.py"), "--upstream", args.upstream,
                   "--model", args.model, "--model-dir", str(args.model_dir), "--kind", "full",
                   "--publishes", str(args.full_publishes), "--concurrency", str(args.concurrency),
                   "--gateways", str(args.gateways), "--max-tokens", str(args.max_tokens), "--out", str(args.out),
                   "--pause-mode", args.pause_mode, "--transfer", args.weight_transfer]
            env = dict(os.environ)
            if args.weight_transfer == "nccl" and args.trainer_gpu is not None:  # the sender: the trainer's GPU
                env["CUDA_VISIBLE_DEVICES"] = args.trainer_gpu
            log(f"full publish under load: {' '.join(cmd[1:])}")
            t = time.time()
            done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, env=env,
                                           timeout=max(60, left(args) - 10))
            (work / "publish_load-full.log").write_text(done.stdout + done.stderr)
            out_json = args.out / ("publish_load-full-nccl.json" if args.weight_transfer == "nccl"
                                   else "publish_load-full.json")
            res["full_publish"] = {"rc": done.returncode, "seconds": time.time() - t}
            if out_json.is_file():
                full = json.loads(out_json.read_text())
                res["full_publish"].update({k: full.get(k) for k in (
                    "switch_p50_s", "switch_p99_s", "switch_max_s", "requests", "failed", "failed_during_publishes",
                    "ttft_p50_s", "ttft_p99_s")})
                res["full_publish"]["reload_s"] = [r.get("load_s") for r in full.get("rounds", [])]
            log(f"full publish under load: exit {done.returncode}: "
                + "\n".join(ln for ln in (done.stdout + done.stderr).splitlines() if not ln.startswith("INFO"))[-1500:])
    res["seconds"] = time.time() - T0
    return res


def f3(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) and not math.isnan(x) else "–"


def stats_row(values: list[float | None]) -> str:
    v = [x for x in values if isinstance(x, (int, float))]
    if not v:
        return "– | – | –"
    return f"{f3(pct(v, .5))} | {f3(pct(v, .99))} | {f3(max(v))}"


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    gpu = f"CUDA_VISIBLE_DEVICES={c['trainer_gpu']}" if c.get("trainer_gpu") is not None else "its default device"
    lines = [f"shape2: trainer backend {c['backend']} ({gpu}) → vLLM "
             f"{c['upstream']}, {c['gateways']} gateways on one SQLite pool, {c['concurrency']} concurrent streams "
             f"on `policy` ({c['max_tokens']} tokens), {c['steps']} steps × {c['batch_size']} turns per run"
             + (f", push every {c['push_every']} step(s)" if c["backend"] == "verl" else ", one publish at the end"),
             ""]
    fill = res.get("fill") or {}
    lines += [f"pool: {fill.get('scored')} turns scored by the python judge before training "
              f"({fill.get('seconds', 0):.1f} s), {(res.get('live_user') or {}).get('scored')} more during it", ""]
    lines += ["| run | pushes | what | p50 | p99 | max |", "|---|---|---|---|---|---|"]
    for run in res["runs"]:
        p = run["pushes"]
        name = f"{run['mode']} (exit {run['rc']}, {run['seconds']:.0f} s)"
        rows = [("optimizer step s (veRL: before each push)", [x.get("seconds") for x in run.get("steps", [])]),
                ("weights written → active in the pool s", [x.get("active_in_pool_s") for x in p]),
                ("weights written → every gateway serving it s", [x.get("all_serving_s") for x in p])]
        if run["mode"] == "lora":
            rows.append(("vLLM load_lora_adapter s", [x.get("lora_load_s") for x in p]))
        else:
            rows += [("vLLM pause + reload_weights + resume s", [x.get("reload_total_s") for x in p]),
                     ("of which reload_weights s", [x.get("reload_s") for x in p])]
        for k, (what, vals) in enumerate(rows):
            lines.append(f"| {name if k == 0 else ''} | {len(p) if k == 0 else ''} | {what} | {stats_row(vals)} |")
    lines.append("")
    for run in res["runs"]:
        p = run["pushes"]
        fails = sum(x.get("failed_during") or 0 for x in p)
        reqs = sum(x.get("requests_during") or 0 for x in p)
        pr = run["proof"]
        lines.append(f"- {run['mode']}: requests failed during the pushes **{fails}** (of {reqs} started in the push "
                     f"windows); during the whole run {run['failed_during_run']} of {run['requests_during_run']}. "
                     f"Proof: a chat on `policy` after the run was recorded under `{pr.get('policy_version')}`, the "
                     f"last version the trainer published `{pr.get('expected')}`"
                     + (f", vLLM's weight label `{pr.get('vllm_label')}`" if "vllm_label" in pr else "")
                     + f": **{'OK' if pr.get('ok') else 'NOT OK'}**. Load turns per trained version: "
                     + (", ".join(f"{k} {n}" for k, n in run["turns_per_version"].items()) or "none"))
    ld = res.get("load") or {}
    lines += ["", f"load: {ld.get('requests')} requests in {ld.get('seconds', 0):.0f} s, failed {ld.get('failed')}; "
                  f"time to first token p50 {f3(ld.get('ttft_p50_s'))} s, p99 {f3(ld.get('ttft_p99_s'))} s; whole "
                  f"stream p50 {f3(ld.get('total_p50_s'))} s, p99 {f3(ld.get('total_p99_s'))} s"]
    fp = res.get("full_publish")
    if fp:
        lines += ["", f"full-weight publish under load (publish_load.py --kind full, exit {fp['rc']}): checkpoint "
                      f"written → every gateway serving it p50 {f3(fp.get('switch_p50_s'))} s, p99 "
                      f"{f3(fp.get('switch_p99_s'))} s; vLLM reload per publish "
                      f"{', '.join(f3(x) for x in fp.get('reload_s') or [])} s; requests {fp.get('requests')}, "
                      f"failed {fp.get('failed')} ({fp.get('failed_during_publishes')} during publishes)"]
    if res.get("skipped"):
        lines += ["", "skipped: " + "; ".join(res["skipped"])]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="vLLM …/v1 (runtime LoRA; dev mode for --modes full)")
    p.add_argument("--model", default="smollm2", help="vLLM's served name of the base model")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--backend", choices=["verl", "local"], default="verl")
    p.add_argument("--modes", default="lora,full", type=lambda s: [m for m in s.split(",") if m])
    p.add_argument("--trainer-gpu", help="CUDA_VISIBLE_DEVICES of the trainer process (GPU: 1)")
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fill", type=int, default=64, help="scored interactions before the trainer starts")
    p.add_argument("--fill-parallel", type=int, default=16)
    p.add_argument("--live-users", type=int, default=2, help="simulated users interacting during training")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--push-every", type=int, default=1, help="verl: push (publish) every N steps")
    p.add_argument("--pause-mode", choices=["wait", "keep"], default="wait",
                   help="full weights: vLLM's pause while it reloads them (keep: the streams in flight are frozen, "
                        "not drained, and continue on the new weights)")
    p.add_argument("--weight-transfer", choices=["disk", "nccl"], default="disk",
                   help="full weights: reloaded from disk, or sent over NCCL from the trainer's GPU (`nextstate train "
                        "--weight-transfer nccl`; vLLM started with WEIGHT_TRANSFER=nccl by run.sh)")
    p.add_argument("--lr-lora", type=float, default=1e-4)
    p.add_argument("--lr-full", type=float, default=1e-5)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--poll-s", type=float, default=0.02, help="how often the watcher asks each gateway")
    p.add_argument("--run-timeout", type=float, default=200.0, help="seconds one trainer run may take")
    p.add_argument("--min-run-s", type=float, default=60.0, help="skip a trainer run with less budget left")
    p.add_argument("--full-publishes", type=int, default=5, help="publish_load.py --kind full rounds (0: off)")
    p.add_argument("--full-publish-s", type=float, default=60.0, help="skip it with less budget left")
    p.add_argument("--budget-s", type=float, default=380.0, help="this script's wall-clock budget")
    p.add_argument("--reserve-s", type=float, default=30.0, help="budget kept for cleanup and the report")
    p.add_argument("--out", type=Path, default=Path("benchmarks/gpu/results"))
    args = p.parse_args()
    bad = set(args.modes) - {"lora", "full"}
    if bad:
        p.error(f"--modes: unknown {bad}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shape2-"))
    log(f"work dir {work}")
    try:
        res = asyncio.run(main_async(args, work))
    finally:
        # the trainers' and gateways' logs, each cut to its last MiB (a gateway under load logs a lot)
        with tarfile.open(args.out / "shape2-logs.tgz", "w:gz") as tar:
            for f in sorted(work.rglob("*.log")):
                data = f.read_bytes()[-(1 << 20):]
                info = tarfile.TarInfo(str(f.relative_to(work)))
                info.size, info.mtime = len(data), int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
    (args.out / "shape2.json").write_text(json.dumps(res, indent=1, default=str))
    text = table(res)
    (args.out / "shape2.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    bad = [f"{r['mode']}: exit {r['rc']}" for r in res["runs"] if r["rc"] != 0]
    bad += [f"{r['mode']}: proof not OK" for r in res["runs"] if r["rc"] == 0 and not r["proof"].get("ok")]
    if (res.get("full_publish") or {}).get("rc", 0) != 0:
        bad.append(f"full publish under load: exit {res['full_publish']['rc']}")
    if bad:
        log("FAILED: " + "; ".join(bad) + " (trainer logs in shape2-logs.tgz)")
        sys.exit(1)


if __name__ == "__main__":
    main()
