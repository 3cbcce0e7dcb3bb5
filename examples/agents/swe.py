"""SWE suite: tiny Python repositories with one failing unit test; the outcome is pytest's verdict.

    nextstate rollout --tasks examples/agents/swe/train.jsonl --n 8 \\
        --agent examples/agents/swe.py:solve --verifier examples/agents/swe.py:verify

The agent reads and edits files through tools (``replace``, ``run_tests``, ``read_file``;
up to ``MAX_TURNS`` turns, ending early when its run of the tests passes) inside its rollout's
:class:`rollout.sandbox.Sandbox`; then pytest runs there once more and its exit status decides
the outcome (``check``).
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.agents.loop import run_tools, tool  # noqa: E402
from examples.agents.terminal import _ensure, sandbox_root  # noqa: E402
from rollout.sandbox import Limits, Sandbox  # noqa: E402

SYSTEM = ("You fix a bug in a small Python repository so that its tests pass. Tools: replace swaps one exact "
          "piece of text in a file for another, run_tests runs pytest, read_file shows a file. Make the smallest "
          "edit that fixes the bug.")
# no `done` tool: the base model picked it on the first turn; the episode ends when run_tests passes
TOOLS = [tool("replace", "Replace the exact text old with new in a file.", path="the file", old="exact text now in "
              "the file", new="the text to put instead"),
         tool("run_tests", "Run the tests with pytest.", target="a test file, or . for all"),
         tool("read_file", "Show a file of the repository.", path="for example calc.py")]
MAX_TURNS = 4
LIMITS = Limits(wall_s=30, cpu_s=20, memory_mb=1024, file_mb=1, disk_mb=16, processes=32)
# only pytest itself: the host's plugins (asyncio, hypothesis, ...) would add warnings and start-up time
PYTEST = ["env", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", "python3", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
          "--no-header", "-rN"]

# (function source with {op}, name, good op, bad op, a call and its right value)
BUGS = [
    ("def {f}(a, b):\n    return a {op} b\n", "+", "-", lambda a, b: a + b, "add"),
    ("def {f}(a, b):\n    return a {op} b\n", "*", "+", lambda a, b: a * b, "multiply"),
    ("def {f}(a, b):\n    return a {op} b\n", "-", "+", lambda a, b: a - b, "subtract"),
    ("def {f}(a, b):\n    return a if a {op} b else b\n", ">", "<", lambda a, b: max(a, b), "larger"),
    ("def {f}(a, b):\n    return a if a {op} b else b\n", "<", ">", lambda a, b: min(a, b), "smaller"),
    ("def {f}(a, b):\n    return a {op} b\n", "//", "%", lambda a, b: a // b, "quotient"),
]
MODULES = ["calc", "mathops", "numbers_util", "arith", "ops"]
OTHER = "def double(x):\n    return x * 2\n"


def generate(rng: random.Random, level: int) -> dict[str, Any]:
    """Level 1 names the buggy line in the instruction; level 2 shows only the failing test."""
    template, good, bad, fn, name = rng.choice(BUGS)
    module = rng.choice(MODULES)
    a, b = rng.randint(7, 30), rng.randint(2, 6)
    source = OTHER + "\n\n" + template.format(f=name, op=bad)
    test = (f"from {module} import double, {name}\n\n\ndef test_double():\n    assert double(4) == 8\n\n\n"
            f"def test_{name}():\n    assert {name}({a}, {b}) == {fn(a, b)}\n")
    buggy_line = template.format(f=name, op=bad).splitlines()[1].strip()
    instruction = (f"The test test_{name} in test_{module}.py fails: {name}({a}, {b}) should be {fn(a, b)}. "
                   f"Fix the bug in {module}.py.")
    if level == 1:
        instruction += f" The bug is in the line: {buggy_line}"
    return {"kind": name, "instruction": instruction, "module": module,
            "files": {f"{module}.py": source, f"test_{module}.py": test}, "fix": {"old": f" {bad} ", "new": f" {good} "}}


def check(task: dict[str, Any], sandbox_result: Any) -> tuple[bool, str]:
    """pytest's verdict, from its run at the end of the episode (exit status 0: every test passed)."""
    return sandbox_result.exit_code == 0 and sandbox_result.violation is None, (sandbox_result.output[-300:] or "")


async def solve(task: dict[str, Any], client: Any) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"{task['id']}-", dir=_ensure(sandbox_root())))
    tests = [f"test_{task['module']}.py"]
    with Sandbox(root, LIMITS, files=task["files"]) as sandbox:
        async def execute(name: str, args: dict[str, Any]) -> tuple[str, bool]:
            if name == "read_file":
                text = sandbox.read(str(args.get("path", "")).strip())
                return (text if text is not None else f"error: no file {args.get('path')!r}"), False
            if name == "replace":
                path, old, new = (str(args.get(k, "")) for k in ("path", "old", "new"))
                text = sandbox.read(path.strip())
                if text is None:
                    return f"error: no file {path!r}", False
                if not old or old not in text:
                    return f"error: the text {old!r} is not in {path}", False
                sandbox.write(path.strip(), text.replace(old, new, 1))
                return f"replaced 1 occurrence in {path}", False
            if name == "run_tests":
                ran = await sandbox.run(PYTEST + tests)
                return ran.output[-1500:].strip() or f"exit code {ran.exit_code}", ran.exit_code == 0
            return f"error: unknown tool {name!r}", False

        episode = await run_tools(client, task, SYSTEM, task["instruction"], TOOLS, execute,
                                  max_turns=int(task.get("max_turns", MAX_TURNS)))
        final = await sandbox.run(PYTEST + tests)
        passed, detail = check(task, final)
        failure = sandbox.failure
    return episode.as_result() | {"passed": passed and failure is None, "check": detail, "failure": failure}


def verify(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any] | None = None) -> float:
    return 1.0 if result.get("passed") else 0.0
