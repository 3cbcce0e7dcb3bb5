"""Offline rollouts: run an agent over a task dataset through the gateway, n sessions per task.

Each rollout is one session with a deterministic id (``<run>:<task>:<index>``), created and
tagged through the gateway's admin API before the agent runs (mode ``offline`` or ``eval``,
task id, group id = the task), so an agent that only knows its ``/s/{session}/v1`` base_url
needs to send nothing else. The runner speaks to the gateway over HTTP only; it may run on
another machine.

A rollout is done once its session carries ``metadata.rollout.status == "done"``; a rerun of
the same command skips those, so an interrupted run resumes without duplicating sessions. A
session an interrupted run left half-way (turns, no verdict) is kept, marked ``cancelled``, and
its rollout runs again as the next attempt (``<run>:<task>:<index>:<attempt>``).
"""

from __future__ import annotations

from base.errors import InfraError, RolloutError

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

Task = dict[str, Any]

RUN_NAME = re.compile(r"^[A-Za-z0-9._-]{1,40}$")
_PLAIN_TASK_ID = re.compile(r"^[A-Za-z0-9._-]{1,48}$")
MAX_ATTEMPTS = 50  # per rollout, over all interruptions and infrastructure retries
OUTPUT_LIMIT = 64 * 1024  # characters of a black-box agent's stdout/stderr kept in its result
KILL_GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later


class _AgentInfraError(Exception):
    """An attempt failed because of infrastructure, not the agent: it is retried."""


# -- inputs ---------------------------------------------------------------------------------------


def load_tasks(path: Path) -> list[Task]:
    """Tasks from a JSONL file (one JSON object a line) or a Parquet file (one row a task).
    Every task needs an ``id``, unique in the file (numbers are turned into strings)."""
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - pyarrow is in the rollout extra
            raise RolloutError("reading Parquet needs pyarrow: pip install 'nextstate[rollout]'") from exc
        rows = pq.read_table(path).to_pylist()
        where = [f"{path} row {i + 1}" for i in range(len(rows))]
    else:
        rows, where = [], []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise RolloutError(f"{path} line {n}: not JSON: {exc}") from exc
                where.append(f"{path} line {n}")
    tasks: list[Task] = []
    seen: set[str] = set()
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise RolloutError(f"{at}: a task must be a JSON object")
        tid = row.get("id")
        if isinstance(tid, bool) or not isinstance(tid, (str, int)) or str(tid) == "":
            raise RolloutError(f"{at}: a task needs an `id` (string or integer)")
        tid = str(tid)
        if tid in seen:
            raise RolloutError(f"{at}: duplicate task id {tid!r}")
        seen.add(tid)
        tasks.append({**row, "id": tid})
    if not tasks:
        raise RolloutError(f"{path}: no tasks")
    return tasks


