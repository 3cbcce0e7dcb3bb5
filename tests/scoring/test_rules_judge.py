"""scoring.rules: the rule-based next-state judge, on written and generated next states."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from scoring.judge import PythonJudge, hint_is_valid
from scoring.rules import vote


def state(*tool_outputs: str, user: str | None = None, end: bool = False) -> dict:
    messages = [{"role": "tool", "tool_call_id": f"c{i}", "content": c} for i, c in enumerate(tool_outputs)]
    if user is not None:
        messages.append({"role": "user", "content": user})
    return {"messages": messages, **({"end": True} if end else {})}


FAILING = [
    "calculator(7 ** ) -> error: invalid syntax",
    "unit_table(parsec) -> error: unknown unit 'parsec'; known: hour",
    "exit code 2\nsort: cannot read: nope.txt: No such file or directory",
    "killed\n[timeout: still running after 10 s, killed]",
    "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nZeroDivisionError: division by zero",
    "F.\n=== FAILURES ===\n    assert add(2, 3) == 5\nE   assert -1 == 5\n1 failed, 1 passed in 0.02s",
    "ERROR collecting test_calc.py\n1 error in 0.05s",
    "FileNotFoundError: [Errno 2] No such file or directory: 'a.txt'",
    "subprocess.CalledProcessError: Command 'ls' returned non-zero exit status 2.",
]
PROGRESS = [
    "calculator(7*60) -> 420",
    "exit code 0\nERROR jelly\nERROR grape",  # a file's ERROR lines are output, not a failure
    "..\n2 passed in 0.01s",
    'product_api(P-101) -> {"id": "P-101", "price": 12}',
    "read_file(calc.py) -> def add(a, b):\n    return a - b\n",
]


def test_failures_vote_minus_one_with_a_grounded_hint() -> None:
    for text in FAILING:
        ns = state(text)
        v = vote({}, ns)
        assert v.value == -1, text
        assert v.hint and v.hint.startswith("The last action failed: ")
        assert hint_is_valid(v.hint, ns, [v.hint]), v.hint  # the hint gate keeps it


def test_progress_votes_plus_one() -> None:
    for text in PROGRESS:
        v = vote({}, state(text))
        assert (v.value, v.hint) == (1, None), text
    assert vote({}, state("1 passed in 0.01s")).rationale == "the tests passed"


def test_abstains_without_tool_output() -> None:
    assert vote({}, state(user="thanks")).value == 0
    assert vote({}, state(end=True)).value == 0
    assert vote({}, {"messages": []}).value == 0
    assert vote({}, state("   ")).value == 0


def test_it_is_a_python_judge() -> None:
    judge = PythonJudge("scoring.rules:vote")
    assert asyncio.run(judge.vote({}, state("exit code 1"), 0)).value == -1
    assert asyncio.run(judge.vote({}, state("exit code 0\nok"), 2)).value == 1


_plain = st.text(alphabet=st.characters(whitelist_categories=("Ll", "Lu", "Nd"), whitelist_characters=" .,\n"),
                 max_size=200).filter(lambda s: s.strip() and not any(
                     w in s.lower() for w in ("error", "failed", "killed", "exit", "traceback", "passed")))


@given(_plain, st.sampled_from(FAILING), st.integers(min_value=1, max_value=255))
def test_any_failure_signal_wins(noise: str, failure: str, code: int) -> None:
    assert vote({}, state(noise + "\n" + failure)).value == -1 or failure.split("\n")[0].startswith(
        ("calculator", "unit_table", "FileNotFoundError"))  # a tool error counts at the start of its output
    assert vote({}, state(failure + "\n" + noise)).value == -1
    assert vote({}, state(f"exit code {code}\n{noise}")).value == -1
    # one failing output among several tool outputs decides
    assert vote({}, state(f"exit code 0\n{noise}", failure)).value == -1


@given(_plain)
def test_plain_tool_output_is_progress(noise: str) -> None:
    assert vote({}, state(noise)).value == 1
    assert vote({}, state(f"exit code 0\n{noise}")).value == 1
    assert vote({}, state(user=noise)).value == 0
