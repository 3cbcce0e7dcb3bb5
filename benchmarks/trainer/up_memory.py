"""`nextstate up --train combined` on this machine, the way a user runs it, with its memory watched.

    python benchmarks/trainer/up_memory.py                          # both phases; results/up-memory.{json,md}
    python benchmarks/trainer/up_memory.py --agent qwen-code --tasks 16 --port 8500 --data-dir /tmp/upmem

Two phases, each a real `nextstate up` (this checkout's `python -m nextstate.cli up`, its own data dir
and ports, the shared cache dir with vLLM and the converted SmolLM2):

1. **traffic**: `up` (vLLM, its teacher replica, the scoring worker, the gateway), then a real coding
   agent (tests/support/agents.py installs it: Qwen Code by default) pointed at the gateway with
   nothing but its base URL and a key, run once per task (`qwen -p TASK`: one conversation each) in a
   scratch project (a few of this repository's source files, which the tasks name). Qwen Code's own
   system prompt is ~5.6k tokens in SmolLM2's template, so a turn's prompt is 5–8k tokens (inlining a
   file with its ``@file`` syntax overflows the 8,192-token context).
   `up` stops once every main turn is scored (or ``--score-timeout-s``).
2. **train**: ``up --train combined`` on the same pool, until the online trainer's round 1 is
   decided (a ``promote`` or ``refuse`` event in ``/api/policy/events``), the trainer is given up on,
   or ``--train-timeout-s``; then `up` is stopped (SIGINT, as Ctrl-C).

All along, every second: the RSS of each of `up`'s process trees (``trainer``: `nextstate train
--online`; ``vllm`` and ``vllm-teacher``: each vLLM's API server and engine processes together;
``worker``; ``gateway``: the `up` process itself, which serves the gateway), the machine's
MemAvailable, and whether the gateway's ``/healthz`` and each vLLM's ``/v1/models`` answered within
2 s (``check_s``: the seconds, negative where the answer came later than 2 s, None where none came).
The summary counts per phase the checks unanswered within 2 s, each target's only once it had
answered a first time in that phase (each phase starts its own `up`, whose servers take a while to
come up) and not while `up` is stopping. The trainer's round (turns, tokens, seconds) is read from its
log. ``--report RESULTS.json`` writes the summary and the table of an earlier run again.

Writes results/up-memory.json (every sample, the phases, the round, the events) and
results/up-memory.md (the table in benchmarks/trainer/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.agents import ensure_agent, run_agent  # noqa: E402

RESULTS = HERE / "results"
MODEL = "smollm2"
CHECK_TIMEOUT_S = 2.0
GIB = 1024 ** 3
# the scratch project: files of this repository an agent is asked about
PROJECT_FILES = ("datapool/leases.py", "trainer/online.py", "nextstate/supervisor.py", "trainer/eval_gate.py",
                 "gateway/budget.py", "scoring/score.py", "datapool/versions.py", "trainer/samples.py")
TASKS = (
    "Explain how a lease expires in leases.py and what happens to its turn.",
    "Review online.py: what does run_round do when the eval gate refuses a candidate?",
    "In supervisor.py, how does the restart backoff work? Suggest a test for it.",
    "Find a possible bug in eval_gate.py and propose a fix.",
    "Summarize budget.py and say how the output budget is fitted to the context.",
    "What does score.py do with a turn that has no next state? Refactor it to be clearer.",
    "Write docstrings for the functions of versions.py that have none.",
    "How are samples built in samples.py? List the fields of a sample.",
    "Compare leases.py and versions.py: which functions open a transaction?",
    "Add type hints where they are missing in supervisor.py.",
    "Explain the staleness correction in online.py step by step.",
    "Is there dead code in budget.py? Show what you would delete.",
    "Write a unit test for the lease expiry in leases.py.",
    "Explain how eval_gate.py decides between promote and refuse.",
    "Which errors can score.py raise, and who catches them?",
    "Rename the private helpers of samples.py to clearer names and show the diff.",
)


def classify(proc: psutil.Process, ports: dict[str, int]) -> str:
    """Which of `up`'s children *proc* is."""
    cmd = " ".join(proc.cmdline())
    if " train " in f" {cmd} " and "--online" in cmd:
        return "trainer"
    if " worker" in cmd:
        return "worker"
    if "vllm" in cmd:
        return "vllm-teacher" if f"{ports['vllm-teacher']}" in cmd else "vllm"
    return "other"