def load_callable(spec: str) -> Callable[..., Any]:
    """``package.module:function`` or ``path/to/file.py:function``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RolloutError(f"{spec!r}: expected module:function or path/to/file.py:function")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name).resolve()
            if not file.is_file():
                raise RolloutError(f"{spec!r}: no file {file}")
            name = "_nextstate_user_" + hashlib.sha256(str(file).encode()).hexdigest()[:12]
            loaded = importlib.util.spec_from_file_location(name, file)
            assert loaded is not None and loaded.loader is not None
            module = importlib.util.module_from_spec(loaded)
            sys.modules[name] = module
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RolloutError(f"{spec!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RolloutError(f"{spec!r}: {module_name} has no function {attr}")
    return fn


def default_run_name(tasks_path: Path, agent: str, mode: str, tasks: list[Task] | None = None) -> str:
    """Same task file, agent and mode (and, for a sample of the file, the same tasks) give the same
    name, so rerunning a command resumes it."""
    h = hashlib.sha256()
    h.update(tasks_path.read_bytes())
    h.update(b"\0" + agent.encode() + b"\0" + mode.encode())
    if tasks is not None:
        h.update(b"\0" + "\0".join(str(t["id"]) for t in tasks).encode())
    return f"{mode}-{h.hexdigest()[:10]}"


def session_id(run: str, task_id: str, index: int, attempt: int = 0) -> str:
    """``<run>:<task>:<index>`` (``:<attempt>`` after the first); a task id that is long or has
    characters a session id may not carry is replaced by a hash of it."""
    tid = task_id if _PLAIN_TASK_ID.match(task_id) else "t" + hashlib.sha256(task_id.encode()).hexdigest()[:16]
    return f"{run}:{tid}:{index}" + (f":{attempt}" if attempt else "")


# -- the gateway's admin API ------------------------------------------------------------------------


class GatewayClient:
    """The admin calls a rollout needs, retried on infrastructure errors (unreachable, 5xx)."""

    def __init__(self, url: str, *, admin_token: str | None, retries: int, backoff_s: float = 1.0):
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=httpx.Timeout(120.0, connect=5.0))
        self.retries = retries
        self.backoff_s = backoff_s

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                problem = f"gateway {self.url} unreachable: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code >= 500:
                problem = f"gateway {method} {path}: {resp.status_code} {_error_message(resp)}"
                continue
            if resp.status_code >= 400:
                raise RolloutError(f"gateway {method} {path}: {resp.status_code} {_error_message(resp)}")
            return resp.json()
        raise InfraError(f"{problem} (after {self.retries} retries)")

    async def healthy(self) -> bool:
        try:
            return (await self.http.get("/healthz", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def put_session(self, sid: str, tags: dict[str, Any]) -> Any:
        return self.request("PUT", f"/api/sessions/{sid}", json=tags)

    def patch_session(self, sid: str, **update: Any) -> Any:
        return self.request("PATCH", f"/api/sessions/{sid}", json=update)

    def get_session(self, sid: str) -> Any:
        return self.request("GET", f"/api/sessions/{sid}")

    def post_outcome(self, sid: str, outcome: float, source: str) -> Any:
        return self.request("POST", f"/api/sessions/{sid}/outcome", json={"outcome": outcome, "source": source})

    def flush(self) -> Any:
        return self.request("POST", "/api/capture/flush")


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


# -- agents -----------------------------------------------------------------------------------------


@dataclass
class AgentRun:
    status: str  # "ok" | "timed_out" | "failed"
    result: Any
    error: str | None = None


class PythonAgent:
    """White-box: ``async def agent(task, client) -> result``; ``client`` is an
    ``openai.AsyncOpenAI`` whose base_url is the session's ``/s/{session}/v1``.

    The rollouts of one event loop share one HTTP client (OpenAI's default httpx settings): a
    client of its own per rollout built an SSL context and a connection pool every time, ~50 ms
    of CPU per episode (py-spy on `benchmarks.agents.run --calibrate`), and opened new
    connections to the gateway. :meth:`close` closes it; the Runner calls it at the end."""

    def __init__(self, spec: str, *, api_key: str | None):
        self.spec = spec
        self.fn = load_callable(spec)
        if not inspect.iscoroutinefunction(self.fn):
            raise RolloutError(f"--agent {spec}: must be an async function (task, client) -> result")
        self.api_key = api_key
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _shared_http(self) -> httpx.AsyncClient:
        import openai

        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop or self._http.is_closed:
            self._http, self._loop = openai.DefaultAsyncHttpxClient(), loop  # a client is bound to its loop
        return self._http

    async def close(self) -> None:
        http, self._http, self._loop = self._http, None, None
        if http is not None and not http.is_closed:
            await http.aclose()

    async def run(self, task: Task, *, base_url: str, sid: str, workdir: Path, timeout_s: float) -> AgentRun:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=self.api_key or "unused", http_client=self._shared_http())
        try:
            result = await asyncio.wait_for(self.fn(task, client), timeout_s)
            return AgentRun("ok", result)
        except TimeoutError:
            return AgentRun("timed_out", None, f"agent did not finish within {timeout_s}s")
        except (openai.APIConnectionError, openai.InternalServerError, httpx.TransportError) as exc:
            raise _AgentInfraError(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # the agent's own failure: recorded, not retried
            return AgentRun("failed", None, f"{type(exc).__name__}: {exc}")


class CommandAgent:
    """Black-box: a shell command template run once per rollout in its own working directory,
    in its own process group (killed as a whole at the timeout)."""

    def __init__(self, template: str, *, api_key: str | None, model: str):
        self.spec = template
        self.template = template
        self.api_key = api_key
        self.model = model

    async def close(self) -> None:
        """Nothing to close: each rollout's process is waited for (or killed) by :meth:`run`."""

    def command(self, values: dict[str, str]) -> str:
        cmd = self.template
        for key, value in values.items():
            cmd = cmd.replace("{" + key + "}", shlex.quote(value))
        return cmd

    async def run(self, task: Task, *, base_url: str, sid: str, workdir: Path, timeout_s: float) -> AgentRun:
        work = workdir / "work"
        work.mkdir(parents=True)
        task_file = workdir / "task.json"
        task_file.write_text(json.dumps(task, ensure_ascii=False, indent=1), encoding="utf-8")
        values = {"base_url": base_url, "session_id": sid, "task_file": str(task_file), "model": self.model}
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": self.api_key or "unused",
               "OPENAI_MODEL": self.model, "NEXTSTATE_SESSION_ID": sid, "NEXTSTATE_TASK_FILE": str(task_file)}
        out_path, err_path = workdir / "stdout.txt", workdir / "stderr.txt"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = await asyncio.create_subprocess_shell(
                self.command(values), cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=err, start_new_session=True)
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                if proc.returncode is None:
                    await _kill_group(proc)
                else:  # what the agent left running in the background goes with it
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
        result = {"exit_code": proc.returncode, "stdout": _tail(out_path), "stderr": _tail(err_path),
                  "workdir": str(work), "timed_out": timed_out}
        if timed_out:
            return AgentRun("timed_out", result, f"agent killed after {timeout_s}s")
        if proc.returncode != 0:
            return AgentRun("failed", result, f"agent exited with {proc.returncode}")
        return AgentRun("ok", result)


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the agent's whole process group, SIGKILL whatever is left after a grace period."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the shell or ignored SIGTERM
    await proc.wait()


