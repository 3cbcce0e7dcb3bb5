"""Agents learn from the pool: tool-call, terminal and SWE agents trained offline on verifiable tasks.

    python -m benchmarks.agents.run --preset cpu|gpu [--suites toolcall,terminal,swe]
        [--arms outcome,integrated,integrated+opd] [--seeds N] [--iterations K]
        [--upstream http://HOST:PORT/v1] [--teacher http://HOST:PORT/v1] [--concurrency 128]
    python -m benchmarks.agents.run --calibrate [--suites ...] [--heldout 64]
    python -m benchmarks.agents.run --merge A.json B.json --tag AB   # runs of one configuration, other seeds

Per suite, arm and seed, everything is real and goes through the pool: a `nextstate gateway`
process in front of the --upstream vLLM with its own SQLite pool; the suite's agent
(examples/agents) driven by ``rollout.runner.Runner`` — the code of `nextstate rollout` —
over n samples of each training task (one GRPO group per task, at --temperature: the cpu preset 1,
the gpu preset 0.6 on terminal and 1 elsewhere), each terminal and SWE episode in its own
sandbox; every turn scored from its next state by ``scoring.score.score_turn`` (what a worker
runs); the local trainer trained on the iteration's turns by ``trainer.offline.train_offline``
(what `nextstate train` runs), the adapter published and served; then the held-out tasks
answered greedily by the new version (`nextstate rollout --eval`: mode eval, never trained
on) — its pass@1 is the curve's next point. That evaluation runs beside the next iteration's
rollouts, which sample the same version, and ends before the next version is published
(``--no-eval-overlap``: before the next rollouts start).

Arms (the reward each turn is trained on; the trainer standardizes it within the task's group):

- ``outcome``: R_t = O, the verifier's outcome (the judge abstains on every turn);
- ``integrated``: R_t = O + (1/m) Σ r_t^(i), the rule-based next-state judge's votes
  (``scoring.rules``) added to the outcome;
- ``integrated+opd``: the same reward plus hindsight OPD on the turns the judge hinted
  (objective ``combined``; teacher logprobs from --teacher);
- ``integrated-llm``: R_t = O plus the LLM judge's votes (prompt prm-v1, 3 votes, the base model
  on --teacher, else --upstream), beside the rules.

Training (``--advantage-scope``, the presets' ``iteration``): an iteration's turns are leased at
once and their advantages taken over all of them — each task's group whole: the outcome's GRPO
advantage within it plus ``--vote-weight`` times the turn's vote less the group's mean vote
(``--integrated-norm dense``) — then one optimizer step per ``--batch-size`` turns; a group whose
episodes all failed gets only its votes' bounded credit (``benchmarks/agents/advantages.py`` shows
what the per-step path, ``step``, and R_t standardized within the group, ``group``, gave instead). ``--kl-coef``, ``--warmup-steps`` and ``--max-grad-norm``
reach the trainer.

Any arm with the suffix ``@async`` (``integrated@async``) runs its iterations pipelined: iteration
k+1's rollouts run on the version serving when they start while iteration k's turns are scored,
trained on, published and evaluated (one version off-policy; each step trains on one iteration's
turns). Run beside the same arm without it, the report compares the wall-clock time each needs to
reach the same held-out pass@1 (``t_s``: seconds from the job's first rollout to each evaluation).

Before any job trains, each suite's held-out tasks are answered by the base model (point 0 of
every curve). A job first serves an untrained adapter of its own (LoRA B = 0: the base model's
outputs) so that its requests never take vLLM-CPU's base-model path, which applies another
job's adapter to base requests batched with it (vllm-project/vllm#48421).

Writes RESULTS/TAG.json — ``results``: one row per suite, arm and seed with ``pass_at_1``
[base, after 1, ...] and each iteration's numbers (episodes/min, turns sent and captured,
training steps, seconds per phase) — plus TAG.md (tables) and TAG.png (curves).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from examples.agents import swe, terminal, toolcall  # noqa: E402
from rollout import runner as ro  # noqa: E402

SUITES = {"toolcall": toolcall, "terminal": terminal, "swe": swe}
TASKS = ROOT / "examples" / "agents"
ARMS = {  # arm -> (judge, objective, teacher logprobs)
    "outcome": ("benchmarks.agents.run:abstain", "rl", False),
    "integrated": ("scoring.rules:vote", "rl", False),
    "integrated+opd": ("scoring.rules:vote", "combined", True),
    "integrated-llm": ("llm", "rl", False),  # the LLM judge (prm-v1, 3 votes) in place of the rules
}
SHORT = {"outcome": "out", "integrated": "int", "integrated+opd": "opd", "integrated-llm": "llm"}
ASYNC = "@async"  # an arm's suffix: its iterations pipelined (Job.pipelined), e.g. integrated@async


def base_arm(arm: str) -> str:
    return arm.removesuffix(ASYNC)


def is_async(arm: str) -> bool:
    return arm.endswith(ASYNC)


def short(arm: str) -> str:
    return SHORT[base_arm(arm)] + ("a" if is_async(arm) else "")
LLM_VOTES = 3
PRESETS: dict[str, dict[str, Any]] = {
    # proves the path on a shared 2-core machine in under 20 minutes
    "cpu": {"suites": "toolcall", "arms": "outcome,integrated", "seeds": 1, "iterations": 2, "tasks": 4, "n": 8,
            "heldout": 16, "concurrency": 16, "batch_size": 16, "micro_batch_size": 4, "lr": 2e-3, "jobs": 1,
            "temperature": 1.0,
            "escapes": False,
            "timeout": 900.0},  # a loaded 2-core machine took over 300 s for a 4-turn episode
    # one H100: 16 tasks x 8 samples = 128 environments at once per job
    "gpu": {"suites": "toolcall,terminal,swe", "arms": "outcome,integrated,integrated+opd", "seeds": 3,
            "iterations": 4, "tasks": 16, "n": 8, "heldout": 64, "concurrency": 128, "batch_size": 64,
            "micro_batch_size": 16, "lr": 5e-4, "jobs": 3, "timeout": 600.0, "escapes": True,
            # terminal at 0.6: 12-50 % of its groups carry signal there, 6-25 % at 1 (results/README.md)
            "temperature": "terminal=0.6,1.0"},
}
#: how the trainer takes advantages (``--advantage-scope``, ``--integrated-norm``): an iteration's turns
#: leased at once, each task's group whole; the outcome's advantage within its group, plus the votes'
#: bounded credit (dense: under "group" the votes alone, standardized, were 76 % of Σ|A| and fell on the
#: groups with no outcome signal, ``python -m benchmarks.agents.advantages``)
TRAINING = {"advantage_scope": "iteration", "integrated_norm": "dense", "vote_weight": 0.25, "kl_coef": 0.0,
            "warmup_steps": 0, "max_grad_norm": None}
for _preset in PRESETS.values():
    _preset.update(TRAINING)
# each iteration's trainer starts a fresh AdamW, whose first step moves every weight by lr (sign-like)
PRESETS["gpu"]["warmup_steps"] = 2
#: an iteration's turns leased at once under ``--advantage-scope iteration`` (more than any iteration has)
ITERATION_TURNS = 1_000_000
log = logging.getLogger("bench.agents")
_MIGRATING = threading.Lock()


def abstain(turn: dict[str, Any], next_state: dict[str, Any]) -> int:
    """The outcome-only arm's judge: no vote on any turn, so R_t = O + 0."""
    return 0


def suite_value(value: Any, suite: str) -> float:
    """A number, or per suite (``terminal=0.6,toolcall=1.0``; a bare number is every other suite's)."""
    if isinstance(value, (int, float)):
        return float(value)
    default, per = None, {}
    for part in str(value).split(","):
        name, eq, number = part.rpartition("=")
        if eq:
            per[name.strip()] = float(number)
        else:
            default = float(number)
    if suite in per:
        return per[suite]
    if default is None:
        raise ValueError(f"no value for suite {suite!r} in {value!r}")
    return default


def now_naive() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def load_split(suite: str, split: str, count: int, rng: random.Random | None = None) -> list[dict[str, Any]]:
    tasks = ro.load_tasks(TASKS / suite / f"{split}.jsonl")
    return rng.sample(tasks, count) if rng else tasks[:count]


