"""Scoring throughput of the judge pipeline, and the load a busy judge adds to the gateway.

    python benchmarks/judge.py --upstream http://127.0.0.1:8411/v1 \\
        --teacher http://127.0.0.1:8412/v1 [--turns 12] [--votes 3]

Run it from the repository root's virtualenv; everything is real (gateway and worker processes,
vLLM, SQLite pool, kombu's SQLAlchemy broker on a SQLite file), in a temporary directory.

1. Scoring throughput. A gateway in front of --upstream (with no worker yet) captures N
   two-turn conversations made with the `openai` client; turn 2's user message is turn 1's
   next state, so turn 1 of each becomes a pending judgement (turn 2 gets none: nothing
   follows it). The replies alternate between thanks and corrections ("No, you should ..."),
   so some judgements get a hint and the hinted ones need teacher logprobs. Once the pool
   holds N pending judgements, a worker starts (default concurrency) and the clock runs from
   its `ready.` log line until every judgement is final (scored / tie / unparsable / dead)
   and every hinted one has its teacher logprobs (polled every --poll seconds through the
   admin API). Done once with the LLM judge (m votes each from --upstream, guided JSON) and
   once with the deterministic python judge `tests.support.judges:verdict`, whose row is the
   pipeline's own cost (broker, pool, aggregation, teacher logprobs) without LLM votes.
   "task s" is the mean run time of a scoring task as Celery logs it.

2. Added load on the gateway. A fresh gateway captures a backlog of --backlog conversations
   (default 2N), again with no worker. A probe is one short chat request to the gateway
   (max_tokens=1, greedy, non-streaming, plain httpx), timed to the last byte. Probes run in
   alternating blocks: idle (no worker: first before the worker exists, later with the
   worker's process group SIGSTOPped and both vLLM servers quiet, i.e. no prompt or generated
   token counted in their /metrics for 1.5 s) and busy (the worker running and scoring the
   backlog; a block starts once the policy vLLM is processing tokens again). A busy block that
   ends with the backlog all scored is discarded, since part of it may have been idle. The
   judge never calls the gateway: what it adds is contention for the CPUs, for the policy
   vLLM it votes with, and for the SQLite pool.

Both vLLM servers and this machine may serve others at the same time; the interleaving is
there so that each pair of rows sees the same machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from base.settings import Settings  # noqa: E402
from tests.support.processes import GatewayProcess, WorkerProcess, wait_for  # noqa: E402

FINAL = frozenset({"scored", "tie", "unparsable", "dead"})
PYTHON_JUDGE = "tests.support.judges:verdict"

# (question, correction); a conversation's user reply is either a thanks or the correction.
# Keep the number of questions odd (see converse).
QUESTIONS: list[tuple[str, str]] = [
    ("What is the capital of France?", "No, you should answer with just the city name: Paris."),
    ("How many legs does a spider have?", "No, you should give the number first: eight legs."),
    ("Name a prime number greater than 10.", "No, you should give one number only, such as 11."),
    ("What colour is the sky on a clear day?", "No, you should say blue, in one word."),
    ("How many metres are in 3 kilometres?", "No, you should answer 3000 metres without explanation."),
    ("Who wrote Romeo and Juliet?", "No, you should just say William Shakespeare."),
    ("What is 12 times 12?", "No, you should answer 144 and nothing else."),
]
THANKS = ["Thanks, that's right.", "Thank you, perfect.", "Great, thanks!"]

_TASK_RUNTIME = re.compile(rb"Task nextstate\.score_turn\[[^\]]+\] succeeded in ([0-9.]+)s")


@dataclass(frozen=True)
class Config:
    upstream: str
    teacher: str
    model: str
    turns: int
    votes: int
    concurrency: int | None
    backlog: int
    samples: int
    blocks: int
    poll_s: float

    @property
    def effective_concurrency(self) -> int:
        default = Settings.model_fields["worker_concurrency"].default
        return self.concurrency if self.concurrency is not None else int(default)


def judge_env(cfg: Config, backend: str, broker: str) -> dict[str, str]:
    """The environment gateway and worker share: judge, teacher, broker."""
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "NEXTSTATE_JUDGE_BACKEND": backend,
        "NEXTSTATE_TEACHER_URL": cfg.teacher,
        "NEXTSTATE_JUDGE_VOTES": str(cfg.votes),
        "NEXTSTATE_BROKER_URL": broker,
    }
    if backend == "llm":
        env |= {"NEXTSTATE_JUDGE_MODEL": f"hosted_vllm/{cfg.model}", "NEXTSTATE_JUDGE_API_BASE": cfg.upstream}
    else:
        env["NEXTSTATE_JUDGE_PYTHON"] = PYTHON_JUDGE
    if cfg.concurrency is not None:
        env["NEXTSTATE_WORKER_CONCURRENCY"] = str(cfg.concurrency)
    return env


@dataclass
class Stack:
    """One gateway (and later one worker) sharing a pool and a broker in their own directory."""

    cfg: Config
    backend: str
    data_dir: Path
    gateway: GatewayProcess
    worker: WorkerProcess
    admin: httpx.Client

    def judgements(self) -> dict[str, str]:
        """turn id -> judgement status, for every judgement in the pool."""
        rows = self._get("/api/judgements", params={"limit": 1000})["data"]
        return {r["turn_id"]: r["status"] for r in rows}

    def turn(self, turn_id: str) -> dict[str, Any]:
        return self._get(f"/api/turns/{turn_id}")

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        for attempt in range(5):  # the pool is SQLite: a read can meet a writer's lock (503)
            r = self.admin.get(f"{self.gateway.url}{path}", params=params)
            if r.status_code != 503:
                r.raise_for_status()
                return r.json()
            time.sleep(0.2 * (attempt + 1))
        r.raise_for_status()
        return None


@contextmanager
def stack(cfg: Config, backend: str, root: Path, name: str) -> Iterator[Stack]:
    data_dir = root / name
    data_dir.mkdir(parents=True)
    env = judge_env(cfg, backend, f"sqla+sqlite:///{data_dir / 'broker.sqlite'}")
    pool = f"sqlite:///{data_dir / 'pool.db'}"
    gateway = GatewayProcess(data_dir, database_url=pool, upstream_url=cfg.upstream, env=env)
    worker = WorkerProcess(data_dir, database_url=pool, broker_url=env["NEXTSTATE_BROKER_URL"], env=env)
    gateway.start()
    try:
        with httpx.Client(timeout=60) as admin:
            yield Stack(cfg, backend, data_dir, gateway, worker, admin)
    finally:
        resume(worker)  # a stopped process group would not act on SIGTERM
        worker.stop()
        gateway.stop()


def converse(base_url: str, model: str, index: int) -> str:
    """One two-turn conversation; returns turn 1's id (its next state is the user's reply)."""
    question, correction = QUESTIONS[index % len(QUESTIONS)]
    corrects = index % 2 == 1  # half the replies; len(QUESTIONS) is odd, so each question gets both kinds
    reply = correction if corrects else THANKS[index % len(THANKS)]
    chat = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "system", "content": f"Be brief. (conversation {uuid.uuid4().hex[:8]})"},
                           {"role": "user", "content": question}]
    raw = chat.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=32,
                                                         temperature=0)
    messages += [raw.parse().choices[0].message, {"role": "user", "content": reply}]
    chat.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    return raw.headers["x-turn-id"]


def create_backlog(s: Stack, count: int) -> list[str]:
    """Capture `count` conversations and wait until each first turn is a pending judgement."""
    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(lambda i: converse(s.gateway.base_url, s.cfg.model, i), range(count)))
    wait_for(lambda: sum(s.judgements().get(t) == "pending" for t in ids) == count, timeout=60, interval=0.25)
    return ids


def finished(s: Stack, ids: list[str], done: set[str]) -> bool:
    """True once every judgement is final and every hinted one has teacher logprobs; `done`
    collects the turns already known to be complete, so each poll asks only about the rest."""
    statuses = s.judgements()
    for tid in ids:
        if tid in done or statuses.get(tid) not in FINAL:
            continue
        j = s.turn(tid)["judgement"]
        if j["status"] == "dead" or not j["hint"] or j["has_teacher_logprobs"]:
            done.add(tid)
    return len(done) == len(ids)


# --- measurement 1: scoring throughput ----------------------------------------------------------


@dataclass
class Throughput:
    judge: str
    turns: int
    seconds: float
    statuses: Counter[str]
    hinted: int
    with_teacher: int
    votes: int
    unparsable_votes: int
    task_seconds: list[float]

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds

    @property
    def votes_per_s(self) -> float:
        return self.votes / self.seconds


def measure_throughput(cfg: Config, backend: str, root: Path) -> Throughput:
    with stack(cfg, backend, root, f"throughput-{backend}") as s:
        ids = create_backlog(s, cfg.turns)
        s.worker.start()
        t0 = time.perf_counter()
        done: set[str] = set()
        deadline = t0 + 600
        while not finished(s, ids, done):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{backend} judge: not done after 600 s\n{s.worker.log_tail()}")
            time.sleep(cfg.poll_s)
        seconds = time.perf_counter() - t0
        judgements = [s.turn(t)["judgement"] for t in ids]
        runtimes = [float(m) for m in _TASK_RUNTIME.findall(s.worker.log_path.read_bytes())]
    votes = [v for j in judgements for v in j["votes"] if v["kind"] == "prm"]
    return Throughput(
        judge=f"llm hosted_vllm/{cfg.model}" if backend == "llm" else f"python {PYTHON_JUDGE}",
        turns=len(ids), seconds=seconds, statuses=Counter(j["status"] for j in judgements),
        hinted=sum(bool(j["hint"]) for j in judgements),
        with_teacher=sum(bool(j["has_teacher_logprobs"]) for j in judgements),
        votes=len(votes), unparsable_votes=sum(not v["parsed"] for v in votes), task_seconds=runtimes)


# --- measurement 2: gateway latency with and without a busy judge -------------------------------


def pause(worker: WorkerProcess) -> None:
    if worker.proc is not None and worker.proc.poll() is None:
        os.killpg(worker.proc.pid, signal.SIGSTOP)


def resume(worker: WorkerProcess) -> None:
    if worker.proc is not None and worker.proc.poll() is None:
        os.killpg(worker.proc.pid, signal.SIGCONT)


def _counter(base_url: str, names: tuple[str, ...]) -> float:
    """Sum of the named counters (all label sets) in a vLLM server's Prometheus /metrics."""
    root = base_url.rstrip("/").removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=10).text
    pattern = rf"^vllm:(?:{'|'.join(names)})_total\{{[^}}]*\}} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def tokens_seen(base_url: str) -> float:
    """Prompt plus generated tokens a vLLM server has processed: moves while it works.
    (vLLM's num_requests_running gauge is refreshed only by engine steps, so it goes stale.)"""
    return _counter(base_url, ("prompt_tokens", "generation_tokens"))


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def wait_drained(urls: list[str], quiet_s: float = 1.5, timeout: float = 60) -> bool:
    """Wait until none of the servers has processed a token for quiet_s seconds."""
    last, since = [tokens_seen(u) for u in urls], time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = [tokens_seen(u) for u in urls]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
    return False


