"""Writes the three suites' task files: ``python -m examples.agents.generate [--out DIR]``.

Seeded and deterministic: the same command writes the same files, byte for byte. Each suite
gets ``train.jsonl`` (--train tasks, seed 1) and ``heldout.jsonl`` (--heldout tasks, seed 2).
A task whose prompt (the text the model reads) already occurs, in train or earlier in its own
split, is drawn again: held-out tasks are unseen, and no two tasks of a split ask the same thing,
so that pass@1 over N tasks is over N prompts (files the model never sees do not make a task
new). The
share of level-1 (easier) tasks per suite is the difficulty knob (``LEVEL1``), set so that the
base SmolLM2-135M-Instruct passes some but not most held-out tasks (docs/agents.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.agents import swe, terminal, toolcall  # noqa: E402

HERE = Path(__file__).resolve().parent
SUITES: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "toolcall": toolcall.generate, "terminal": terminal.generate, "swe": swe.generate}
LEVEL1 = {"toolcall": 0.5, "terminal": 0.4, "swe": 0.5}
TEXT = {"toolcall": "question", "terminal": "instruction", "swe": "instruction"}


def tasks(suite: str, split: str, count: int, avoid: set[str] = frozenset()) -> list[dict[str, Any]]:
    """*count* tasks of *suite*, each with a prompt of its own and none of *avoid*'s."""
    rng = random.Random(f"{suite}:{split}")
    out: list[dict[str, Any]] = []
    seen = set(avoid)
    draws = 0
    while len(out) < count:
        draws += 1
        if draws > 1000 * count:
            raise ValueError(f"{suite}: only {len(out)} distinct prompts for {split}'s {count} tasks")
        level = 1 if rng.random() < LEVEL1[suite] else 2
        task = SUITES[suite](rng, level)
        if task[TEXT[suite]] in seen:
            continue
        seen.add(task[TEXT[suite]])
        out.append({"id": f"{suite}-{split}-{len(out):04d}", "suite": suite, "level": level, **task})
    return out


def write(out: Path, train: int, heldout: int) -> dict[str, Path]:
    written = {}
    for suite in SUITES:
        d = out / suite
        d.mkdir(parents=True, exist_ok=True)
        tr = tasks(suite, "train", train)
        seen = {t[TEXT[suite]] for t in tr}
        for split, rows in (("train", tr), ("heldout", tasks(suite, "heldout", heldout, seen))):
            path = d / f"{split}.jsonl"
            path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
            written[f"{suite}/{split}"] = path
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE, help="where <suite>/{train,heldout}.jsonl go (default: here)")
    p.add_argument("--train", type=int, default=200)
    p.add_argument("--heldout", type=int, default=256,
                   help="held-out tasks per suite; the files are prefix-stable: the first N of a longer file are the N "
                        "a shorter one holds (the benchmarks' --heldout 64 answers the first 64, as before 256 were "
                        "written; --final-heldout the rest)")
    args = p.parse_args()
    for name, path in write(args.out, args.train, args.heldout).items():
        print(f"{name}: {sum(1 for _ in open(path))} tasks -> {path}")


if __name__ == "__main__":
    main()