class LearnableBatches:
    """``--task-sampling learnable``: iteration k's tasks are drawn (:meth:`Learnability.sample`) only
    when it starts, so that they follow the rollouts of iterations 1..k-1; drawn once each."""

    def __init__(self, curriculum: Any, train: list[dict[str, Any]], count: int, iterations: int,
                 rng: random.Random):
        self.curriculum, self.train, self.count, self.iterations, self.rng = curriculum, train, count, iterations, rng
        self.drawn: list[list[dict[str, Any]]] = []

    def __len__(self) -> int:
        return self.iterations

    def __getitem__(self, i: int) -> list[dict[str, Any]]:
        if not 0 <= i < self.iterations:
            raise IndexError(i)
        if i > len(self.drawn):
            raise IndexError(f"iteration {i + 1}'s tasks are drawn after iteration {i}'s")
        if i == len(self.drawn):
            self.drawn.append(self.curriculum.sample(self.train, self.count, self.rng))
        return self.drawn[i]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return (self[i] for i in range(self.iterations))


Batches = list[list[dict[str, Any]]] | LearnableBatches


class Tally:
    """Model calls the agents made against main turns the pool captured, per session."""

    def __init__(self) -> None:
        self.sent = self.captured = 0
        self.failures: Counter[str] = Counter()

    def verifier(self, module: Any) -> Any:
        def verify(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any]) -> float:
            self.sent += len(result.get("calls") or ())
            self.captured += sum(1 for t in session.get("turns") or () if t.get("turn_type") == "main")
            if result.get("failure"):
                self.failures[str(result["failure"]).split(":")[0]] += 1
            return module.verify(task, result, session)
        return verify


async def rollout(gateway_url: str, run: str, suite: str, tasks: list[dict[str, Any]], *, n: int, mode: str,
                  concurrency: int, timeout: float, workdir: Path, tally: Tally) -> ro.RunSummary:
    module = SUITES[suite]
    cfg = ro.RolloutConfig(gateway_url=gateway_url, run=run, n=n, concurrency=concurrency, timeout_s=timeout,
                           mode=mode, workdir=workdir / run)
    agent = ro.PythonAgent(f"{module.__file__}:solve", api_key=None)
    return await ro.Runner(cfg, agent, tally.verifier(module), f"examples/agents/{suite}.py:verify").run(tasks)


def examples(engine: Any, records: list[Any], kinds: dict[str, tuple[Any, Any]], chars: int = 160
             ) -> dict[str, dict[str, Any]]:
    """Per task kind, what the policy did on its first held-out task of that kind: whether it passed
    and each reply (text, or its tool calls' arguments) cut to *chars*: what a drop in one kind is."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session as OrmSession

    from datapool.browse import content_text
    from datapool.models import Turn
    from datapool.stitch_edits import replies_of

    first: dict[str, Any] = {}
    for r in sorted(records, key=lambda r: r.task_id):
        kind, level = kinds[r.task_id]
        first.setdefault(f"{kind}/L{level}", r)
    out: dict[str, dict[str, Any]] = {}
    with OrmSession(engine) as db:
        for key, r in sorted(first.items()):
            replies = []
            for t in db.scalars(select(Turn).where(Turn.session_id == r.session_id).order_by(Turn.created_at)):
                message = (replies_of(t.response) or [{}])[0]
                calls = [c.get("function", {}).get("arguments", "") for c in message.get("tool_calls") or []]
                replies.append((" | ".join(calls) if calls else content_text(message.get("content")))[:chars])
            out[key] = {"task": r.task_id, "passed": r.passed(1.0), "replies": replies}
    return out


def final_extra(suite: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--final-heldout N``: the held-out tasks after the first --heldout of the N (the generator's
    files are prefix-stable: the first --heldout are the tasks every evaluation answers)."""
    n = getattr(args, "final_heldout", None)
    return load_split(suite, "heldout", n)[args.heldout:] if n else []