class Watch:
    """Samples `up`'s processes and health checks every second in a thread."""

    def __init__(self, ports: dict[str, int]):
        self.ports = ports
        self.samples: list[dict[str, Any]] = []
        self.phase = "start"
        self.up: psutil.Process | None = None
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=3)
        # one client per target: a new client per check builds an SSL context each time (CPU)
        self._clients = {n: httpx.Client(timeout=CHECK_TIMEOUT_S) for n in ("gateway", "vllm", "vllm-teacher")}
        self._kinds: dict[int, str] = {}  # pid -> classify(); a pid's command line does not change
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.urls = {"gateway": f"http://127.0.0.1:{ports['gateway']}/healthz",
                     "vllm": f"http://127.0.0.1:{ports['vllm']}/v1/models",
                     "vllm-teacher": f"http://127.0.0.1:{ports['vllm-teacher']}/v1/models"}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown()
        for client in self._clients.values():
            client.close()

    def _rss(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.up is None or not self.up.is_running():
            return out
        try:
            out["gateway"] = self.up.memory_info().rss / GIB
            for child in self.up.children():
                if child.pid not in self._kinds:
                    self._kinds[child.pid] = classify(child, self.ports)
                name = self._kinds[child.pid]
                tree = [child, *child.children(recursive=True)]
                out[name] = out.get(name, 0.0) + sum(_rss_of(p) for p in tree) / GIB
        except psutil.Error:
            pass
        return out

    def _check(self, name: str) -> float | None:
        started = time.monotonic()
        try:
            r = self._clients[name].get(self.urls[name])
            seconds = time.monotonic() - started
            if r.status_code == 200:
                return seconds if seconds <= CHECK_TIMEOUT_S else -seconds  # negative: answered too late
        except httpx.HTTPError:
            pass
        return None

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            tick = time.monotonic()
            checks = {n: self._pool.submit(self._check, n) for n in self.urls}
            sample: dict[str, Any] = {"t": round(tick - t0, 1), "phase": self.phase,
                                      "rss_gib": {k: round(v, 3) for k, v in self._rss().items()},
                                      "mem_available_gib": round(psutil.virtual_memory().available / GIB, 2)}
            sample["check_s"] = {n: (None if (s := f.result()) is None else round(s, 3)) for n, f in checks.items()}
            self.samples.append(sample)
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))


def _rss_of(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


class UpRun:
    """One `nextstate up` process of this checkout, its console in a file."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], extra: list[str], log: Path):
        self.log = log
        cmd = [sys.executable, "-m", "nextstate.cli", "up", "--port", str(args.port),
               "--vllm-port", str(args.port + 1), *extra]
        self.argv = cmd
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def console(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"`up` exited {self.proc.returncode}:\n{self.console()[-3000:]}")
            if "base_url: " in self.console():
                return
            time.sleep(2)
        raise SystemExit(f"`up` not ready after {timeout_s:.0f} s:\n{self.console()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def pool_turns(db: Path) -> list[dict[str, Any]]:
    """Main turns of the pool: prompt and reply tokens, whether scored."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute(
            "SELECT t.id, t.status, json_array_length(t.prompt_token_ids), json_array_length(t.token_ids), "
            "t.usage, (SELECT COUNT(*) FROM judgements j WHERE j.turn_id = t.id AND (j.reward IS NOT NULL "
            "OR j.teacher_logprobs IS NOT NULL)) FROM turns t WHERE t.turn_type = 'main' ORDER BY t.created_at"
        ).fetchall()
    finally:
        con.close()
    return [{"id": r[0], "status": r[1], "prompt_tokens": r[2], "reply_tokens": r[3], "scored": bool(r[5])}
            for r in rows]


def make_project(root: Path) -> Path:
    work = root / "project"
    work.mkdir(parents=True, exist_ok=True)
    for rel in PROJECT_FILES:
        shutil.copy(REPO / rel, work / Path(rel).name)
    (work / "README.md").write_text("A few modules of nextstate, an OpenAI-compatible proxy that trains its model.\n")
    return work