@dataclass
class Block:
    kind: str  # "idle" | "busy"
    latencies_ms: list[float]
    seconds: float
    other_tokens: float  # tokens the policy vLLM processed during the block besides the probes


@dataclass
class Load:
    blocks: list[Block] = field(default_factory=list)
    discarded_busy: int = 0
    undrained_idle: int = 0  # idle blocks that started before vLLM had gone quiet (timeout)
    backlog: int = 0
    scored_during: int = 0

    def latencies(self, kind: str) -> list[float]:
        return [x for b in self.blocks if b.kind == kind for x in b.latencies_ms]

    def other_token_rate(self, kind: str) -> float:
        blocks = [b for b in self.blocks if b.kind == kind]
        return sum(b.other_tokens for b in blocks) / sum(b.seconds for b in blocks)


def probe_block(http: httpx.Client, cfg: Config, gateway_url: str, kind: str, n: int) -> Block:
    body = {"model": cfg.model, "max_tokens": 1, "temperature": 0, "stream": False,
            "messages": [{"role": "user", "content": "Say hi."}]}
    latencies: list[float] = []
    probe_tokens = 0
    seen, started = tokens_seen(cfg.upstream), time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        r = http.post(f"{gateway_url}/v1/chat/completions", json=body)
        r.read()
        r.raise_for_status()
        latencies.append((time.perf_counter() - t) * 1000)
        probe_tokens += r.json()["usage"]["total_tokens"]
    seconds = time.perf_counter() - started
    return Block(kind, latencies, seconds, tokens_seen(cfg.upstream) - seen - probe_tokens)