def _tail(path: Path) -> str:
    data = path.read_bytes()
    return data[-OUTPUT_LIMIT:].decode("utf-8", errors="replace")


# -- the runner ---------------------------------------------------------------------------------------


@dataclass
class RolloutRecord:
    """What one finished rollout left in its session's metadata (``metadata.rollout``)."""

    session_id: str
    task_id: str
    index: int
    status: str  # "ok" | "timed_out" | "failed"
    outcome: float | None
    policy_version: str | None
    created_at: str | None
    skipped: bool = False  # done by an earlier run of the same command

    def passed(self, threshold: float) -> bool:
        return self.outcome is not None and self.outcome >= threshold


@dataclass
class RolloutConfig:
    gateway_url: str
    run: str
    n: int = 1
    concurrency: int = 4
    timeout_s: float = 300.0
    mode: str = "offline"  # "offline" | "eval"
    retries: int = 3
    workdir: Path = Path("rollouts")
    admin_token: str | None = None
    pass_threshold: float = 1.0
    backoff_s: float = 1.0


def _grouped(records: Iterable[RolloutRecord], key: Callable[[RolloutRecord], str]) -> dict[str, list[RolloutRecord]]:
    out: dict[str, list[RolloutRecord]] = defaultdict(list)
    for r in records:
        out[key(r)].append(r)
    return out


@dataclass
class RunSummary:
    run: str
    mode: str
    records: list[RolloutRecord] = field(default_factory=list)
    pass_threshold: float = 1.0

    def report(self) -> dict[str, Any]:
        """Counts, success rate, and pass@1 / mean outcome per policy version."""
        recs = self.records
        outcomes = [r.outcome for r in recs if r.outcome is not None]
        versions = {}
        for version, rs in sorted(_grouped(recs, lambda r: r.policy_version or "unknown").items()):
            per_task = _grouped(rs, lambda r: r.task_id)
            # pass@1 = mean over tasks of c/n (the unbiased estimator for k = 1)
            pass1 = sum(sum(r.passed(self.pass_threshold) for r in t) / len(t) for t in per_task.values())
            outs = [r.outcome for r in rs if r.outcome is not None]
            versions[version] = {"rollouts": len(rs), "tasks": len(per_task), "pass@1": pass1 / len(per_task),
                                 "mean_outcome": sum(outs) / len(outs) if outs else None,
                                 "with_outcome": len(outs)}
        by_task = _grouped(recs, lambda r: r.task_id)
        status = Counter(r.status for r in recs)
        passed = sum(r.passed(self.pass_threshold) for r in recs)
        return {
            "run": self.run, "mode": self.mode, "rollouts": len(recs),
            "skipped": sum(r.skipped for r in recs),
            "ok": status["ok"], "timed_out": status["timed_out"], "failed": status["failed"],
            "with_outcome": len(outcomes), "passed": passed, "pass_threshold": self.pass_threshold,
            "success_rate": passed / len(recs) if recs else None,
            "mean_outcome": sum(outcomes) / len(outcomes) if outcomes else None,
            "by_version": versions,
            # per task: rollouts and passes (rollout.curriculum reads them: --learnable-from)
            "by_task": {tid: {"rollouts": len(rs), "passed": sum(r.passed(self.pass_threshold) for r in rs)}
                        for tid, rs in sorted(by_task.items())},
        }