def widened(first: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """One version's pass@1 over the --heldout tasks (*first*, its evaluation) and the rest of the
    --final-heldout tasks (*extra*), as one evaluation over all of them."""
    n1, n2 = first["tasks"], extra["tasks"]
    return {"tasks": n1 + n2, "pass_at_1": (first["pass_at_1"] * n1 + extra["pass_at_1"] * n2) / (n1 + n2),
            "first": {"tasks": n1, "pass_at_1": first["pass_at_1"]},
            "rest": {k: extra[k] for k in ("tasks", "pass_at_1", "by_kind", "by_version", "failed", "timed_out",
                                           "seconds")}}


def evaluate(gateway_url: str, run: str, suite: str, heldout: list[dict[str, Any]], args: argparse.Namespace,
             workdir: Path, engine: Any = None) -> dict[str, Any]:
    """Held-out pass@1: each task once, greedy (`nextstate rollout --eval`'s report); with the engine
    of the gateway's pool, also one example per task kind (:func:`examples`)."""
    tally = Tally()
    started = time.monotonic()
    summary = asyncio.run(rollout(gateway_url, run, suite, [t | {"temperature": 0.0} for t in heldout], n=1,
                                  mode="eval", concurrency=args.concurrency, timeout=args.timeout, workdir=workdir,
                                  tally=tally))
    report = summary.report()
    (workdir / f"{run}.report.json").write_text(json.dumps(report, indent=1))
    by_kind: dict[str, list[bool]] = defaultdict(list)
    kinds = {t["id"]: (t.get("kind"), t.get("level")) for t in heldout}
    for r in summary.records:
        kind, level = kinds[r.task_id]
        by_kind[f"{kind}/L{level}"].append(r.passed(1.0))
    return {"pass_at_1": sum(r.passed(1.0) for r in summary.records) / len(summary.records),
            "tasks": len(summary.records), "by_version": {v: x["pass@1"] for v, x in report["by_version"].items()},
            "by_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())},
            "failed": report["failed"], "timed_out": report["timed_out"], "sent": tally.sent,
            "captured": tally.captured, "seconds": round(time.monotonic() - started, 1)} | (
        {"examples": examples(engine, summary.records, kinds)} if engine is not None else {})


# -- one job: a suite, an arm, a seed ---------------------------------------------------------------


class Job:
    def __init__(self, args: argparse.Namespace, work: Path, suite: str, arm: str, seed: int):
        from datapool.db import make_engine, upgrade

        self.args, self.work, self.suite, self.arm, self.seed = args, work, suite, arm, seed
        self.curriculum: Any = None  # rollout.curriculum.Learnability with --task-sampling learnable
        self.pool = f"sqlite:///{work / 'pool.db'}"
        with _MIGRATING:  # alembic's command API keeps its context in module globals: one thread at a time
            upgrade(self.pool)
        self.engine = make_engine(self.pool)
        self.urls = list(dict.fromkeys([args.upstream] + ([args.teacher] if args.teacher else [])))
        self.prefix = f"a-{short(arm)}-{suite[:4]}-{seed}-{uuid.uuid4().hex[:6]}"
        self.names: list[str] = []

    def local_config(self) -> Any:
        from trainer.config import COMPUTE_DTYPES, LocalConfig

        a = self.args
        # compile off: the jobs are threads of one process, and torch.compile (dynamo) is not made
        # to compile in several threads at once; a 135M policy's steps are short without it
        return LocalConfig(model_dir=Path(a.model_dir), lr=a.lr, seed=self.seed, micro_batch_size=a.micro_batch_size,
                           compile=False, warmup_steps=getattr(a, "warmup_steps", None) or 0,
                           max_grad_norm=getattr(a, "max_grad_norm", None),
                           bf16=COMPUTE_DTYPES[getattr(a, "trainer_dtype", None) or "auto"])

    def objective(self) -> Any:
        from trainer.config import ObjectiveConfig

        return ObjectiveConfig(objective=ARMS[base_arm(self.arm)][1],
                               kl_coef=getattr(self.args, "kl_coef", None) or 0.0,
                               integrated_norm=getattr(self.args, "integrated_norm", None) or "step",
                               vote_weight=getattr(self.args, "vote_weight", None) or 0.0)

    def publish(self, directory: Path, name: str, parent: str | None, gw_url: str) -> None:
        from base.vocab import VersionKind
        from publishing.publish import PublishRequest, publish

        publish(self.engine, PublishRequest(directory, base_model=self.args.model, vllm_urls=self.urls,
                                            kind=VersionKind.LORA, name=name, parent=parent, activate=True,
                                            store=self.work / "store", actor="bench.agents"))
        self.names.append(name)
        deadline = time.monotonic() + 60
        while policy_root(gw_url) != name:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway's policy alias never switched to {name}")
            time.sleep(0.1)

    def score(self, run_prefix: str) -> dict[str, Any]:
        """Every main turn of the iteration's sessions, scored from its next state."""
        from sqlalchemy import select
        from sqlalchemy.orm import Session as OrmSession

        from datapool.models import Judgement, Turn
        from base.errors import JudgeError, JudgeRefused
        from scoring.judge import LLMJudge, PythonJudge
        from scoring.score import TeacherConfig, score_turn

        judge_path, _, teacher = ARMS[base_arm(self.arm)]
        if judge_path == "llm":  # on the teacher replica where there is one (vllm#48421, as the workers do)
            judge: Any = LLMJudge(f"hosted_vllm/{self.args.model}", prompt="prm-v1",
                                  api_base=self.args.teacher or self.args.upstream)
            votes = LLM_VOTES
        else:
            judge, votes = PythonJudge(judge_path), 1
        with OrmSession(self.engine) as db:
            ids = db.scalars(select(Turn.id).where(Turn.session_id.like(f"{run_prefix}:%"),
                                                   Turn.turn_type == "main")).all()
        cfg = TeacherConfig(self.args.teacher) if teacher else None
        statuses: Counter[str] = Counter()
        with ThreadPoolExecutor(4 if teacher else 8) as pool:
            def one(turn_id: str) -> str:
                try:
                    return score_turn(self.engine, turn_id, judge, votes, cfg)
                except (JudgeError, JudgeRefused) as exc:  # the worker would retry or dead-letter it
                    log.warning("turn %s not scored: %s", turn_id, exc)
                    return "unscored"

            for status in pool.map(one, ids):
                statuses[status] += 1
        with OrmSession(self.engine) as db:
            js = db.scalars(select(Judgement).where(Judgement.turn_id.in_(ids))).all()
            rewards = Counter(int(j.prm_reward) for j in js if j.prm_reward is not None)
            dead = sum(1 for j in js if j.status == "dead")
            hinted = sum(1 for j in js if j.teacher_logprobs)
        return {"turns": len(ids), "status": dict(statuses), "votes": {str(k): v for k, v in sorted(rewards.items())},
                "opd_samples": hinted, "dead": dead}

    def train(self, since: datetime, until: datetime | None = None) -> Any:
        from datapool.leases import Filters
        from trainer.offline import train_offline

        whole = getattr(self.args, "advantage_scope", "step") == "iteration"
        return train_offline(self.engine, objective=self.objective(), local=self.local_config(),
                             filters=Filters(since=since, until=until, modes=("offline",)),
                             batch_size=ITERATION_TURNS if whole else self.args.batch_size,
                             mini_batch_size=self.args.batch_size if whole else None,
                             epochs=1, output_root=self.work / "runs")

    def start_gateway(self) -> Any:
        """The job's `nextstate gateway`, in front of --upstream, on its own pool. It dies with the
        thread that starts it (``die_with_parent``): a job process that is killed (the OOM killer)
        leaves no gateway holding its port; the sandboxes' commands die with it too (rollout.sandbox)."""
        from tests.support.processes import GatewayProcess

        gw = GatewayProcess(self.work / "gw", database_url=self.pool, upstream_url=self.args.upstream,
                            die_with_parent=True)
        return gw.start(timeout=300)

    def run(self, base: float) -> dict[str, Any]:
        """The job's iterations; ``@async`` arms pipeline them (``pipelined``)."""
        from trainer.local import LocalTrainer

        a = self.args
        gw = self.start_gateway()
        row: dict[str, Any] = {"suite": self.suite, "arm": self.arm, "seed": self.seed, "pass_at_1": [base],
                               "t_s": [0.0], "iterations": []}
        try:
            init = LocalTrainer(self.local_config(), self.objective()).save(self.work / "init-adapter")
            self.publish(init, f"{self.prefix}-init", None, gw.url)
            rng = random.Random(self.seed)
            heldout = load_split(self.suite, "heldout", a.heldout)
            batches = self.batches(rng)
            t0 = time.monotonic()
            if is_async(self.arm):
                self.pipelined(gw.url, batches, heldout, row, t0)
            else:
                self.in_turn(gw.url, batches, heldout, row, t0)
            self.final(gw.url, row)
        finally:
            gw.stop()
            self.unload()
        return row

    def batches(self, rng: random.Random) -> Batches:
        """Each iteration's training tasks: drawn at the start (``--task-sampling uniform``), or, with
        ``learnable``, each when its iteration starts, weighted by what the job's rollouts so far
        passed (:mod:`rollout.curriculum`; :meth:`collect` updates it)."""
        a = self.args
        if getattr(a, "task_sampling", "uniform") != "learnable":
            return [load_split(self.suite, "train", a.tasks, rng) for _ in range(a.iterations)]
        from rollout.curriculum import Learnability

        self.curriculum = Learnability()
        train = ro.load_tasks(TASKS / self.suite / "train.jsonl")
        return LearnableBatches(self.curriculum, train, a.tasks, a.iterations, rng)

    def in_turn(self, gw_url: str, batches: Batches, heldout: list[dict[str, Any]],
                row: dict[str, Any], t0: float) -> None:
        """Synchronous: each iteration's rollouts run on the version the previous one published. With
        --eval-overlap (the default) version k's held-out evaluation runs beside iteration k+1's rollouts,
        which sample the same version; it ends before version k+1 is published, so every held-out
        answer comes from the version it is reported for (``heldout.by_version``)."""
        overlap = getattr(self.args, "eval_overlap", False)
        with ThreadPoolExecutor(1) as evals:
            pending: Future[None] | None = None
            for it, tasks in enumerate(batches, 1):
                if self.past_deadline(row):
                    break
                point = self.collect(gw_url, it, tasks)
                if pending is not None:
                    pending.result()
                pending = self.learn(gw_url, it, point, heldout, row, t0, evals if overlap else None)
            if pending is not None:
                pending.result()

    def pipelined(self, gw_url: str, batches: Batches, heldout: list[dict[str, Any]],
                  row: dict[str, Any], t0: float) -> None:
        """Asynchronous: iteration k+1's rollouts run, on the version serving when they start, while
        iteration k's turns are scored and trained on and the new version published and evaluated.
        Each step trains on one iteration's turns only (``since``/``until`` of its rollouts), so the
        data is at most one version behind the policy (the PPO ratio uses the captured logprobs)."""
        with ThreadPoolExecutor(1) as ahead:
            pending = ahead.submit(self.collect, gw_url, 1, batches[0])
            for it in range(1, len(batches) + 1):
                collected = pending.result()
                if it < len(batches) and not self.past_deadline(row):
                    pending = ahead.submit(self.collect, gw_url, it + 1, batches[it])
                elif it < len(batches):
                    self.learn(gw_url, it, collected, heldout, row, t0)
                    break
                self.learn(gw_url, it, collected, heldout, row, t0)

    def past_deadline(self, row: dict[str, Any]) -> bool:
        """--deadline-min passed: no further iteration starts (the row is reported as partial)."""
        deadline = getattr(self.args, "deadline", None)
        if deadline is None or time.monotonic() < deadline:
            return False
        row["partial"] = True
        log.warning("%s %s seed %d: past --deadline-min, stopping after %d iteration(s)", self.suite, self.arm,
                    self.seed, len(row["iterations"]))
        return True

    def collect(self, gw_url: str, it: int, tasks: list[dict[str, Any]]) -> dict[str, Any]:
        """One iteration's rollouts: n samples of each task, through the gateway into the pool."""
        a = self.args
        tally = Tally()
        since = now_naive()
        started = time.monotonic()
        run = f"{self.prefix}-i{it}"
        before = gateway_seconds(gw_url)
        sampled = [t | {"temperature": suite_value(a.temperature, self.suite)} for t in tasks]
        summary = asyncio.run(rollout(gw_url, run, self.suite, sampled, n=a.n, mode="offline",
                                      concurrency=a.concurrency, timeout=a.timeout, workdir=self.work, tally=tally))
        wall = time.monotonic() - started
        after = gateway_seconds(gw_url)
        calls = after[0] - before[0]
        report = summary.report()
        groups = None
        if self.curriculum is not None:
            from rollout.curriculum import group_of

            self.curriculum.update(tasks, [(r.task_id, r.passed(summary.pass_threshold)) for r in summary.records])
            drawn = Counter(group_of(t, self.curriculum.fields) for t in tasks)
            table = self.curriculum.table()
            groups = {g: {"drawn": drawn[g], "rate": table[g]["rate"]} for g in sorted(drawn)}
        return {"iteration": it, "run": run, "since": since, "until": now_naive(), "rollout_s": round(wall, 1),
                # the gateway's time per model call beyond the upstream's (its /metrics; whole replies)
                "gateway_added_ms": round((after[1] - before[1] - after[2] + before[2]) / calls * 1000, 2)
                if calls else None,
                "episodes": len(summary.records), "episodes_per_min": round(len(summary.records) / wall * 60, 1),
                "train_success": report["success_rate"], "groups_with_signal": groups_with_signal(summary),
                "sent": tally.sent, "captured": tally.captured,
                "failed": report["failed"], "timed_out": report["timed_out"],
                "sandbox_failures": dict(tally.failures)} | ({"task_groups": groups} if groups else {})

    def learn(self, gw_url: str, it: int, point: dict[str, Any], heldout: list[dict[str, Any]],
              row: dict[str, Any], t0: float, evals: ThreadPoolExecutor | None = None) -> Future[None] | None:
        """Score the iteration's turns, train on them, publish the version, evaluate it held out: here,
        or on ``evals`` (then the evaluation's future is returned)."""
        run, since, until = point.pop("run"), point.pop("since"), point.pop("until")
        started = time.monotonic()
        point["scoring"] = self.score(run)
        point["score_s"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        result = self.train(since, until)
        point |= {"train_s": round(time.monotonic() - started, 1), "steps": result.steps,
                  "trained_turns": result.turns, "loss": [round(m.get("loss", float("nan")), 4) for m in result.metrics]}
        if result.output_dir is not None:
            name = f"{self.prefix}-v{it}"
            self.publish(result.output_dir, name, result.parent, gw_url)
            # does the server serve what was trained? (trainer.agreement; on the teacher where there is
            # one: vLLM-CPU must not batch prompt_logprobs with LoRA requests)
            from trainer.agreement import check_published
            from vllm_client.http import openai_base

            point["train_serve"] = check_published(self.engine, result.trainer, name,
                                                   openai_base(self.args.teacher or self.args.upstream),
                                                   run_id=result.run_id)
            result.trainer = None  # its model is not needed any more
        if evals is not None:
            return evals.submit(self.evaluated, gw_url, run, point, heldout, row, t0, result.steps)
        self.evaluated(gw_url, run, point, heldout, row, t0, result.steps)
        return None

    def evaluated(self, gw_url: str, run: str, point: dict[str, Any], heldout: list[dict[str, Any]],
                  row: dict[str, Any], t0: float, steps: int) -> None:
        """The published version's held-out pass@1, recorded as the curve's next point."""
        it = point["iteration"]
        started = time.monotonic()
        ev = evaluate(gw_url, f"{run}-eval", self.suite, heldout, self.args, self.work, engine=self.engine)
        point |= {"heldout": ev, "eval_s": round(time.monotonic() - started, 1)}
        if len(ev["by_version"]) > 1:
            log.warning("%s %s seed %d iteration %d: held-out answers came from %s", self.suite, self.arm,
                        self.seed, it, sorted(ev["by_version"]))
        row["pass_at_1"].append(ev["pass_at_1"])
        row["t_s"].append(round(time.monotonic() - t0, 1))
        row["iterations"].append(point)
        log.info("%s %s seed %d iteration %d: held-out pass@1 %.3f at %.0f s (train success %.3f, %d steps)",
                 self.suite, self.arm, self.seed, it, ev["pass_at_1"], row["t_s"][-1], point["train_success"] or 0,
                 steps)
        (self.work / "progress.json").write_text(json.dumps(row, indent=1, default=str))

    def final(self, gw_url: str, row: dict[str, Any]) -> None:
        """``--final-heldout N``: the last published version, still serving, answers the held-out tasks
        beyond the first --heldout too; its pass@1 over all N goes in ``row["final_heldout"]``. Most of a
        64-task pass@1's spread between seeds is the evaluation's own (binomial), which N tasks shrink
        without evaluating every iteration on N."""
        extra = final_extra(self.suite, self.args)
        if not extra or not row["iterations"]:
            return
        last = row["iterations"][-1]
        started = time.monotonic()
        ev = evaluate(gw_url, f"{self.prefix}-final-eval", self.suite, extra, self.args, self.work)
        if set(ev["by_version"]) != set(last["heldout"]["by_version"]):
            log.warning("%s %s seed %d: the final held-out answers came from %s, the last evaluation's from %s",
                        self.suite, self.arm, self.seed, sorted(ev["by_version"]), sorted(last["heldout"]["by_version"]))
        row["final_heldout"] = widened(last["heldout"], ev) | {"iteration": last["iteration"],
                                                                "eval_s": round(time.monotonic() - started, 1)}
        log.info("%s %s seed %d: held-out pass@1 %.3f over %d tasks after iteration %d", self.suite, self.arm, self.seed,
                 row["final_heldout"]["pass_at_1"], row["final_heldout"]["tasks"], last["iteration"])
        (self.work / "progress.json").write_text(json.dumps(row, indent=1, default=str))

    def unload(self) -> None:
        from datapool.versions import BASE
        from publishing.publish import activate

        with contextlib.suppress(Exception):
            activate(self.engine, BASE, self.urls)
        with httpx.Client(timeout=30) as http:
            for name in self.names:
                for url in self.urls:
                    with contextlib.suppress(httpx.HTTPError):
                        http.post(f"{url}/unload_lora_adapter", json={"lora_name": name})


def gateway_seconds(gateway_url: str) -> tuple[float, float, float]:
    """The gateway's model calls answered, the seconds they took in all, and the seconds its
    upstreams took (``nextstate_request_seconds``, ``nextstate_upstream_seconds``)."""
    from prometheus_client.parser import text_string_to_metric_families

    count = total = upstream = 0.0
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nextstate_request_seconds_count":
                count += sample.value
            elif sample.name == "nextstate_request_seconds_sum":
                total += sample.value
            elif sample.name == "nextstate_upstream_seconds_sum":
                upstream += sample.value
    return count, total, upstream


def policy_root(gateway_url: str) -> str | None:
    data = httpx.get(f"{gateway_url}/v1/models", timeout=10).json()["data"]
    return next((m.get("root") for m in data if m["id"] == "policy"), None)


# -- sandbox escapes, tried while the environments run ---------------------------------------------

ESCAPES = {  # what a task's commands might do -> the limits that may stop it
    "fork_bomb": (["bash", "-c", ":(){ :|:& };: ; sleep 30"], ("processes",)),
    "fill_disk": ("for i in $(seq 64); do head -c 1000000 /dev/zero > f$i || exit 1; done", ("disk",)),
    "sleep_forever": ("sleep 1000 & setsid sleep 1001 & sleep 1002", ("timeout",)),
    "open_socket": (None, ("network",)),  # connects to a listener on the host: filled in below
    # 3 CPU seconds, or the 10 s wall clock first on a machine too busy to give it 3 s of CPU
    "spin_cpu": (["python3", "-c", "while True: pass"], ("cpu", "timeout")),
    "grab_memory": (["python3", "-c", "x = bytearray(4 * 1024 ** 3)"], ("memory",)),
}


def try_escapes(work: Path, rounds: int = 3) -> dict[str, Any]:
    """Each escape in ESCAPES, ``rounds`` times, in sandboxes of the rollouts' kind, while the
    benchmark's environments run: contained = the expected limit stopped it, no process of the
    sandbox is left, the host's listener accepted nothing."""
    import socket
    import threading

    from rollout.sandbox import Limits, Sandbox

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[Any] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                accepted.append(server.accept())

    listener = threading.Thread(target=accept, daemon=True)
    listener.start()
    escapes = dict(ESCAPES)
    escapes["open_socket"] = (["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', %d), 3)"
                               % server.getsockname()[1]], ("network",))
    limits = Limits(wall_s=10.0, cpu_s=3, memory_mb=1024, disk_mb=16, processes=48)
    out: dict[str, Any] = {}

    async def one(name: str, command: Any, expected: tuple[str, ...], k: int) -> dict[str, Any]:
        with Sandbox(work / "escapes" / f"{name}-{k}", limits) as box:
            result = await box.run(command, timeout=4 if name == "sleep_forever" else None)
        return {"violation": result.violation, "contained": bool(result.violation and
                                                                 result.violation.startswith(expected)),
                "seconds": result.seconds}

    async def all_of() -> list[tuple[str, dict[str, Any]]]:
        jobs = [(n, c, e, k) for k in range(rounds) for n, (c, e) in escapes.items()]
        done = await asyncio.gather(*(one(*j) for j in jobs))
        return [(j[0], d) for j, d in zip(jobs, done)]

    try:
        for name, result in asyncio.run(all_of()):
            out.setdefault(name, []).append(result)
    finally:
        stop.set()
        listener.join(2)
        server.close()
    return {"tries": {n: r for n, r in out.items()}, "accepted_connections": len(accepted),
            "contained": all(r["contained"] for rs in out.values() for r in rs) and not accepted}


# -- the base model, calibration --------------------------------------------------------------------


def base_rates(args: argparse.Namespace, suites: list[str], work: Path) -> dict[str, dict[str, Any]]:
    """Each suite's held-out tasks answered by the base model, through a gateway of its own."""
    from datapool.db import make_engine, upgrade
    from tests.support.processes import GatewayProcess

    pool = f"sqlite:///{work / 'base.db'}"
    upgrade(pool)
    engine = make_engine(pool)
    try:
        with GatewayProcess(work / "base-gw", database_url=pool, upstream_url=args.upstream) as gw:
            out = {}
            for suite in suites:
                heldout = load_split(suite, "heldout", args.heldout)
                out[suite] = evaluate(gw.url, f"base-{suite}-{uuid.uuid4().hex[:6]}", suite, heldout, args, work,
                                      engine=engine)
                if extra := final_extra(suite, args):
                    rest = evaluate(gw.url, f"base-{suite}-final-{uuid.uuid4().hex[:6]}", suite, extra, args, work)
                    out[suite]["final_heldout"] = widened(out[suite], rest)
                log.info("base %s: held-out pass@1 %.3f over %d tasks %s", suite, out[suite]["pass_at_1"],
                         len(heldout), out[suite]["by_kind"])
            return out
    finally:
        engine.dispose()


# -- report -----------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    points = max(len(r["pass_at_1"]) for r in rows)
    lines = ["| suite | arm | seeds | " + " | ".join(["base"] + [f"after {i}" for i in range(1, points)])
             + " | Δ (last − base) |", "|---|---|---|" + "---|" * (points + 1)]
    for suite in dict.fromkeys(r["suite"] for r in rows):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["suite"] == suite):
            rs = [r for r in rows if r["suite"] == suite and r["arm"] == arm]
            cells = []
            for i in range(points):
                vals = [r["pass_at_1"][i] for r in rs if len(r["pass_at_1"]) > i]
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                cells.append(f"{statistics.fmean(vals):.3f} ± {sd:.3f}" if vals else "–")
            delta = statistics.fmean(r["pass_at_1"][-1] - r["pass_at_1"][0] for r in rs)
            lines.append(f"| {suite} | {arm} | {len(rs)} | " + " | ".join(cells) + f" | {delta:+.3f} |")
    return "\n".join(lines)


def kind_table(rows: list[dict[str, Any]], base: dict[str, Any]) -> str:
    """Held-out pass@1 per task kind and level (mean over seeds), base then each iteration: which
    kinds training teaches and which it breaks, where the overall number moves by a task or two."""
    lines = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        base_kinds = (base.get(suite) or {}).get("by_kind") or {}
        for arm in dict.fromkeys(r["arm"] for r in rows if r["suite"] == suite):
            rs = [r for r in rows if r["suite"] == suite and r["arm"] == arm]
            points = max(len(r["iterations"]) for r in rs)
            kinds = sorted({k for r in rs for it in r["iterations"] for k in it["heldout"].get("by_kind", {})}
                           | set(base_kinds))
            if not lines:
                lines = ["| suite | arm | kind | base | " + " | ".join(str(i) for i in range(1, points + 1)) + " |",
                         "|---|---|---|---|" + "---|" * points]
            for kind in kinds:
                cells = []
                for i in range(points):
                    vals = [r["iterations"][i]["heldout"]["by_kind"][kind] for r in rs
                            if len(r["iterations"]) > i and kind in r["iterations"][i]["heldout"].get("by_kind", {})]
                    cells.append(f"{statistics.fmean(vals):.2f}" if vals else "–")
                b = base_kinds.get(kind)
                lines.append(f"| {suite} | {arm} | {kind} | {'–' if b is None else f'{b:.2f}'} | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines)


def groups_with_signal(summary: Any) -> float | None:
    """The share of training tasks (GRPO groups) whose samples did not all pass or all fail: only
    those give the outcome a non-zero advantage within the group."""
    by_task: dict[str, set[bool]] = {}
    for r in summary.records:
        if r.outcome is not None:
            by_task.setdefault(r.task_id, set()).add(r.passed(summary.pass_threshold))
    return round(sum(len(v) == 2 for v in by_task.values()) / len(by_task), 3) if by_task else None


def _agreement(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return "–"
    if "train_serve_error" in metrics:
        return "error"
    return f"{metrics['train_serve_mean_abs']:.4f} ({metrics['train_serve_max_abs']:.3f})"


def load_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| suite | arm | seed | iteration | episodes | episodes/min | sent | captured | lost | gateway added ms | "
             "rollout s | score s | train s | steps | eval s | votes −1/0/+1 | OPD samples | train success | groups with signal | "
             "train/serve mean (max) |Δ logprob| |", "|---" * 20 + "|"]
    for r in rows:
        for p in r["iterations"]:
            v = p["scoring"]["votes"]
            lines.append(f"| {r['suite']} | {r['arm']} | {r['seed']} | {p['iteration']} | {p['episodes']} | "
                         f"{p['episodes_per_min']} | {p['sent']} | {p['captured']} | {p['sent'] - p['captured']} | "
                         f"{p.get('gateway_added_ms', '–')} | "
                         f"{p['rollout_s']} | {p['score_s']} | {p['train_s']} | {p['steps']} | {p['eval_s']} | "
                         f"{v.get('-1', 0)}/{v.get('0', 0)}/{v.get('1', 0)} | {p['scoring']['opd_samples']} | "
                         f"{p.get('train_success')} | {p.get('groups_with_signal', '–')} | "
                         f"{_agreement(p.get('train_serve'))} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(dict.fromkeys(r["suite"] for r in rows))
    fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 3.8), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["suite"] == suite):
            rs = [r for r in rows if r["suite"] == suite and r["arm"] == arm]
            points = max(len(r["pass_at_1"]) for r in rs)
            vals = [[r["pass_at_1"][i] for r in rs if len(r["pass_at_1"]) > i] for i in range(points)]
            mean = [statistics.fmean(v) for v in vals]
            sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
            xs = list(range(points))
            ax.plot(xs, mean, marker="o", label=arm)
            ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], alpha=0.15)
        ax.set_title(suite)
        ax.set_xlabel("iteration (0: base model)")
        ax.set_ylabel("held-out pass@1")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
    # wrapped to the figure's width: a one-suite figure is 5 inches wide, about 60 characters at 9 pt
    fig.suptitle("\n".join(textwrap.wrap(title, 60 * len(suites))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mean_curve(rs: list[dict[str, Any]], key: str) -> list[float]:
    """The mean over seeds of ``pass_at_1`` or ``t_s`` at each point all seeds reached."""
    points = min(len(r[key]) for r in rs)
    return [statistics.fmean(r[key][i] for r in rs) for i in range(points)]


def mean_se(vals: list[float]) -> tuple[float, float]:
    """The mean of *vals* and its standard error (nan for one value)."""
    return statistics.fmean(vals), (statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) > 1 else float("nan"))


def final_se(rs: list[dict[str, Any]]) -> tuple[float, float]:
    """The mean over seeds of the last point every seed reached, and its standard error."""
    last = min(len(r["pass_at_1"]) for r in rs) - 1
    return mean_se([r["pass_at_1"][last] for r in rs])


def compare_table(rows: list[dict[str, Any]]) -> str:
    """Per suite: each arm's last held-out pass@1 (mean ± standard error over seeds), each arm
    against outcome-only in standard errors of the difference, and each ``@async`` arm's
    wall-clock time to the pass@1 both it and its synchronous twin reach, against the twin's."""
    lines = ["| suite | arm | seeds | iteration | pass@1 (mean ± SE) | gain over base | vs outcome (SE of the "
             "difference) |", "|---|---|---|---|---|---|---|"]
    speed = ["| suite | arm | target pass@1 | synchronous s | asynchronous s | speed-up |", "|---|---|---|---|---|---|"]
    for suite in dict.fromkeys(r["suite"] for r in rows):
        by_arm = {arm: [r for r in rows if r["suite"] == suite and r["arm"] == arm]
                  for arm in dict.fromkeys(r["arm"] for r in rows if r["suite"] == suite)}
        ref = final_se(by_arm["outcome"]) if "outcome" in by_arm else None
        for arm, rs in by_arm.items():
            m, se = final_se(rs)
            last = min(len(r["pass_at_1"]) for r in rs) - 1
            gain = statistics.fmean(r["pass_at_1"][last] - r["pass_at_1"][0] for r in rs)
            vs = "–"
            if ref and arm != "outcome":
                sd = (se ** 2 + ref[1] ** 2) ** 0.5
                vs = f"{m - ref[0]:+.3f} ({(m - ref[0]) / sd:+.1f} SE)" if sd > 0 else f"{m - ref[0]:+.3f}"
            lines.append(f"| {suite} | {arm} | {len(rs)} | {last} | {m:.3f} ± {se:.3f} | {gain:+.3f} | {vs} |")
            if is_async(arm) and base_arm(arm) in by_arm:
                sync_rs = by_arm[base_arm(arm)]
                curves = {k: (mean_curve(v, "pass_at_1"), mean_curve(v, "t_s"))
                          for k, v in (("sync", sync_rs), ("async", rs)) if all("t_s" in r for r in v)}
                if len(curves) == 2:
                    target = min(max(c[0][1:] or [0.0]) for c in curves.values())
                    reach = {k: next((t for p, t in zip(c[0][1:], c[1][1:]) if p >= target), None)
                             for k, c in curves.items()}
                    ratio = f"{reach['sync'] / reach['async']:.2f}×" if reach["sync"] and reach["async"] else "–"
                    speed.append(f"| {suite} | {base_arm(arm)} | {target:.3f} | {reach['sync']} | {reach['async']} "
                                 f"| {ratio} |")
    return "\n".join(lines + ([""] + speed if len(speed) > 2 else []))


def final_bases(base: dict[str, Any]) -> str:
    return ", ".join(f"{suite} {b['final_heldout']['pass_at_1']:.3f} over {b['final_heldout']['tasks']}"
                     for suite, b in base.items() if b.get("final_heldout")) or "not measured"


def final_table(rows: list[dict[str, Any]], base: dict[str, Any]) -> str:
    """``--final-heldout``: per suite, each arm's last version over all N held-out tasks (mean ± SE over
    the seeds that have it), its gain over the base's on the same N, and each arm against outcome-only:
    the difference in SE unpaired and paired by seed (the seeds both arms have; one seed's arms
    trained from the same task draws). Empty when no row has it."""
    have = [r for r in rows if r.get("final_heldout")]
    if not have:
        return ""
    lines = ["| suite | arm | seeds | tasks | iteration | pass@1 (mean ± SE) | gain over base | vs outcome, unpaired "
             "| vs outcome, paired by seed |", "|---|---|---|---|---|---|---|---|---|"]
    for suite in dict.fromkeys(r["suite"] for r in have):
        by_arm = {arm: {r["seed"]: r["final_heldout"] for r in have if r["suite"] == suite and r["arm"] == arm}
                  for arm in dict.fromkeys(r["arm"] for r in have if r["suite"] == suite)}
        b = (base.get(suite) or {}).get("final_heldout", {}).get("pass_at_1")
        ref = by_arm.get("outcome")
        for arm, seeds in by_arm.items():
            m, se = mean_se([f["pass_at_1"] for f in seeds.values()])
            tasks = "/".join(str(t) for t in sorted({f["tasks"] for f in seeds.values()}))
            its = "/".join(str(t) for t in sorted({f["iteration"] for f in seeds.values()}))
            unpaired = paired = "–"
            if ref and arm != "outcome":
                rm, rse = mean_se([f["pass_at_1"] for f in ref.values()])
                sd = (se ** 2 + rse ** 2) ** 0.5
                unpaired = f"{m - rm:+.3f} ({(m - rm) / sd:+.1f} SE)" if sd > 0 else f"{m - rm:+.3f}"
                both = sorted(set(seeds) & set(ref))
                if len(both) > 1:
                    dm, dse = mean_se([seeds[k]["pass_at_1"] - ref[k]["pass_at_1"] for k in both])
                    paired = (f"{dm:+.3f} ({dm / dse:+.1f} SE, {len(both)} seeds)" if dse > 0 else f"{dm:+.3f}")
            gain = f"{m - b:+.3f}" if b is not None else "–"
            lines.append(f"| {suite} | {arm} | {len(seeds)} | {tasks} | {its} | {m:.3f} ± {se:.3f} | {gain} | {unpaired} "
                         f"| {paired} |")
    return "\n".join(lines)


def write(args: argparse.Namespace, rows: list[dict[str, Any]], base: dict[str, Any], minutes: float,
          failed: list[str], escapes: dict[str, Any] | None = None, runs: dict[str, Any] | None = None) -> None:
    """The report: TAG.md (tables), TAG.json (config, base, rows, escapes; *runs*: what :func:`merge`
    adds to the config) and TAG.png."""
    title = (f"SmolLM2-135M-Instruct, {args.iterations} iterations x {args.tasks} tasks x n={args.n}, "
             f"{args.heldout} held-out (greedy), {args.seeds} seed(s)")
    text = (f"{title} ({minutes:.1f} min)\n\nHeld-out pass@1 (mean ± std over seeds):\n\n"
            + (table(rows) if rows else "no results") + "\n\nLast point, and time to the same pass@1:\n\n"
            + (compare_table(rows) if rows else "")
            + (f"\n\nThe last version over every --final-heldout task (base {final_bases(base)}):\n\n{final}"
               if (final := final_table(rows, base)) else "")
            + ("\n\nHeld-out pass@1 by task kind (mean over seeds):\n\n" + kind_table(rows, base) if rows else "")
            + "\n\nPer iteration:\n\n" + (load_table(rows) if rows else "")
            + ("\n\nFailed jobs: " + ", ".join(failed) if failed else "")
            + (f"\n\nSandbox escapes tried beside the environments: {escape_line(escapes)}" if escapes else ""))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "merge"}
    extra = {"minutes": round(minutes, 1), "failed": failed, "command": command(), "machine": machine()}
    # the files first: a closed stdout (the `| tee` of a stopped run, killed with it) must not lose the run
    (args.out / f"{args.tag}.json").write_text(json.dumps(
        {"config": config | extra | (runs or {}),
         "base": base, "results": rows, "escapes": escapes or {}}, indent=1, default=str))
    (args.out / f"{args.tag}.md").write_text(f"`{command()}`\n\n{text}\n")
    print("\n" + text)
    if rows:
        plot(rows, args.out / f"{args.tag}.png", title)
    print(f"\nwrote {args.out / args.tag}.json, .md" + (", .png" if rows else ""))