def measure_load(cfg: Config, root: Path) -> Load:
    per_block = max(1, cfg.samples // cfg.blocks)
    load = Load(backlog=cfg.backlog)
    with stack(cfg, "llm", root, "load") as s, httpx.Client(timeout=120) as http:
        ids = create_backlog(s, cfg.backlog)

        def remaining() -> int:
            statuses = s.judgements()
            return sum(statuses.get(t) not in FINAL for t in ids)

        probe_block(http, cfg, s.gateway.url, "warm-up", 3)
        if not wait_drained([cfg.upstream, cfg.teacher]):
            load.undrained_idle += 1
        load.blocks.append(probe_block(http, cfg, s.gateway.url, "idle", per_block))  # no worker yet
        s.worker.start()
        for i in range(cfg.blocks):
            # busy once the judge has vLLM working (the probes are not running now)
            before = tokens_seen(cfg.upstream)
            wait_until(lambda: tokens_seen(cfg.upstream) > before or remaining() == 0, timeout=30, interval=0.2)
            busy = probe_block(http, cfg, s.gateway.url, "busy", per_block)
            if remaining() == 0:  # the backlog ran out during the block
                load.discarded_busy += 1
                break
            load.blocks.append(busy)
            if i == cfg.blocks - 1:
                break
            pause(s.worker)
            try:
                if not wait_drained([cfg.upstream, cfg.teacher]):
                    load.undrained_idle += 1
                load.blocks.append(probe_block(http, cfg, s.gateway.url, "idle", per_block))
            finally:
                resume(s.worker)
        load.scored_during = len(ids) - remaining()
    return load


# --- report -------------------------------------------------------------------------------------


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def print_settings(cfg: Config) -> None:
    print("settings")
    print(f"  upstream (policy, LLM judge) {cfg.upstream}   teacher {cfg.teacher}   model {cfg.model}")
    print(f"  turns N={cfg.turns}   votes m={cfg.votes}   worker concurrency={cfg.effective_concurrency}"
          f"{'' if cfg.concurrency is not None else ' (default)'}   poll every {cfg.poll_s} s")
    print(f"  load: backlog {cfg.backlog} turns, {cfg.samples} probes per row in {cfg.blocks} blocks")
    print(f"  pool SQLite, broker sqla+sqlite, CPUs {os.cpu_count()}, load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")


def print_throughput(rows: list[Throughput], cfg: Config) -> None:
    print(f"1. scoring throughput: N={cfg.turns} pending turns, m={cfg.votes} votes each; clock from worker "
          "ready to all final\n   and hinted turns with teacher logprobs. wall s/turn = wall s / N; "
          "task s = mean Celery task run time\n")
    print(f"{'judge':<28}{'wall s':>8}{'turns/s':>9}{'votes/s':>9}{'wall s/turn':>12}{'task s':>8}")
    for r in rows:
        task = f"{statistics.mean(r.task_seconds):.2f}" if r.task_seconds else "-"
        print(f"{r.judge:<28}{r.seconds:>8.2f}{r.turns_per_s:>9.3f}{r.votes_per_s:>9.3f}"
              f"{r.seconds / r.turns:>12.3f}{task:>8}")
    print()
    print(f"{'judge':<28}{'turns':>6}{'scored':>7}{'tie':>5}{'unpars.':>8}{'dead':>5}{'hinted':>7}"
          f"{'teacher lp':>11}{'votes':>6}{'unparsable votes':>17}")
    for r in rows:
        share = r.unparsable_votes / r.votes if r.votes else 0.0
        print(f"{r.judge:<28}{r.turns:>6}{r.statuses['scored']:>7}{r.statuses['tie']:>5}"
              f"{r.statuses['unparsable']:>8}{r.statuses['dead']:>5}{r.hinted:>7}{r.with_teacher:>11}"
              f"{r.votes:>6}{f'{r.unparsable_votes} ({share:.0%})':>17}")
    print()


def print_load(load: Load, cfg: Config) -> None:
    idle, busy = load.latencies("idle"), load.latencies("busy")
    print("2. gateway latency of a short chat request (max_tokens=1, greedy, non-streaming, httpx), in ms.\n"
          "   Idle and busy blocks alternate: (a) = no worker yet, or worker SIGSTOPped after both vLLMs went\n"
          "   quiet; (b) = LLM-judge worker scoring the backlog. 'other vLLM tok/s' = prompt + generated\n"
          "   tokens per second the policy vLLM processed during the row's blocks besides the probes\n")
    print(f"{'row':<34}{'n':>4}{'p50':>9}{'p95':>9}{'max':>9}{'mean':>9}{'other vLLM tok/s':>18}")
    for name, kind, values in (("(a) no worker", "idle", idle), ("(b) LLM judge scoring backlog", "busy", busy)):
        if not values:
            print(f"{name:<34}{0:>4}{'-':>9}{'-':>9}{'-':>9}{'-':>9}{'-':>18}")
            continue
        print(f"{name:<34}{len(values):>4}{_pct(values, 50):>9.1f}{_pct(values, 95):>9.1f}"
              f"{max(values):>9.1f}{statistics.mean(values):>9.1f}{load.other_token_rate(kind):>18.1f}")
    if idle and busy:
        print(f"{'ratio (b) / (a)':<34}{'':>4}{_pct(busy, 50) / _pct(idle, 50):>8.2f}x"
              f"{_pct(busy, 95) / _pct(idle, 95):>8.2f}x{max(busy) / max(idle):>8.2f}x"
              f"{statistics.mean(busy) / statistics.mean(idle):>8.2f}x")
    print(f"\n   blocks in order: {' '.join(b.kind for b in load.blocks)}\n"
          f"   busy blocks discarded (backlog ran out): {load.discarded_busy}; idle blocks started before "
          f"vLLM went quiet: {load.undrained_idle};\n"
          f"   backlog turns final by the end: {load.scored_during} of {load.backlog}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="policy vLLM base URL (…/v1); the LLM judge votes with it")
    ap.add_argument("--teacher", required=True,
                    help="vLLM base URL (…/v1) for teacher logprobs; one request at a time (--max-num-seqs 1)")
    ap.add_argument("--model", default="smollm2", help="served model name at both servers (default smollm2)")
    ap.add_argument("--turns", type=int, default=12, help="N: turns to score per throughput row (default 12)")
    ap.add_argument("--votes", type=int, default=3, help="m: judge votes per turn (default 3)")
    ap.add_argument("--concurrency", type=int, help="worker concurrency (default: the worker's default)")
    ap.add_argument("--backlog", type=int, help="turns queued before the load measurement (default 2N)")
    ap.add_argument("--samples", type=int, default=60, help="latency probes per row (default 60)")
    ap.add_argument("--blocks", type=int, default=4, help="busy blocks the probes alternate in (default 4)")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between completion polls (default 0.5)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, pools) and print its path")
    args = ap.parse_args()
    cfg = Config(upstream=args.upstream.rstrip("/"), teacher=args.teacher.rstrip("/"), model=args.model,
                 turns=args.turns, votes=args.votes, concurrency=args.concurrency,
                 backlog=args.backlog or 2 * args.turns, samples=args.samples, blocks=args.blocks,
                 poll_s=args.poll)

    root = Path(tempfile.mkdtemp(prefix="nextstate-judgebench-"))
    started = time.perf_counter()
    try:
        rows = [measure_throughput(cfg, "llm", root), measure_throughput(cfg, "python", root)]
        load = measure_load(cfg, root)
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print_settings(cfg)
    print_throughput(rows, cfg)
    print_load(load, cfg)
    print(f"\ntotal run time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