class Runner:
    """Drives ``n`` rollouts per task through the gateway, ``concurrency`` at a time."""

    def __init__(self, cfg: RolloutConfig, agent: PythonAgent | CommandAgent,
                 verifier: Callable[..., Any] | None = None, verifier_name: str | None = None,
                 on_done: Callable[[RolloutRecord], None] | None = None):
        if not RUN_NAME.match(cfg.run):
            raise RolloutError(f"run name {cfg.run!r}: 1-40 letters, digits, '.', '_' or '-'")
        self.cfg = cfg
        self.agent = agent
        self.verifier = verifier
        self.verifier_name = verifier_name or "verifier"
        self.on_done = on_done
        self.api = GatewayClient(cfg.gateway_url, admin_token=cfg.admin_token, retries=cfg.retries,
                                 backoff_s=cfg.backoff_s)

    async def run(self, tasks: list[Task]) -> RunSummary:
        summary = RunSummary(self.cfg.run, self.cfg.mode, pass_threshold=self.cfg.pass_threshold)
        gate = asyncio.Semaphore(self.cfg.concurrency)

        async def one(task: Task, index: int) -> None:
            async with gate:
                record = await self.rollout(task, index)
            summary.records.append(record)
            if self.on_done:
                self.on_done(record)

        try:
            async with asyncio.TaskGroup() as group:
                for task in tasks:
                    for index in range(self.cfg.n):
                        group.create_task(one(task, index))
        except* RolloutError as eg:
            raise eg.exceptions[0] from None
        finally:
            await self.api.close()
            await self.agent.close()
        order = {(t["id"], i): k for k, (t, i) in enumerate((t, i) for t in tasks for i in range(self.cfg.n))}
        summary.records.sort(key=lambda r: order[(r.task_id, r.index)])
        return summary

    def _tags(self, task: Task, index: int, attempt: int) -> dict[str, Any]:
        return {"mode": self.cfg.mode, "task_id": task["id"], "group_id": task["id"],
                "metadata": {"rollout": {"run": self.cfg.run, "task_id": task["id"], "index": index,
                                         "attempt": attempt, "agent": self.agent.spec, "status": "running"}}}

    async def rollout(self, task: Task, index: int) -> RolloutRecord:
        """One rollout slot: skip it when done, else run it (again, as a new attempt, when an
        earlier attempt was interrupted or hit an infrastructure error)."""
        infra_failures = 0
        for attempt in range(MAX_ATTEMPTS):
            sid = session_id(self.cfg.run, task["id"], index, attempt)
            state = await self.api.put_session(sid, self._tags(task, index, attempt))
            meta = (state.get("metadata") or {}).get("rollout") or {}
            if meta.get("status") == "done":
                return RolloutRecord(sid, task["id"], index, meta.get("result", "ok"), state.get("outcome"),
                                     meta.get("policy_version"), state.get("created_at"), skipped=True)
            if meta.get("status") == "cancelled":
                continue
            if state.get("turn_count", 0) > 0 or state.get("ended_at"):
                # left half-way by an interrupted run: kept as it is, marked, and run again
                await self.api.patch_session(sid, end_reason="cancelled", metadata={
                    "rollout": meta | {"status": "cancelled", "error": "interrupted before its verdict"}})
                continue
            try:
                return await self._attempt(task, index, attempt, sid, state)
            except _AgentInfraError as exc:
                infra_failures += 1
                await self.api.patch_session(sid, end_reason="cancelled", metadata={
                    "rollout": meta | {"status": "cancelled", "error": f"infrastructure: {exc}"}})
                if infra_failures > self.cfg.retries:
                    raise InfraError(f"rollout {task['id']}#{index}: {exc} (after {self.cfg.retries} retries)")
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (infra_failures - 1))
        raise RolloutError(f"rollout {task['id']}#{index}: {MAX_ATTEMPTS} attempts without a verdict")

    async def _attempt(self, task: Task, index: int, attempt: int, sid: str, state: dict[str, Any]) -> RolloutRecord:
        workdir = self.cfg.workdir / sid.replace(":", "_")
        if workdir.exists():
            shutil.rmtree(workdir)  # an attempt interrupted before it captured anything
        workdir.mkdir(parents=True)
        base_url = f"{self.api.url}/s/{sid}/v1"
        started = time.monotonic()
        run = await self.agent.run(task, base_url=base_url, sid=sid, workdir=workdir, timeout_s=self.cfg.timeout_s)
        if run.status == "ok" and isinstance(run.result, dict) and run.result.get("failure"):
            # the agent's environment stopped it (a sandbox limit): failed, with its reason, and verified
            run = AgentRun("failed", run.result, str(run.result["failure"]))
        duration = time.monotonic() - started
        await self.api.flush()
        session = await self.api.get_session(sid)
        turns = session.get("turns") or []
        if run.status == "failed" and isinstance(self.agent, CommandAgent) and await self._infra_caused(turns):
            raise _AgentInfraError(run.error or "agent failed while the gateway or upstream was failing")
        outcome: float | None = None
        verifier_error: str | None = None
        if self.verifier is not None and run.result is not None and run.status != "timed_out":
            try:
                value = self.verifier(task, run.result, session)
                if inspect.isawaitable(value):
                    value = await value
                outcome = float(value)
                if not math.isfinite(outcome):
                    raise ValueError(f"outcome must be a finite number, got {value!r}")
            except Exception as exc:  # a verifier bug must not stop the other rollouts
                outcome, verifier_error = None, f"{type(exc).__name__}: {exc}"
            if outcome is not None:
                await self.api.post_outcome(sid, outcome, f"verifier:{self.verifier_name}")
        versions = [t.get("policy_version") for t in turns if t.get("turn_type") == "main" and t.get("policy_version")]
        version = Counter(versions).most_common(1)[0][0] if versions else None
        meta = {"run": self.cfg.run, "task_id": task["id"], "index": index, "attempt": attempt,
                "agent": self.agent.spec, "status": "done", "result": run.status, "outcome": outcome,
                "duration_s": round(duration, 3), "policy_version": version, "error": run.error,
                "verifier_error": verifier_error, "workdir": str(workdir)}
        if isinstance(run.result, dict) and "exit_code" in run.result:
            meta["exit_code"] = run.result["exit_code"]
        end_reason = None if run.status == "ok" else run.status
        await self.api.patch_session(sid, end_reason=end_reason, metadata={"rollout": meta}, end=True)
        return RolloutRecord(sid, task["id"], index, run.status, outcome, version, state.get("created_at"))

    async def _infra_caused(self, turns: list[dict[str, Any]]) -> bool:
        """A black-box agent that failed while the gateway was down or its upstream answered 5xx."""
        if not await self.api.healthy():
            return True
        last = turns[-1] if turns else None
        status = ((last or {}).get("error") or {}).get("status")
        return isinstance(status, int) and status >= 500