def escape_line(escapes: dict[str, Any]) -> str:
    if "error" in escapes:
        return f"not tried: {escapes['error']}"
    tries = "; ".join(f"{n} {sum(r['contained'] for r in rs)}/{len(rs)} ({rs[0]['violation']})"
                      for n, rs in escapes["tries"].items())
    return (f"{'all contained' if escapes['contained'] else 'NOT ALL CONTAINED'}: {tries}; "
            f"{escapes['accepted_connections']} connection(s) reached the host's listener")


def command() -> str:
    return "python -m benchmarks.agents.run " + " ".join(sys.argv[1:])


def machine() -> str:
    """Where the run ran: architecture, CPUs and GPUs (as torch sees them)."""
    import platform

    text = f"{platform.machine()}, {os.cpu_count()} CPUs"
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            text += f", {n} x {torch.cuda.get_device_name(0)}" if n > 1 else f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return text


class MergeError(ValueError):
    """Runs that cannot be merged into one report."""


#: what makes two runs the same experiment: a difference in any of these refuses the merge
SAME_CONFIG = ("preset", "suites", "arms", "iterations", "tasks", "n", "heldout", "batch_size", "micro_batch_size",
               "lr", "timeout", "temperature", "advantage_scope", "integrated_norm", "vote_weight", "kl_coef",
               "warmup_steps", "max_grad_norm", "trainer_dtype", "eval_overlap", "model", "server_dtype",
               "task_sampling")
