"""The GPU benchmarks' own logic, without a GPU: benchmarks/gpu/shape2.py builds a trainer command
`nextstate train` accepts and reports what it measured; publish_load.py counts failures inside
the publish windows and tables both kinds. (The benchmarks themselves run on the device.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the benchmarks import the trainer")

from benchmarks.gpu import publish_load, shape2  # noqa: E402
from nextstate.cli.train import train  # noqa: E402


def args(**kw: object) -> argparse.Namespace:
    base = {"backend": "verl", "steps": 6, "batch_size": 8, "micro_batch_size": 8, "lr_full": 1e-5, "lr_lora": 1e-4,
            "model_dir": Path("/tmp/smollm2"), "upstream": "http://127.0.0.1:8501/v1", "push_every": 1,
            "pause_mode": "keep", "weight_transfer": "nccl"}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(("backend", "mode"), [("verl", "lora"), ("verl", "full"), ("local", "lora")])
def test_trainer_command_parses(backend: str, mode: str, tmp_path: Path) -> None:
    cmd = shape2.trainer_command(args(backend=backend, model_dir=tmp_path), mode, "sqlite:////tmp/pool.db")
    assert cmd[1:4] == ["-m", "nextstate.cli", "train"]
    ctx = train.make_context("train", cmd[4:])
    p = ctx.params
    assert p["backend"] == backend and p["publish"] and p["full"] == (mode == "full")
    assert p["vllm_urls"] == ("http://127.0.0.1:8501/v1",) and p["steps"] == 6
    assert p["pause_mode"] == ("keep" if mode == "full" else "wait")
    assert p["weight_transfer"] == ("nccl" if mode == "full" else "disk")
    if backend == "verl":
        assert p["push_every"] == 1 and p["gpus"] == 1


def test_failed_in_windows() -> None:
    assert publish_load.failed_in([1.0, 5.0, 9.5, 20.0], [(0.5, 2.0), (9.0, 10.0)]) == 2
    assert publish_load.failed_in([], [(0.0, 1.0)]) == 0


def test_tables_render() -> None:
    res = {
        "config": {"backend": "verl", "trainer_gpu": "1", "upstream": "u", "gateways": 2, "concurrency": 200,
                   "max_tokens": 64, "steps": 2, "batch_size": 8, "push_every": 1},
        "fill": {"scored": 64, "seconds": 3.2}, "live_user": {"scored": 10},
        "runs": [
            {"mode": "lora", "rc": 0, "seconds": 50.0, "failed_during_run": 0, "requests_during_run": 900,
             "steps": [{"seconds": 1.5}, {"seconds": 2.0}],
             "turns_per_version": {"lora-a": 40},
             "proof": {"ok": True, "policy_version": "lora-a", "expected": "lora-a"},
             "pushes": [{"active_in_pool_s": 0.2, "all_serving_s": 0.3, "lora_load_s": 0.03, "failed_during": 0,
                         "requests_during": 80},
                        {"active_in_pool_s": None, "all_serving_s": None, "lora_load_s": None}]},
            {"mode": "full", "rc": 1, "seconds": 20.0, "failed_during_run": 2, "requests_during_run": 300,
             "turns_per_version": {}, "proof": {}, "pushes": []},
        ],
        "load": {"requests": 1200, "seconds": 80.0, "failed": 2, "ttft_p50_s": 0.05, "total_p50_s": 0.4},
        "full_publish": {"rc": 0, "switch_p50_s": 0.9, "reload_s": [0.5, None], "requests": 500, "failed": 0,
                         "failed_during_publishes": 0},
        "skipped": [],
    }
    text = shape2.table(res)
    assert "| lora (exit 0, 50 s) | 2 | optimizer step s (veRL: before each push) | 1.500 | 2.000 | 2.000 |" in text
    assert "|  |  | weights written → active in the pool s | 0.200 |" in text
    assert "requests failed during the pushes **0** (of 80" in text and "**OK**" in text and "**NOT OK**" in text
    assert "vLLM pause + reload_weights + resume s | – | – | – |" in text
    assert "full-weight publish under load" in text and "0.500, –" in text

    rounds = [{"name": "v", "written_at": 0.0, "load_s": 0.4, "pool_s": 0.5, "gateways_s": [0.6], "all_serving_s": 0.6}]
    full = {"config": {"kind": "full", "pause_mode": "wait", "publishes": 1, "gateways": 1, "concurrency": 4,
                       "max_tokens": 8}, "rounds": rounds, "switch_p50_s": 0.6, "switch_p99_s": 0.6,
            "switch_max_s": 0.6, "requests": 10, "failed": 0, "failed_during_publishes": 0, "ttft_p50_s": 0.1,
            "ttft_p99_s": 0.2, "total_p50_s": 0.3, "total_p99_s": 0.4}
    text = publish_load.table(full)
    assert "publish under load (full)" in text and "vLLM pause (wait) + reload_weights + resume s | 0.400" in text
    assert "checkpoint written → every gateway serving it s | 0.600" in text
    # the switch split: publish() around vLLM's reload, then the gateways' own switch
    assert "| of which publish() outside vLLM s | 0.100 |" in text
    assert "| of which active in the pool → every gateway s | 0.100 |" in text
    assert "… checks" not in text  # a run before publish() recorded its steps
    # with publish()'s steps: checks 0.02, serving 0.43 of which vLLM's 0.40, the rest 0.05
    rounds[0]["phases_s"] = {"check_s": 0.015, "place_s": 0.005, "serve_s": 0.43}
    text = publish_load.table(full)
    assert "| … checks (files, shapes, name) s | 0.020 |" in text
    assert "| … serving step around vLLM's part s | 0.030 |" in text
    assert "| … registering it in the pool, and the rest s | 0.050 |" in text
    # and the serving step's own parts (vllm_client.weights.Reload), a step that took no time left out
    rounds[0]["reload_parts_s"] = {"pause_s": 0.004, "before_s": 0.01, "reload_s": 0.2, "confirm_s": 0.015,
                                   "digest_s": 0.0}
    text = publish_load.table(full)
    assert "| … … the pause (vLLM's /pause answered) s | 0.004 |" in text
    assert "| … … the weights: start, sent, finish, label (NCCL; from disk: the reload) s | 0.200 |" in text
    assert "| … … what it holds, read (NCCL: once paused, the pause included) s | 0.010 |" in text
    assert "| … … confirming (label, not paused, one-token completion) s | 0.015 |" in text
    assert "checksum" not in text


def test_publish_load_streams_from_processes_of_their_own(tmp_path: Path) -> None:
    """--load-procs: the streams run in other processes (the publishing one keeps its GIL), and
    what they measured comes back merged: every process's requests, none failed."""
    import asyncio

    from tests.support.processes import wait_for
    from tests.support.upstream import UpstreamProcess

    upstream = UpstreamProcess(tmp_path / "upstream.log").start()
    try:
        async def go() -> publish_load.Load:
            procs = publish_load.LoadProcesses([upstream.base_url], 5, 8, 2)
            assert [p._args[1] for p in procs.procs] == [3, 2]  # 5 workers over 2 processes
            procs.start()
            # until the upstream has had 20 requests (a spawned process imports for seconds on a loaded
            # machine): a worker sends its next request only after recording the last, so with 5 workers
            # (and the start's /models calls) at least 10 are recorded, and each in flight ends before it stops
            await asyncio.to_thread(wait_for, lambda: upstream.stats()["requests"] >= 20, 120, 0.2)
            return await procs.finish()

        load = asyncio.run(go())
    finally:
        upstream.stop()
    assert not load.failed and len(load.total) == len(load.ttft) == len(load.started_at) >= 10
    assert all(0 < t <= total for t, total in zip(sorted(load.ttft), sorted(load.total), strict=True))