def agent_env(agent: str, home: Path, url: str, key: str) -> dict[str, str]:
    """What a person sets to point *agent* at the gateway (as tests/agents/test_agents.py does)."""
    if agent == "codex":
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "nextstate"\n\n[model_providers.nextstate]\nname = "nextstate"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "NEXTSTATE_KEY"\n')
        return {"NEXTSTATE_KEY": key}
    # Qwen Code gives up on a stream silent for 240 s: a 7k-token prefill on two busy cores takes longer
    return {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key, "OPENAI_MODEL": MODEL,
            "QWEN_STREAM_IDLE_TIMEOUT_MS": "0"}


def agent_args(agent: str, task: str, more: bool) -> list[str]:
    if agent == "codex":
        return ["exec", *(["resume", "--last"] if more else []), "--skip-git-repo-check", task]
    return ["-p", task, *(["--continue"] if more else [])]


def traffic(args: argparse.Namespace, env: dict[str, str], watch: Watch) -> dict[str, Any]:
    """Phase 1: `up`, the agent over the tasks, until every main turn is scored."""
    up = UpRun(args, env, ["--no-scoring"] if args.no_scoring else [], args.data_dir / "up-traffic.log")
    watch.up, watch.phase = psutil.Process(up.proc.pid), "traffic"
    runs: list[dict[str, Any]] = []
    try:
        up.wait_ready(args.start_timeout_s)
        install = ensure_agent(args.agent)
        home = args.data_dir / "agent-home"
        work = make_project(args.data_dir)
        a_env = agent_env(args.agent, home, f"http://127.0.0.1:{args.port}", "sk-local-" + uuid.uuid4().hex[:8])
        for i, task in enumerate(TASKS[:args.tasks]):
            more = i % args.per_session != 0  # a session of --per-session tasks, each continuing the one before
            run = run_agent(install, agent_args(args.agent, task, more), home=home, env=a_env, cwd=work,
                            timeout_s=args.task_timeout_s)
            runs.append({"task": task, "continued": more, "rc": run.returncode, "seconds": round(run.seconds, 1)})
            print(f"traffic: task {i + 1}/{args.tasks} rc={run.returncode} {run.seconds:.0f}s "
                  f"({len(pool_turns(args.db))} main turns in the pool)", flush=True)
        deadline = time.monotonic() + args.score_timeout_s
        while time.monotonic() < deadline:
            turns = pool_turns(args.db)
            if turns and all(t["scored"] for t in turns if t["status"] == "ok"):
                break
            time.sleep(10)
    finally:
        watch.phase = "traffic-stop"
        rc = up.stop()
    turns = pool_turns(args.db)
    print(f"traffic: {len(turns)} main turns, {sum(t['scored'] for t in turns)} scored; up exited {rc}", flush=True)
    return {"argv": up.argv, "agent": args.agent, "runs": runs, "turns": turns, "up_rc": rc}


ROUND_RE = re.compile(r"round (\d+): training on (\d+) turns \(([\d,]+) tokens[;)]")
TRAINED_RE = re.compile(r"round (\d+): trained in ([^;]+);")


def trainer_round(log: Path) -> dict[str, Any]:
    """Round 1 as the trainer's log tells it."""
    text = log.read_text(errors="replace") if log.exists() else ""
    out: dict[str, Any] = {}
    if m := ROUND_RE.search(text):
        out |= {"round": int(m[1]), "turns": int(m[2]), "tokens": int(m[3].replace(",", ""))}
    if m := TRAINED_RE.search(text):
        out["trained_in"] = m[2].strip()
    out["killed"] = text.count("Killed") + text.count("SIGKILL")
    return out


