"""Terminal suite: file and text tasks (create, copy, sort, count, search, edit) in a sandbox.

    nextstate rollout --tasks examples/agents/terminal/train.jsonl --n 8 \\
        --agent examples/agents/terminal.py:solve --verifier examples/agents/terminal.py:verify

Each rollout gets its own :class:`rollout.sandbox.Sandbox` holding the task's files; the model
runs shell commands there (``run``), up to ``MAX_TURNS`` of them. The task's
check then reads the files (``check``), before the sandbox is removed; ``verify`` reports it.
A command that hits a limit (time, CPU, memory, disk, processes, network) fails the rollout
with that reason.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.agents.loop import run_tools, tool  # noqa: E402
from rollout.sandbox import Limits, Sandbox  # noqa: E402

SYSTEM = ("You operate a Linux shell in a directory with the task's files. Call run with one shell command "
          "that does the task.")
# one tool: a `done` tool was the base model's pick on every first turn (the episode over before any command)
TOOLS = [tool("run", "Run one shell command in the working directory.", max_length=120, command="the shell command")]
MAX_TURNS = 3
LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=512, file_mb=4, disk_mb=16, processes=32)

WORDS = ["apple", "river", "green", "stone", "cloud", "tiger", "piano", "maple", "ocean", "lemon", "amber", "frost",
         "cedar", "delta", "ember", "flint", "grape", "honey", "ivory", "jelly", "koala", "lunar", "mango", "nylon"]


def sandbox_root() -> Path:
    """Where rollouts' sandboxes go: $NEXTSTATE_SANDBOX_ROOT, else the system's temp directory."""
    return Path(os.environ.get("NEXTSTATE_SANDBOX_ROOT") or tempfile.gettempdir()) / "nextstate-sandboxes"


def generate(rng: random.Random, level: int) -> dict[str, Any]:
    """Level 1 gives the command (``Run: echo grape > out.txt``): the base model copies what it is
    shown, and fills in no placeholder (``echo WORD > FILE`` came back as is); level 2 only says
    what to do (sort, count, search, edit, create, copy)."""
    words = rng.sample(WORDS, 6)
    lines = "\n".join(words) + "\n"
    kind = rng.choice(["create", "copy", "sort", "count", "search", "edit"])
    task = _task(rng, kind, words, lines)
    if level == 1:
        task["instruction"] += f" Run: {task['command']}"
    return task


def _task(rng: random.Random, kind: str, words: list[str], lines: str) -> dict[str, Any]:
    if kind == "create":
        out = f"{rng.choice(['note', 'word', 'out', 'hello'])}.txt"
        return {"kind": kind, "instruction": f"Create a file named {out} that contains the word {words[0]}.",
                "files": {}, "expect": {out: words[0] + "\n"}, "command": f"echo {words[0]} > {out}"}
    if kind == "copy":
        return {"kind": kind, "instruction": "Copy the file data.txt to backup.txt.", "files": {"data.txt": lines},
                "expect": {"backup.txt": lines}, "command": "cp data.txt backup.txt"}
    if kind == "sort":
        return {"kind": kind, "instruction": "Write the lines of names.txt, sorted alphabetically, to sorted.txt.",
                "files": {"names.txt": lines}, "expect": {"sorted.txt": "\n".join(sorted(words)) + "\n"},
                "command": "sort names.txt > sorted.txt"}
    if kind == "count":
        n = rng.randint(3, 9)
        data = "\n".join(rng.choice(WORDS) for _ in range(n)) + "\n"
        return {"kind": kind, "instruction": "Write the number of lines of data.txt to count.txt.",
                "files": {"data.txt": data}, "expect": {"count.txt": f"{n}\n"}, "command": "wc -l < data.txt > count.txt"}
    if kind == "search":
        log = [f"{rng.choice(['INFO', 'ERROR'])} {w}" for w in words]
        found = [line for line in log if line.startswith("ERROR")] or [log[0]]
        log[log.index(found[0])] = "ERROR " + found[0].split()[1]
        found = [line for line in log if line.startswith("ERROR")]
        return {"kind": kind, "instruction": "Write the lines of log.txt that contain ERROR to errors.txt.",
                "files": {"log.txt": "\n".join(log) + "\n"}, "expect": {"errors.txt": "\n".join(found) + "\n"},
                "command": "grep ERROR log.txt > errors.txt"}
    old, new = words[1], rng.choice([w for w in WORDS if w not in words])
    return {"kind": kind, "instruction": f"In list.txt, replace the word {old} with {new}.",
            "files": {"list.txt": lines}, "expect": {"list.txt": lines.replace(old, new)},
            "command": f"sed -i 's/{old}/{new}/' list.txt"}


def check(task: dict[str, Any], sandbox: Sandbox) -> tuple[bool, str]:
    """Every expected file holds the expected text (trailing whitespace aside)."""
    for name, want in task["expect"].items():
        got = sandbox.read(name)
        if got is None:
            return False, f"{name} missing"
        if got.rstrip() != want.rstrip():
            return False, f"{name} differs"
    return True, "ok"


async def solve(task: dict[str, Any], client: Any) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"{task['id']}-", dir=_ensure(sandbox_root())))
    with Sandbox(root, LIMITS, files=task["files"]) as sandbox:
        async def execute(name: str, args: dict[str, Any]) -> tuple[str, bool]:
            if name != "run":
                return f"error: unknown tool {name!r}", False
            command = str(args.get("command", "")).strip()
            if not command:
                return "error: empty command", False
            ran = await sandbox.run(command)
            status = f"exit code {ran.exit_code}" if ran.exit_code is not None else "killed"
            return f"{status}\n{ran.output[-1500:]}".rstrip() + (f"\n[{ran.violation}]" if ran.violation else ""), False

        episode = await run_tools(client, task, SYSTEM, task["instruction"], TOOLS, execute,
                                  max_turns=int(task.get("max_turns", MAX_TURNS)))
        passed, detail = check(task, sandbox)
        failure = sandbox.failure
    return episode.as_result() | {"passed": passed and failure is None, "check": detail, "failure": failure}


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def verify(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any] | None = None) -> float:
    return 1.0 if result.get("passed") else 0.0
