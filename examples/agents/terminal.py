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


#: the files' names a task of each kind draws from (input, output): the names are in the prompt, so
#: tasks of one kind differ in what the model reads, not only in files it never sees
NAMES = {
    "create": ([], ["note", "word", "out", "hello", "greeting", "answer", "memo", "reply"]),
    "copy": (["data", "notes", "config", "report", "draft", "plan", "table", "story"],
             ["backup", "copy", "saved", "old", "spare", "archive", "second", "keep"]),
    "sort": (["names", "words", "list", "items", "fruits", "colors", "places", "tags"],
             ["sorted", "ordered", "abc", "result", "clean", "final", "neat", "ranked"]),
    "count": (["data", "lines", "input", "words", "rows", "entries", "records", "notes"],
              ["count", "total", "n", "size", "length", "number", "tally", "sum"]),
    "search": (["log", "app", "server", "events", "run", "build", "deploy", "jobs"],
               ["errors", "bad", "failed", "err", "problems", "issues", "alerts", "broken"]),
    "edit": (["list", "words", "names", "items", "todo", "menu", "team", "stock"], []),
}


def _task(rng: random.Random, kind: str, words: list[str], lines: str) -> dict[str, Any]:
    ins, outs = NAMES[kind]
    src = f"{rng.choice(ins)}.txt" if ins else ""
    dst = f"{rng.choice(outs)}.txt" if outs else ""
    if kind == "create":
        return {"kind": kind, "instruction": f"Create a file named {dst} that contains the word {words[0]}.",
                "files": {}, "expect": {dst: words[0] + "\n"}, "command": f"echo {words[0]} > {dst}"}
    if kind == "copy":
        return {"kind": kind, "instruction": f"Copy the file {src} to {dst}.", "files": {src: lines},
                "expect": {dst: lines}, "command": f"cp {src} {dst}"}
    if kind == "sort":
        return {"kind": kind, "instruction": f"Write the lines of {src}, sorted alphabetically, to {dst}.",
                "files": {src: lines}, "expect": {dst: "\n".join(sorted(words)) + "\n"},
                "command": f"sort {src} > {dst}"}
    if kind == "count":
        n = rng.randint(3, 9)
        data = "\n".join(rng.choice(WORDS) for _ in range(n)) + "\n"
        return {"kind": kind, "instruction": f"Write the number of lines of {src} to {dst}.",
                "files": {src: data}, "expect": {dst: f"{n}\n"}, "command": f"wc -l < {src} > {dst}"}
    if kind == "search":
        log = [f"{rng.choice(['INFO', 'ERROR'])} {w}" for w in words]
        found = [line for line in log if line.startswith("ERROR")] or [log[0]]
        log[log.index(found[0])] = "ERROR " + found[0].split()[1]
        found = [line for line in log if line.startswith("ERROR")]
        return {"kind": kind, "instruction": f"Write the lines of {src} that contain ERROR to {dst}.",
                "files": {src: "\n".join(log) + "\n"}, "expect": {dst: "\n".join(found) + "\n"},
                "command": f"grep ERROR {src} > {dst}"}
    old, new = words[1], rng.choice([w for w in WORDS if w not in words])
    return {"kind": kind, "instruction": f"In {src}, replace the word {old} with {new}.",
            "files": {src: lines}, "expect": {src: lines.replace(old, new)},
            "command": f"sed -i 's/{old}/{new}/' {src}"}


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
