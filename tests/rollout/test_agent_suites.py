"""examples/agents: the task files are what the seeded generator writes, and every task is solvable:
a scripted policy that knows the answer passes it through the real tools, sandbox and pytest,
and one that does nothing fails it. The scripted policy speaks the OpenAI wire format's objects
(``tool_calls``) to the agents' own loop, in place of a model."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from examples.agents import generate, swe, terminal, toolcall

HERE = Path(generate.__file__).resolve().parent


class ScriptedClient:
    """``client.chat.completions.create`` answering with the next scripted tool call."""

    def __init__(self, calls: list[tuple[str, dict[str, Any]]],
                 idle: tuple[str, dict[str, Any]] = ("read_file", {"path": "missing.txt"})):
        self.calls, self.idle = list(calls), idle
        self.requests: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **request: Any) -> Any:
        self.requests.append(request)
        named = {"type": "function", "function": {"name": "answer"}}  # the last turn of a tool-call budget
        assert request["tools"] and request["tool_choice"] in (("required",) if len(self.requests) == 1
                                                               else ("required", "auto", named))
        name, args = self.calls.pop(0) if self.calls else self.idle
        if name == "text":  # a reply in words
            message = SimpleNamespace(content=args["content"], tool_calls=None, model_dump=lambda **_: {
                "role": "assistant", "content": args["content"]})
            return SimpleNamespace(choices=[SimpleNamespace(message=message)])
        call = SimpleNamespace(id=f"call-{len(self.requests)}", type="function",
                               function=SimpleNamespace(name=name, arguments=json.dumps(args)))
        message = SimpleNamespace(content=None, tool_calls=[call], model_dump=lambda **_: {
            "role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                                 "function": {"name": name, "arguments": json.dumps(args)}}]})
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def load(suite: str, split: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (HERE / suite / f"{split}.jsonl").read_text().splitlines()]


def test_committed_files_are_the_generators_output(tmp_path: Path) -> None:
    written = generate.write(tmp_path / "all", 200, 256)
    for name, path in written.items():
        assert path.read_bytes() == (HERE / f"{name}.jsonl").read_bytes(), f"{name}: rerun python -m examples.agents.generate"
    # prefix-stable: the first 64 held-out tasks are the 64 a shorter file holds, so --heldout 64 answers
    # the tasks every run before the file grew answered (and --final-heldout the ones after them)
    for name, path in generate.write(tmp_path / "short", 200, 64).items():
        lines = path.read_text().splitlines()
        assert lines == (HERE / f"{name}.jsonl").read_text().splitlines()[:len(lines)], name
    for suite in generate.SUITES:
        train, held = load(suite, "train"), load(suite, "heldout")
        assert len(train) >= 200 and len(held) >= 64
        text = generate.TEXT[suite]
        # every task asks something of its own (the prompt: files the model never sees do not count),
        # and no held-out prompt was trained on
        for split in (train, held):
            assert len({t[text] for t in split}) == len(split), suite
        assert not {t[text] for t in held} & {t[text] for t in train}, suite
        assert {t["level"] for t in held} == {1, 2}


def reference_toolcall(task: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    q = task["question"]
    if task["kind"] == "calc":
        return [("calculator", {"expression": q.removeprefix("What is ").rstrip("?")}), ("answer", {"value": task["answer"]})]
    if task["kind"] == "unit":
        unit = q.split(" are in ")[1].split()[1].rstrip("?")
        return [("unit_table", {"unit": unit}), ("answer", {"value": task["answer"]})]
    pid = next(w.strip(":?") for w in q.split() if w.startswith("P-"))
    return [("product_api", {"product_id": pid}), ("answer", {"value": task["answer"]})]


def test_toolcall_tools_and_verifier() -> None:
    assert toolcall.calculator("(3 + 4) * 5") == "35" and toolcall.calculator("7 / 2") == "3.5"
    assert toolcall.calculator("__import__('os')").startswith("error")
    assert toolcall.unit_table("hours") == "1 hour = 60 minutes" and toolcall.unit_table("parsec").startswith("error")
    assert json.loads(toolcall.product_api("p-101"))["id"] == "P-101"
    assert toolcall.product_api("P-999").startswith("error: 404")
    tasks = load("toolcall", "heldout")
    for task in tasks:  # the answer follows from what the tools say
        calls = reference_toolcall(task)
        result = asyncio.run(toolcall.solve(task, ScriptedClient(calls)))
        assert toolcall.verify(task, result) == 1.0, (task, result)
        if task["kind"] != "calc":  # the tool's answer holds the numbers the answer needs
            observation = result["calls"][0]["observation"]
            if task["kind"] == "unit":
                n = int(task["question"].split(" are in ")[1].split()[0])
                assert str(int(task["answer"]) // n) in observation
    assert toolcall.verify(tasks[0], asyncio.run(toolcall.solve(tasks[0], ScriptedClient([("answer", {"value": "-1"})])))) == 0.0
    # after the first (forced) tool call, a reply in words ends the episode: its last number is the answer
    lookup = next(t for t in tasks if t["level"] == 2)
    first = reference_toolcall(lookup)[0]
    for words, score in ((f"The answer is {lookup['answer']}.", 1.0), ("I am not sure.", 0.0)):
        result = asyncio.run(toolcall.solve(lookup, ScriptedClient([first, ("text", {"content": words})])))
        assert (toolcall.verify(lookup, result), result["finished"], result["text"]) == (score, True, words)
    assert toolcall.verify(tasks[0], {"answer": None}) == 0.0


def test_toolcall_budget_ends_with_a_forced_answer() -> None:
    """A level-1 question has two turns, the second a forced `answer`; level 2 has four, the
    last forced. The model's value is what is verified, whatever it is."""
    tasks = load("toolcall", "heldout")
    named = {"type": "function", "function": {"name": "answer"}}
    calc = next(t for t in tasks if t["level"] == 1)
    client = ScriptedClient([reference_toolcall(calc)[0], ("answer", {"value": "95 + 13"})])
    result = asyncio.run(toolcall.solve(calc, client))
    assert [r["tool_choice"] for r in client.requests] == ["required", named]
    assert (toolcall.verify(calc, result), result["answer"]) == (0.0, "95 + 13")
    lookup = next(t for t in tasks if t["level"] == 2)
    client = ScriptedClient([], idle=("calculator", {"expression": "1"}))
    asyncio.run(toolcall.solve(lookup, client))
    assert [r["tool_choice"] for r in client.requests] == ["required", "auto", "auto", named]


