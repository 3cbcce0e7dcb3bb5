"""`make test`'s grouping (tests/support/xdist_groups.py), through a real pytest-xdist run on two workers:
the modules on the shared servers run on one worker, which starts the servers once; a module that
does not use them runs on a worker of its own. pytest-xdist's own loadgroup stopped working with
pytest 9.2 without a word, so the run is checked, not the map alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO

pytest.importorskip("xdist", reason="the test extra's pytest-xdist runs the suite on two workers")

CONFTEST = """
import json, os, time
import pytest
from tests.support import xdist_groups

def pytest_configure(config):
    xdist_groups.register(config)

@pytest.fixture(scope="session")
def vllm_server():
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps({"started": os.environ["PYTEST_XDIST_WORKER"]}) + "\\n")
    return "server"

@pytest.fixture(scope="session")
def teacher_server(vllm_server):
    return "teacher"

@pytest.fixture(scope="module")
def gateway(vllm_server):  # on the servers through another fixture
    return "gateway"

def record(name):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps({"test": name, "worker": os.environ["PYTEST_XDIST_WORKER"]}) + "\\n")
    time.sleep(0.3)  # long enough that an idle worker would be handed the next group
"""

MODULES = {
    "test_a.py": "from conftest import record\n\ndef test_a1(vllm_server):\n    record('a1')\n\n"
                 "def test_a2():\n    record('a2')\n",
    "test_b.py": "from conftest import record\n\ndef test_b1():\n    record('b1')\n\ndef test_b2():\n    record('b2')\n",
    "test_c.py": "from conftest import record\n\ndef test_c1(gateway):\n    record('c1')\n",
    "test_d.py": "from conftest import record\n\ndef test_d1(teacher_server):\n    record('d1')\n",
}


# a module on the servers with a group of its own (the real agents' modules): its own worker and server
OWN_GROUP = ("import pytest\nfrom conftest import record\n\npytestmark = pytest.mark.xdist_group('agents')\n\n"
             "def test_e1(vllm_server):\n    record('e1')\n\ndef test_e2():\n    record('e2')\n")


def run_grouped(tmp_path: Path, modules: dict[str, str], workers: int) -> list[dict[str, str]]:
    """Run *modules* under pytest-xdist's loadgroup with the suite's scheduler; the recorded lines."""
    for name, text in {"conftest.py": CONFTEST, **modules}.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "RECORD": str(record), "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    env.pop("NEXTSTATE_TEST_GROUPS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadgroup",
                           "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_the_modules_on_the_servers_share_one_worker_and_one_start(tmp_path: Path) -> None:
    lines = run_grouped(tmp_path, MODULES, workers=2)
    worker = {line["test"]: line["worker"] for line in lines if "test" in line}
    assert set(worker) == {"a1", "a2", "b1", "b2", "c1", "d1"}
    # a (one test on the servers is enough), c (through a fixture) and d (the teacher): one worker
    assert worker["a1"] == worker["a2"] == worker["c1"] == worker["d1"]
    assert [line["started"] for line in lines if "started" in line] == [worker["a1"]]
    # b is a group of its own, whole on one worker: the other one, idle while the servers' group runs
    assert worker["b1"] == worker["b2"] != worker["a1"]


def test_marked_modules_get_a_worker_of_their_own_and_go_first(tmp_path: Path) -> None:
    # more plain modules than workers: the server groups are still handed out first
    # (and more tests in each than the marked module has: the tests' count alone would hand it out last)
    plain = {f"test_p{i}.py": "from conftest import record\n" + "".join(
        f"\ndef test_p{i}{j}():\n    record('p{i}{j}')\n" for j in range(3)) for i in range(4)}
    # two modules off the servers marked with one group (the ones that start servers of their own)
    marked = {f"test_{m}.py": f"import pytest\nfrom conftest import record\n\npytestmark = pytest.mark.xdist_group('own')"
              f"\n\ndef test_{m}1():\n    record('{m}1')\n" for m in ("f", "g")}
    lines = run_grouped(tmp_path, {**plain, **MODULES, "test_e.py": OWN_GROUP, **marked}, workers=3)
    worker = {line["test"]: line["worker"] for line in lines if "test" in line}
    assert worker["e1"] == worker["e2"] != worker["a1"]
    assert worker["f1"] == worker["g1"] not in {worker["a1"], worker["e1"]}
    assert worker["a1"] == worker["a2"] == worker["c1"] == worker["d1"]
    # one server start on each of the two servers' workers, none elsewhere
    assert sorted(line["started"] for line in lines if "started" in line) == sorted([worker["a1"], worker["e1"]])
    # each server group was the first thing its worker ran
    first: dict[str, str] = {}
    for line in lines:
        if "test" in line:
            first.setdefault(line["worker"], line["test"])
    assert first[worker["e1"]] == "e1" and first[worker["a1"]] in {"a1", "c1", "d1"}
    assert first[worker["f1"]] in {"f1", "g1"}