#: what a run made before the key was recorded ran with (it counts as that, not as differing)
CONFIG_DEFAULTS = {"task_sampling": "uniform"}


def merge_runs(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Runs of one configuration made apart (*runs*: name and results JSON each) as one: their rows
    (a suite/arm/seed once: whole over partial; in two whole runs it is refused, since one seed's
    second run is no new sample), the base and escapes of each, and under ``runs`` each run's
    command, machine, minutes and seeds. Raises :class:`MergeError` for a configuration that
    differs in a :data:`SAME_CONFIG` key (a key a run does not record counts as differing
    from one that does: an older run without ``server_dtype`` merges only with its like)."""
    if len(runs) < 2:
        raise MergeError("give two or more results JSONs")
    first_name, first = runs[0]
    for name, data in runs[1:]:
        for key in SAME_CONFIG:
            a = first["config"].get(key, CONFIG_DEFAULTS.get(key))
            b = data["config"].get(key, CONFIG_DEFAULTS.get(key))
            if a != b:
                raise MergeError(f"{name} is another configuration than {first_name}: {key} {b!r} != {a!r}")
        for suite in data["base"]:
            if suite not in first["base"]:
                raise MergeError(f"{name} has suite {suite!r}, {first_name} does not")
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    source: dict[tuple[str, str, int], str] = {}
    for name, data in runs:
        for row in data["results"]:
            key = (row["suite"], row["arm"], row["seed"])
            seen = rows.get(key)
            if seen is not None and not seen.get("partial") and not row.get("partial"):
                raise MergeError(f"{'/'.join(map(str, key))} is in both {source[key]} and {name}: "
                                 "run the second session's seeds with --first-seed")
            if seen is None or (seen.get("partial") and not row.get("partial")):
                rows[key], source[key] = row, name
    arm_order = {arm: i for i, arm in enumerate(str(first["config"].get("arms") or "").split(","))}
    tries: dict[str, list[Any]] = defaultdict(list)
    escapes = [d.get("escapes") or {} for _, d in runs]
    for e in escapes:
        for kind, rs in (e.get("tries") or {}).items():
            tries[kind] += rs
    merged_escapes = ({"tries": dict(tries), "accepted_connections": sum(e.get("accepted_connections", 0)
                                                                           for e in escapes),
                       "contained": all(e.get("contained") for e in escapes if "tries" in e)} if tries else {})
    base = {suite: dict(b) for suite, b in first["base"].items()}
    for _, data in runs:  # the base over every --final-heldout task: from the first run that measured it
        for suite, b in data["base"].items():
            if b.get("final_heldout") and not base.get(suite, {}).get("final_heldout"):
                base.setdefault(suite, {})["final_heldout"] = b["final_heldout"]
    return {
        "rows": sorted(rows.values(), key=lambda r: (r["suite"], arm_order.get(r["arm"], len(arm_order)), r["seed"])),
        "base": base,
        "escapes": merged_escapes,
        "failed": [f for _, d in runs for f in d["config"].get("failed") or []],
        "minutes": sum(d["config"].get("minutes") or 0.0 for _, d in runs),
        "runs": [{"file": name, "command": d["config"].get("command"), "machine": d["config"].get("machine"),
                  "minutes": d["config"].get("minutes"), "seeds": sorted({r["seed"] for r in d["results"]}),
                  "base": {s: b.get("pass_at_1") for s, b in d["base"].items()}} for name, d in runs],
    }


def merge(args: argparse.Namespace) -> None:
    """``--merge``: :func:`merge_runs` of the JSONs given, written as TAG under --out."""
    if not args.tag:
        raise MergeError("name the merged report: --tag")
    runs = []
    for path in args.merge:
        try:
            runs.append((path.name, json.loads(path.read_text())))
        except (OSError, ValueError) as exc:
            raise MergeError(f"{path}: {exc}") from exc
    merged = merge_runs(runs)
    for key in SAME_CONFIG:  # the runs' own configuration, which they share
        setattr(args, key, runs[0][1]["config"].get(key, CONFIG_DEFAULTS.get(key)))
    args.seeds = len({r["seed"] for r in merged["rows"]})
    args.out.mkdir(parents=True, exist_ok=True)
    write(args, merged["rows"], merged["base"], merged["minutes"], merged["failed"], merged["escapes"],
          runs={"runs": merged["runs"]})


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--suites", help=f"comma-separated, of {', '.join(SUITES)} (default: the preset's)")
    p.add_argument("--arms", help=f"comma-separated, of {', '.join(ARMS)} (default: the preset's)")
    p.add_argument("--seeds", type=int)
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed: the jobs run seeds FIRST .. FIRST+SEEDS-1 (a later session's seeds, to be "
                        "merged with --merge)")
    p.add_argument("--iterations", type=int, help="rollout -> score -> train -> publish -> evaluate, this many times")
    p.add_argument("--tasks", type=int, help="training tasks per iteration (each n times: one GRPO group)")
    p.add_argument("--n", type=int, help="samples per training task")
    p.add_argument("--heldout", type=int, help="held-out tasks per evaluation")
    p.add_argument("--final-heldout", type=int, metavar="N",
                   help="the base and each job's last version also answer held-out tasks --heldout+1 .. N, and the "
                        "report compares the arms over all N (a 64-task pass@1's spread between seeds is mostly the "
                        "evaluation's own); the curves stay on the first --heldout")
    p.add_argument("--concurrency", type=int, help="rollouts (environments) running at once per job")
    p.add_argument("--jobs", type=int, help="suite/arm/seed jobs at once")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--timeout", type=float, help="seconds per rollout")
    p.add_argument("--temperature",
                   help="sampling temperature of the training rollouts (held-out evaluation is greedy): a number, "
                        "or per suite, e.g. terminal=0.6,toolcall=1.0 (a bare number: the other suites')")
    p.add_argument("--advantage-scope", choices=("iteration", "step"),
                   help="iteration: every turn of an iteration is leased at once and its advantages taken over all "
                        "of it (each task's GRPO group whole), then one optimizer step per --batch-size turns; "
                        "step: each step's --batch-size turns alone, in the pool's order, which cuts groups "
                        "(default: the preset's, iteration)")
    p.add_argument("--integrated-norm", choices=("dense", "group", "step"),
                   help="dense: A = the outcome's GRPO advantage in the task's group + --vote-weight x (the turn's "
                        "vote - the group's mean vote), so a group that all failed gets only its votes' bounded "
                        "credit; group: R_t = O + votes of a grouped turn standardized within its task's group (a "
                        "group that all failed is then trained on its votes alone); step: first standardized per "
                        "step index across the batch (trainer.config.ObjectiveConfig.integrated_norm; default: the "
                        "preset's, dense)")
    p.add_argument("--vote-weight", type=float,
                   help="the votes' weight under --integrated-norm dense (default: the preset's, 0.25)")
    p.add_argument("--task-sampling", choices=("uniform", "learnable"), default="uniform",
                   help="each iteration's training tasks: uniform (drawn up front), or learnable: weighted by "
                        "p(1-p) of their kind/level's pass rate in the job's rollouts so far, so that fewer groups "
                        "all pass or all fail (rollout/curriculum.py; the per-iteration task_groups in the JSON)")
    p.add_argument("--kl-coef", type=float, help="coefficient of the k3 KL to the base policy (0: none)")
    p.add_argument("--warmup-steps", type=int,
                   help="each iteration's optimizer steps warm the learning rate up over this many (0: none)")
    p.add_argument("--max-grad-norm", type=float, help="clip each step's gradient to this global norm")
    p.add_argument("--trainer-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the trainer's compute dtype (LoRA masters stay fp32; auto: bf16 on a GPU that has it, fp32 "
                        "on the CPU). fp32 leaves the train/serve gap to the server's bf16 alone")
    p.add_argument("--eval-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate version k held out while iteration k+1's rollouts (on the same version) run; "
                        "--no-eval-overlap evaluates before the next rollouts start")
    p.add_argument("--deadline-min", type=float,
                   help="minutes after which no job starts another iteration; the report then covers the "
                        "iterations done (rows marked partial): for a machine lent for a limited time")
    p.add_argument("--escapes", action=argparse.BooleanOptionalAction,
                   help="try sandbox escapes (fork bomb, full disk, endless sleep, a socket to the host, CPU, "
                        "memory) beside the running environments and report whether each was contained "
                        "(default: the preset's)")
    p.add_argument("--escapes-after", type=float, default=30.0, help="seconds into the run to try them")
    p.add_argument("--upstream", default=os.environ.get("NEXTSTATE_BENCH_VLLM_URL"),
                   help="the policy vLLM (…/v1) serving --model with runtime LoRA loading (default: "
                        "$NEXTSTATE_BENCH_VLLM_URL, else a vLLM-CPU started for the run)")
    p.add_argument("--teacher", default=os.environ.get("NEXTSTATE_BENCH_TEACHER_URL"),
                   help="the teacher vLLM (…/v1) for integrated+opd (default: $NEXTSTATE_BENCH_TEACHER_URL, else "
                        "one started for the run when that arm runs; on a GPU the policy server can be both)")
    p.add_argument("--model", default="smollm2", help="served name of the base model")
    p.add_argument("--model-dir", help="the base model's directory (default: the converted SmolLM2)")
    p.add_argument("--calibrate", action="store_true", help="only measure the base model's held-out pass@1")
    p.add_argument("--server-dtype", default=os.environ.get("NEXTSTATE_BENCH_SERVER_DTYPE"),
                   help="the policy server's --dtype, recorded in the results (benchmarks/gpu/run.sh passes it): runs "
                        "served in another dtype are another configuration for --merge")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="no run: one report (TAG.json, .md, .png) from the results of runs of the same configuration "
                        "made apart (other seeds: --first-seed), each run's command and machine kept under "
                        "config.runs; a configuration that differs, or a suite/arm/seed found in two runs, is refused")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", help="file name of the results (default: PRESET, or calibration)")
    args = p.parse_args()
    if args.merge:
        try:
            merge(args)
        except MergeError as exc:
            p.error(f"--merge: {exc}")
        return
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.tag = args.tag or ("calibration" if args.calibrate else args.preset)
    if args.final_heldout is not None:
        for suite in args.suites.split(","):
            have = len(ro.load_tasks(TASKS / suite / "heldout.jsonl")) if suite in SUITES else 0
            if not args.heldout < args.final_heldout <= have:
                p.error(f"--final-heldout: between --heldout ({args.heldout}) and {suite}'s {have} held-out tasks, "
                        f"not {args.final_heldout}")
    if args.integrated_norm == "dense" and args.advantage_scope != "iteration":
        p.error("--integrated-norm dense takes an iteration's advantages at once: use --advantage-scope iteration")
    for s in args.suites.split(","):
        try:
            suite_value(args.temperature, s)
        except ValueError as exc:
            p.error(f"--temperature: {exc}")
    suites, arms = args.suites.split(","), args.arms.split(",")
    for s in suites:
        if s not in SUITES:
            p.error(f"--suites: unknown suite {s!r} (known: {', '.join(SUITES)})")
    for a in arms:
        if base_arm(a) not in ARMS:
            p.error(f"--arms: unknown arm {a!r} (known: {', '.join(ARMS)}, each optionally with {ASYNC})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "httpx2", "LiteLLM", "nextstate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    with contextlib.ExitStack() as servers:
        need_teacher = any(ARMS[base_arm(a)][2] for a in arms) and not args.calibrate
        if not args.upstream or (need_teacher and not args.teacher) or not args.model_dir:
            from base.settings import Settings
            from nextstate.modelserver import TEACHER_ARGS, VLLMServer, ensure_model, ensure_vllm_env

            cache = Settings().cache_dir
            python = ensure_vllm_env(cache)
            args.model_dir = args.model_dir or str(ensure_model(cache, python))
            for key, extra, needed in (("upstream", (), True), ("teacher", TEACHER_ARGS, need_teacher)):
                if needed and not getattr(args, key):
                    log.info("starting a vLLM-CPU server for --%s (log: %s)", key, work / f"vllm-{key}.log")
                    server = servers.enter_context(VLLMServer(python, Path(args.model_dir), served_name=args.model,
                                                              port=0, log_path=work / f"vllm-{key}.log",
                                                              extra_args=extra))
                    setattr(args, key, server.base_url)
        run(args, suites, arms, work)


def job_process_init(threads: int | None, parent: int | None = None) -> None:
    """A job's process (spawned: nothing of the parent's threads or CUDA state): logging as the
    parent's, on a CPU its share of the cores, and SIGTERM when *parent* (the benchmark's process)
    dies — the job then stops its gateway and sandboxes as on any exit."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "httpx2", "LiteLLM", "nextstate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if parent is not None:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it died before the prctl: no signal will come
            os._exit(143)
    if threads:
        import torch

        torch.set_num_threads(threads)