SLEEPER = """
import pathlib, signal, sys, time
def stopped(*_):
    pathlib.Path("reported").write_text("what ran")
    print("report written", flush=True)  # through the tee: a stop must leave it running
    sys.exit(143)
signal.signal(signal.SIGTERM, stopped)
pathlib.Path("ready").touch()
time.sleep(120)
"""


def test_bg_stop_ends_the_benchmark_and_leaves_the_chain_and_its_tee_running(tmp_path: Path) -> None:
    """benchmarks/gpu/bg.sh stop NAME, for a lease about to end: SIGTERM reaches NAME's benchmark
    process (which writes its report), not the `| tee` its output goes through nor the shell that runs
    the chain's next step."""
    import subprocess
    import sys

    from tests.support.processes import wait_for

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bg.sh"
    tree, bg = tmp_path / "tree", tmp_path / "bg"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "sleeper.py").write_text(SLEEPER)
    env = {"PATH": "/usr/bin:/bin", "BG_DIR": str(bg), "HOME": str(tmp_path)}
    chain = f"{sys.executable} benchmarks/sleeper.py | tee out.txt; echo next step"
    subprocess.run(["bash", str(script), "start", "A", "bash", "-c", chain], cwd=tree, env=env, check=True)
    copy = bg / "tree-A"
    wait_for(lambda: (copy / "ready").exists() or None, timeout=60)
    stop = subprocess.run(["bash", str(script), "stop", "A"], cwd=tree, env=env, capture_output=True, text=True,
                          check=True)
    assert "SIGTERM to its benchmark processes" in stop.stdout
    wait_for(lambda: (bg / "A.rc").exists() or None, timeout=60)
    assert (copy / "reported").read_text() == "what ran"
    log = (bg / "A.log").read_text()
    assert "report written" in log and "next step" in log, log
    assert (bg / "A.rc").read_text().strip() == "exit 0"  # the chain went on to its next step
    again = subprocess.run(["bash", str(script), "stop", "A"], cwd=tree, env=env, capture_output=True, text=True)
    assert "no benchmark process running" in again.stdout


def test_bg_wait_for_a_job_this_machine_never_started_says_so_at_once(tmp_path: Path) -> None:
    """benchmarks/gpu/bg.sh wait on a fresh machine (the one that ran the job was given back): it
    says the job is gone and exits, instead of waiting its SECONDS on a job that is not there; a
    job started by this machine is waited for as before."""
    import subprocess
    import time

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bg.sh"
    env = {"PATH": "/usr/bin:/bin", "BG_DIR": str(tmp_path / "bg"), "HOME": str(tmp_path)}
    t0 = time.monotonic()
    gone = subprocess.run(["bash", str(script), "wait", "300", "L0"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert gone.returncode == 3 and "L0: never started on this machine" in gone.stdout
    assert time.monotonic() - t0 < 60  # not the 300 s asked for
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["bash", str(script), "start", "B", "bash", "-c", "sleep 1; echo done"], cwd=tree, env=env,
                   check=True, capture_output=True)
    waited = subprocess.run(["bash", str(script), "wait", "120", "B"], cwd=tree, env=env, capture_output=True,
                            text=True, check=True)
    assert "[bg] B: exit 0 after" in waited.stdout and "done" in waited.stdout