def format_report(report: dict[str, Any]) -> str:
    """The run's summary as a small table."""
    lines = [f"run {report['run']} ({report['mode']}): {report['rollouts']} rollouts "
             f"({report['skipped']} from an earlier run), ok {report['ok']}, timed out {report['timed_out']}, "
             f"failed {report['failed']}; passed {report['passed']}"
             + (f" ({report['success_rate']:.1%})" if report["success_rate"] is not None else "")
             + (f", mean outcome {report['mean_outcome']:.3f}" if report["mean_outcome"] is not None else "")]
    if report["by_version"]:
        lines.append(f"{'policy version':<32} {'rollouts':>8} {'tasks':>6} {'pass@1':>7} {'mean outcome':>13}")
        for version, v in report["by_version"].items():
            mean = f"{v['mean_outcome']:.3f}" if v["mean_outcome"] is not None else "-"
            lines.append(f"{version:<32} {v['rollouts']:>8} {v['tasks']:>6} {v['pass@1']:>7.3f} {mean:>13}")
    return "\n".join(lines)


FINAL_JUDGEMENTS = frozenset({"scored", "tie", "unparsable", "skipped", "dead"})


async def wait_for_scoring(gateway_url: str, session_ids: list[str], *, admin_token: str | None,
                           timeout_s: float, poll_s: float = 2.0) -> tuple[int, int]:
    """Wait until every main turn of these sessions has a final judgement (or timeout_s passed).
    Returns (finished, total) turn counts."""
    api = GatewayClient(gateway_url, admin_token=admin_token, retries=3)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            finished = total = 0
            for sid in session_ids:
                session = await api.get_session(sid)
                for t in session.get("turns") or []:
                    if t.get("turn_type") != "main" or t.get("status") != "ok":
                        continue
                    total += 1
                    finished += (t.get("judgement") or {}).get("status") in FINAL_JUDGEMENTS
            if finished == total or time.monotonic() >= deadline:
                return finished, total
            await asyncio.sleep(poll_s)
    finally:
        await api.close()