def job_process(threads: int | None) -> ProcessPoolExecutor:
    """The process one job runs in (a pool of one, spawned, submitted to once). The job's gateway
    and sandboxes die with it, so a job process that is killed leaves none of them behind."""
    import multiprocessing

    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=job_process_init,
                               initargs=(threads, os.getpid()))


def run_job(args: argparse.Namespace, d: Path, suite: str, arm: str, seed: int, base: float) -> dict[str, Any]:
    """One job in its own process: its gateway, rollouts (event loops, sandboxes) and trainer
    share nothing with the other jobs' — model loading, alembic's migrations and forking
    sandboxes from a process with many threads are each unsafe across threads. Its sandboxes go
    under :func:`job_sandboxes` (see :func:`clean_job`)."""
    os.environ["NEXTSTATE_SANDBOX_ROOT"] = str(job_sandboxes(d))
    return Job(args, d, suite, arm, seed).run(base)


def job_sandboxes(d: Path) -> Path:
    """Where the sandboxes of the job working in *d* go: a directory of its own among the other
    rollouts' (whose parents the sandboxes' users can pass through, unlike a private work dir)."""
    return terminal.sandbox_root() / f"job-{d.parent.name}-{d.name}"


def clean_job(d: Path) -> list[str]:
    """After a job's process ended: unmount what its sandboxes left mounted and remove their
    directory. A job that was killed could not close them: its processes die with it
    (:func:`job_process`), its tmpfs mounts would not."""
    from rollout.sandbox import unmount_under

    root = job_sandboxes(d)
    left = unmount_under(root)
    if left:
        log.warning("unmounted %d sandbox mount(s) that job %s left behind", len(left), d.name)
    shutil.rmtree(root, ignore_errors=True)
    return left