def events(db: Path) -> list[dict[str, Any]]:
    """The pool's policy events, oldest first (what GET /api/policy/events lists)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("SELECT e.action, e.actor, e.reason, e.metrics, e.created_at, v.name FROM policy_events e "
                           "LEFT JOIN policy_versions v ON v.id = e.version_id ORDER BY e.id").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()
    return [{"action": r[0], "actor": r[1], "reason": r[2], "metrics": json.loads(r[3] or "{}"), "at": r[4],
             "version": r[5]} for r in rows]


def train(args: argparse.Namespace, env: dict[str, str], watch: Watch) -> dict[str, Any]:
    """Phase 2: `up --train OBJECTIVE` until round 1 is decided."""
    up = UpRun(args, env, ["--train", args.objective, *(["--", *shlex.split(args.train_args)] if args.train_args else [])],
               args.data_dir / "up-train.log")
    watch.up, watch.phase = psutil.Process(up.proc.pid), "train"
    started = time.monotonic()
    decided: dict[str, Any] | None = None
    try:
        up.wait_ready(args.start_timeout_s)
        while time.monotonic() - started < args.train_timeout_s and up.proc.poll() is None:
            evs = events(args.db)
            decided = next((e for e in evs if e.get("action") in ("promote", "refuse")), None)
            if decided or "giving up" in up.console():
                break
            time.sleep(5)
    finally:
        watch.phase = "train-stop"
        rc = up.stop()
    evs = events(args.db)
    return {"argv": up.argv, "turns": pool_turns(args.db), "decided": decided, "seconds": round(time.monotonic() - started, 1), "up_rc": rc,
            "round": trainer_round(args.data_dir / "logs" / "trainer.log"), "events": evs,
            "console_tail": up.console()[-4000:]}


PROCS = ("trainer", "vllm", "vllm-teacher", "worker", "gateway")
TARGETS = ("gateway", "vllm", "vllm-teacher")


def unanswered_checks(mine: list[dict[str, Any]]) -> dict[str, int]:
    """Per target, the checks of one phase's samples that got no answer within 2 s once the target
    had answered a first time in the phase, leaving out those while `up` was stopping."""
    out = {}
    for n in TARGETS:
        answered, count = False, 0
        for s in mine:
            seconds = s["check_s"].get(n)
            if answered and (seconds is None or seconds < 0) and not s["phase"].endswith("stop"):
                count += 1
            answered = answered or seconds is not None
        out[n] = count
    return out


def summarize(samples: list[dict[str, Any]], phase: str) -> dict[str, Any]:
    """Peak RSS per process, least MemAvailable and the unanswered checks of one phase (its
    stopping included)."""
    mine = [s for s in samples if s["phase"].split("-")[0] == phase]
    peak = {p: max((s["rss_gib"].get(p, 0.0) for s in mine), default=0.0) for p in PROCS}
    unanswered = unanswered_checks(mine)
    slowest = {n: max((abs(s["check_s"][n]) for s in mine if s["check_s"].get(n) is not None), default=None)
               for n in TARGETS}
    return {"samples": len(mine), "peak_rss_gib": {k: round(v, 2) for k, v in peak.items()},
            "min_mem_available_gib": min((s["mem_available_gib"] for s in mine), default=None),
            "unanswered_checks": unanswered, "slowest_answer_s": slowest}


def table(result: dict[str, Any]) -> str:
    lines = ["| phase | trainer | vLLM | vLLM teacher | worker | gateway (`up`) | least MemAvailable | "
             "checks unanswered in 2 s (gateway / vLLM / teacher) | slowest answer s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for phase in ("traffic", "train"):
        if phase not in result["summary"]:
            continue
        s = result["summary"][phase]
        rss = " | ".join(f"{s['peak_rss_gib'][p]:.2f} GiB" if s["peak_rss_gib"][p] else "–" for p in PROCS)
        miss = " / ".join(str(s["unanswered_checks"][n]) for n in TARGETS)
        slow = " / ".join("–" if v is None else f"{v:.2f}" for v in s["slowest_answer_s"].values())
        lines.append(f"| {phase} ({s['samples']} s) | {rss} | {s['min_mem_available_gib']} GiB | {miss} | {slow} |")
    tr = result.get("train", {})
    rnd, decided = tr.get("round", {}), tr.get("decided") or {}
    turns = tr.get("turns") or result.get("traffic", {}).get("turns", [])
    prompts = sorted(t["prompt_tokens"] or 0 for t in turns)
    lines += ["", "| main turns captured | prompt tokens (min / median / max) | round 1 turns | round 1 tokens | "
              "trained in | decision | `up --train` until decided |", "| --- | --- | --- | --- | --- | --- | --- |",
              f"| {len(turns)} | {prompts[0] if prompts else '–'} / {prompts[len(prompts) // 2] if prompts else '–'} / "
              f"{prompts[-1] if prompts else '–'} | {rnd.get('turns', '–')} | {rnd.get('tokens', '–')} | "
              f"{rnd.get('trained_in', '–')} | {decided.get('action', 'none')} {decided.get('version') or ''} | "
              f"{tr.get('seconds', '–')} s |"]
    return "\n".join(lines) + "\n"


def summaries(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {p: summarize(samples, p) for p in ("traffic", "train") if any(s["phase"].startswith(p) for s in samples)}


def report(path: Path) -> int:
    """``--report``: the summary of *path*'s samples and its table written again, the table to the
    ``.md`` beside it."""
    result = json.loads(path.read_text())
    result["summary"] = summaries(result["samples"])
    path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    path.with_suffix(".md").write_text(table(result))
    print(table(result))
    return 0


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agent", default="qwen-code", choices=("qwen-code", "codex"), help="the coding agent")
    ap.add_argument("--tasks", type=int, default=16, help="agent runs in the traffic phase (at most %d)" % len(TASKS))
    ap.add_argument("--per-session", type=int, default=1, help="tasks per conversation (the later ones continue it)")
    ap.add_argument("--phases", default="traffic,train", help="traffic, train or both (train reuses the data dir)")
    ap.add_argument("--objective", default="combined", choices=("rl", "opd", "combined"))
    ap.add_argument("--train-args", default="", help="options after `--` of `up --train`, one string: '--k 8'")
    ap.add_argument("--port", type=int, default=8500, help="gateway; vLLM +1, its teacher +2")
    ap.add_argument("--data-dir", type=Path, default=Path("/tmp/nextstate-up-memory"))
    ap.add_argument("--fresh", action="store_true", help="empty the data dir first")
    ap.add_argument("--no-scoring", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--session-idle-timeout-s", type=float, default=60.0,
                    help="NEXTSTATE_SESSION_IDLE_TIMEOUT_S: when a conversation's last turn is scored")
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--task-timeout-s", type=int, default=1200)
    ap.add_argument("--score-timeout-s", type=float, default=900.0)
    ap.add_argument("--train-timeout-s", type=float, default=2400.0)
    ap.add_argument("--out", default="up-memory", help="results/OUT.json and results/OUT.md")
    ap.add_argument("--report", type=Path, metavar="RESULTS.json",
                    help="run nothing: write the summary and table of an earlier run's JSON again (beside it)")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)
    if args.fresh and args.data_dir.exists():
        shutil.rmtree(args.data_dir)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.db = args.data_dir / "nextstate.db"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEXTSTATE_DATA_DIR": str(args.data_dir),
           "NEXTSTATE_PORT": str(args.port), "NEXTSTATE_TEACHER_VLLM_PORT": str(args.port + 2),
           "NEXTSTATE_SESSION_IDLE_TIMEOUT_S": str(args.session_idle_timeout_s)}
    # SIGTERM ends a phase as Ctrl-C does: `up` is stopped and what was measured is written
    signal.signal(signal.SIGTERM, _interrupt)
    watch = Watch({"gateway": args.port, "vllm": args.port + 1, "vllm-teacher": args.port + 2})
    watch.start()
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "mem_gib": round(psutil.virtual_memory().total / GIB, 1),
                                          "platform": platform.platform()},
                              "started": datetime.now(UTC).isoformat(timespec="seconds"), "argv": sys.argv}
    try:
        if "traffic" in args.phases:
            result["traffic"] = traffic(args, env, watch)
        if "train" in args.phases:
            result["train"] = train(args, env, watch)
    finally:
        watch.stop()
        result["samples"] = watch.samples
        result["summary"] = summaries(watch.samples)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
        (RESULTS / f"{args.out}.md").write_text(table(result))
        print(table(result))
    decided = (result.get("train") or {}).get("decided") or {}
    return 0 if decided.get("action") == "promote" else 1


if __name__ == "__main__":
    sys.exit(main())