def reference_command(task: dict[str, Any]) -> str:
    """A command that does the task, written from its files (what the model reads in the prompt)."""
    (out, want), = task["expect"].items()
    src = next(iter(task["files"]), "")
    if task["kind"] == "create":
        return f"echo {shlex.quote(want.strip())} > {out}"
    if task["kind"] == "edit":
        old, new = re.search(r"replace the word (\w+) with (\w+)", task["instruction"]).groups()
        return f"sed -i 's/{old}/{new}/g' {src}"
    return {"copy": f"cp {src} {out}", "sort": f"sort {src} > {out}", "count": f"wc -l < {src} > {out}",
            "search": f"grep ERROR {src} > {out}"}[task["kind"]]


@pytest.mark.parametrize("split", ["heldout"])
def test_terminal_tasks_pass_with_the_right_command_and_fail_without(split: str) -> None:
    tasks = load("terminal", split)
    kinds = {}
    for task in tasks:
        if task["kind"] in kinds and len(kinds) < 6:
            continue
        kinds.setdefault(task["kind"], task)
    for task in kinds.values():
        command = reference_command(task)
        assert all(name in task["instruction"] for name in [*task["files"], *task["expect"]]), task
        result = asyncio.run(terminal.solve(task, ScriptedClient([("run", {"command": command})], IDLE)))
        assert terminal.verify(task, result) == 1.0, (task, result)
        assert result["calls"][0]["observation"].startswith("exit code 0")
        idle = asyncio.run(terminal.solve(task, ScriptedClient([], IDLE)))
        assert terminal.verify(task, idle) == 0.0
    assert set(kinds) == {"create", "copy", "sort", "count", "search", "edit"}


IDLE = ("run", {"command": "true"})


def test_terminal_fork_bomb_fails_the_rollout_with_its_reason() -> None:
    task = load("terminal", "heldout")[0]
    # the shell stays up while the bomb grows (as in tests/rollout/test_sandbox.py): after `wait`, which
    # waits only for its own child, it could exit and the sandbox kill the tree before a fork failed
    bomb = "bash -c ':(){ :|:& };: ; sleep 5'"
    result = asyncio.run(terminal.solve(task, ScriptedClient([("run", {"command": bomb})], IDLE)))
    assert terminal.verify(task, result) == 0.0
    assert result["failure"] and result["failure"].startswith("processes"), result


def test_swe_fix_makes_pytest_pass_and_a_wrong_edit_does_not() -> None:
    tasks = load("swe", "heldout")
    seen: dict[str, dict[str, Any]] = {}
    for task in tasks:
        seen.setdefault(task["kind"], task)
    assert len(seen) == len(swe.BUGS)
    for task in seen.values():
        path = f"{task['module']}.py"
        fix = [("read_file", {"path": path}),
               ("replace", {"path": path, "old": task["fix"]["old"], "new": task["fix"]["new"]}),
               ("run_tests", {"target": "."})]
        result = asyncio.run(swe.solve(task, ScriptedClient(fix)))
        assert swe.verify(task, result) == 1.0, result
        assert result["finished"] and result["turns"] == 3  # a passing run of the tests ends the episode
        assert "passed" in result["calls"][2]["observation"] and "failed" not in result["calls"][2]["observation"]
        wrong = [("replace", {"path": path, "old": "x * 2", "new": "x + x + 0"})]
        result = asyncio.run(swe.solve(task, ScriptedClient(wrong)))
        assert swe.verify(task, result) == 0.0 and "failed" in result["check"]
    missing = asyncio.run(swe.solve(tasks[0], ScriptedClient([("replace", {"path": "nope.py", "old": "a", "new": "b"})])))
    assert missing["calls"][0]["observation"].startswith("error: no file")


def test_generation_is_seeded() -> None:
    for suite, gen in generate.SUITES.items():
        a = [gen(random.Random(5), lvl) for lvl in (1, 2, 2)]
        b = [gen(random.Random(5), lvl) for lvl in (1, 2, 2)]
        assert a == b, suite