def run(args: argparse.Namespace, suites: list[str], arms: list[str], work: Path) -> None:
    import torch

    t0 = time.monotonic()
    args.deadline = t0 + args.deadline_min * 60 if getattr(args, "deadline_min", None) else None
    base = base_rates(args, suites, work)
    if args.calibrate:
        print(json.dumps({s: {k: v for k, v in b.items() if k in ("pass_at_1", "by_kind", "sent", "captured")}
                          for s, b in base.items()}, indent=1))
        (args.out / f"{args.tag}.json").write_text(json.dumps(
            {"command": command(), "heldout": args.heldout, "minutes": round((time.monotonic() - t0) / 60, 1),
             "base": base}, indent=1))
        return
    threads = None if torch.cuda.is_available() else max(1, (os.cpu_count() or 1) // args.jobs)
    jobs = [(s, a, seed) for seed in range(args.first_seed, args.first_seed + args.seeds) for s in suites for a in arms]
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    stopped: list[str] = []

    stopping = threading.Event()  # SIGTERM or Ctrl-C: no job starts, the running ones are stopped
    pids: dict[str, int] = {}

    def one(job: tuple[str, str, int]) -> None:
        suite, arm, seed = job
        if stopping.is_set():
            return
        d = work / f"{suite}-{short(arm)}-{seed}"
        d.mkdir(parents=True)
        try:  # a process per job: one that dies (the OOM killer) takes no other job with it
            with job_process(threads) as proc:
                pids[d.name] = proc.submit(os.getpid).result()
                if stopping.is_set():  # stopped while its process started: the stop did not see its pid
                    raise SystemExit(143)
                rows.append(proc.submit(run_job, args, d, suite, arm, seed, base[suite]["pass_at_1"]).result())
        except BaseException:  # the job's process died, or was stopped (its SIGTERM comes back as SystemExit)
            if not stopping.is_set():
                log.exception("job %s %s seed %d failed (work dir %s)", suite, arm, seed, d)
            (stopped if stopping.is_set() else failed).append(f"{suite}/{arm}/{seed}")
            with contextlib.suppress(OSError, ValueError):
                partial = json.loads((d / "progress.json").read_text())
                rows.append(partial | {"partial": True})
        finally:
            pids.pop(d.name, None)
            clean_job(d)

    escapes: dict[str, Any] = {}

    def escape_while_running() -> None:  # once the first jobs' environments are running
        if stopping.wait(args.escapes_after):
            return
        try:
            escapes.update(try_escapes(work))
            log.info("sandbox escapes tried beside the environments: contained %s", escapes["contained"])
        except Exception as exc:  # reported, never the benchmark's end
            log.exception("sandbox escapes not tried")
            escapes["error"] = repr(exc)

    interrupted: BaseException | None = None
    with ThreadPoolExecutor(args.jobs + 1) as pool:  # a thread waits on each job's process
        if args.escapes:
            pool.submit(escape_while_running)
        try:
            list(pool.map(one, jobs))
        except (SystemExit, KeyboardInterrupt) as exc:  # SIGTERM (a lease that ends) or Ctrl-C: report what ran
            interrupted = exc
            stopping.set()
            log.warning("interrupted: stopping %d running job(s); their checkpoints so far go in the report",
                        len(pids))
            for pid in list(pids.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
    order = {(s, a, seed): i for i, (s, a, seed) in enumerate(jobs)}
    rows.sort(key=lambda r: order[(r["suite"], r["arm"], r["seed"])])
    write(args, rows, base, (time.monotonic() - t0) / 60, failed, escapes,
          {"stopped": stopped, "interrupted": type(interrupted).__name__} if interrupted else None)
    if interrupted is not None:
        raise interrupted
    if failed:
        sys.exit(f"{len(failed)} job(s) failed: {', '.join(failed)} (work dir {work})")


if __name__ == "__main__":
    main()
