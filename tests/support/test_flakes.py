"""The flake ledger (tests/support/flakes.py) through a real pytest run the way `make test` runs it: two
pytest-xdist workers, the grouping plugin, ``--reruns 1``. A test that fails once and then passes leaves
the run green, in the ledger and in the summary line; one that fails twice fails the run and is no flake."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.flakes import HEADER, row

pytest.importorskip("xdist", reason="the test extra's pytest-xdist runs the suite on two workers")
pytest.importorskip("pytest_rerunfailures", reason="the test extra's pytest-rerunfailures re-runs a failed test")

CONFTEST = """
import os
import pytest
from tests.support import flakes, xdist_groups

def pytest_configure(config):
    xdist_groups.register(config)
    flakes.register(config)

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["RECORD"], "a") as f:
        f.write("setup\\n")
    yield "shared"
    with open(os.environ["RECORD"], "a") as f:
        f.write("teardown\\n")
"""

# fails on its first run only: the marker file says it ran before
ONCE = """
import os
from pathlib import Path

def test_before(shared):
    pass

def test_once(shared):
    marker = Path(os.environ["RECORD"]).with_name("ran-once")
    if not marker.exists():
        marker.touch()
        assert False, "first run fails"

def test_after(shared):
    pass
"""

ALWAYS = """
def test_always():
    assert 1 == 2, "fails every time"
"""


def run(folder: Path) -> subprocess.CompletedProcess[str]:
    folder.joinpath("conftest.py").write_text(textwrap.dedent(CONFTEST))
    path = os.pathsep.join(p for p in (str(folder), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "RECORD": str(folder / "record.txt"), "PYTHONPATH": path}
    env.pop("NEXTSTATE_TEST_GROUPS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--reruns", "1",
                           "-p", "no:cacheprovider", "-q", "--rootdir", str(folder), "-c", os.devnull, str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_a_test_that_passes_on_its_rerun_keeps_the_run_green_and_is_in_the_ledger(tmp_path: Path) -> None:
    (tmp_path / "test_once.py").write_text(textwrap.dedent(ONCE))
    done = run(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    nodeid = "test_once.py::test_once"
    assert f"1 flaked (passed on re-run): {nodeid}; ledger: " in out, out
    ledger = (tmp_path / "tests" / "flakes.md").read_text()
    assert ledger.startswith(HEADER)
    (entry,) = ledger[len(HEADER):].splitlines()
    assert f"`{nodeid}`" in entry and "first run fails" in entry
    assert entry in out  # printed too: a CI run keeps only its output
    assert "AssertionError" in out  # with the first failure's traceback
    # the module-scoped fixture outlived the failure: made once, torn down once, after the module's last test
    assert (tmp_path / "record.txt").read_text().splitlines() == ["setup", "teardown"]


def test_a_test_that_fails_its_rerun_fails_the_run_and_is_no_flake(tmp_path: Path) -> None:
    (tmp_path / "test_once.py").write_text(textwrap.dedent(ONCE))
    (tmp_path / "test_always.py").write_text(textwrap.dedent(ALWAYS))
    done = run(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "FAILED test_always.py::test_always" in out
    assert "1 flaked (passed on re-run): test_once.py::test_once; ledger: " in out, out
    ledger = (tmp_path / "tests" / "flakes.md").read_text()
    assert "test_once.py::test_once" in ledger and "test_always" not in ledger


def test_a_ledger_row_keeps_its_table_whole() -> None:
    line = row("2026-01-02", "t.py::test[a|b]", "assert 'x|y' == `z`", "")
    assert line == "| 2026-01-02 | `t.py::test[a\\|b]` | assert 'x\\|y' == 'z' | ? |"
