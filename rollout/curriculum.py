"""Which tasks to roll out next: those the policy can learn from now.

A GRPO group whose n samples all pass, or all fail, gives every sample the same outcome and so a
zero advantage: its rollouts cost sandbox and model time and teach nothing (the agents benchmark
reports the share of groups with signal; on the terminal suite it is 12-56 %). For a task that the
current policy passes with probability p, a group of n carries signal with probability
1 - p^n - (1 - p)^n, largest at p = 1/2 and near 0 at both ends. :class:`Learnability` keeps, per
task group (a task's ``kind`` and ``level`` where the tasks carry them, else its id), a pass count
from past rollouts in which a group's older rounds count less (``decay``), and :meth:`Learnability.sample`
draws the next tasks without replacement, each with weight p̂(1 - p̂) + ``floor``, where p̂ is the
pass rate of its group smoothed by Jeffreys' prior, Beta(1/2, 1/2). A group never tried has p̂ = 1/2, the largest weight,
so every group is tried early; ``floor`` keeps solved and (so far) unsolvable groups in the draw,
so that a change in either is seen.

This is prioritised sampling by learnability, the idea of Foster and Foerster's "Learning to
Reason at the Frontier of Learnability" (2025); DAPO's dynamic sampling instead rolls out first
and drops the groups without signal afterwards. ``nextstate rollout --sample K --learnable-from
REPORT`` and the agents benchmark's ``--task-sampling learnable`` use it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Task = dict[str, Any]

#: the task fields that name its group, when it has them (the example suites': kind and level)
GROUP_FIELDS = ("kind", "level")


def group_of(task: Mapping[str, Any], fields: Sequence[str] = GROUP_FIELDS) -> str:
    """The task's group: its *fields* that it has, as ``kind/level`` text; its id when it has none."""
    parts = [str(task[f]) for f in fields if task.get(f) is not None]
    return "/".join(parts) if parts else f"id:{task['id']}"


class Learnability:
    """Decayed pass counts per task group, and weighted draws of tasks from them.

    ``decay`` (0 < decay ≤ 1) multiplies a group's counts so far when an :meth:`update` brings new
    rollouts of it, so that its round k rounds back counts decay**k as much as its last (1: all
    rounds alike); a group not rolled out keeps its counts (``floor`` draws it again now and then)."""

    def __init__(self, fields: Sequence[str] = GROUP_FIELDS, decay: float = 0.8, floor: float = 0.01):
        if not 0 < decay <= 1:
            raise ValueError(f"decay {decay}: must be in (0, 1]")
        if not 0 <= floor <= 1:
            raise ValueError(f"floor {floor}: must be in [0, 1]")
        self.fields, self.decay, self.floor = tuple(fields), decay, floor
        self.passed: dict[str, float] = {}
        self.tried: dict[str, float] = {}

    def update(self, tasks: Iterable[Mapping[str, Any]], results: Iterable[tuple[str, bool]]) -> None:
        """One round: *results* are ``(task id, passed)`` pairs of the rollouts of *tasks* (a result of
        a task not in *tasks* is an error: its group is unknown)."""
        groups = {str(t["id"]): group_of(t, self.fields) for t in tasks}
        tried: dict[str, float] = {}
        passed: dict[str, float] = {}
        for task_id, ok in results:
            try:
                key = groups[str(task_id)]
            except KeyError:
                raise KeyError(f"a result for task {task_id!r}, which is not among the tasks given") from None
            tried[key] = tried.get(key, 0.0) + 1.0
            passed[key] = passed.get(key, 0.0) + bool(ok)
        for key in tried:  # a group's older rounds count less than its new one; a group not rolled out keeps its counts
            self.tried[key] = self.tried.get(key, 0.0) * self.decay + tried[key]
            self.passed[key] = self.passed.get(key, 0.0) * self.decay + passed[key]

    def rate(self, group: str) -> float:
        """The group's pass rate so far, smoothed by Jeffreys' Beta(1/2, 1/2): 1/2 for a group never tried."""
        return (self.passed.get(group, 0.0) + 0.5) / (self.tried.get(group, 0.0) + 1.0)

    def group_weight(self, group: str) -> float:
        """A group's draw weight: p(1 - p) of its smoothed pass rate, plus ``floor``."""
        p = self.rate(group)
        return p * (1.0 - p) + self.floor

    def weight(self, task: Mapping[str, Any]) -> float:
        return self.group_weight(group_of(task, self.fields))

    def sample(self, tasks: Sequence[Task], count: int, rng: random.Random) -> list[Task]:
        """*count* distinct tasks of *tasks*, each drawn with probability proportional to its
        :meth:`weight` among those not yet drawn (Efraimidis-Spirakis: the *count* largest
        u^(1/w))."""
        if not 0 <= count <= len(tasks):
            raise ValueError(f"cannot draw {count} of {len(tasks)} tasks")
        keyed = []
        for i, task in enumerate(tasks):
            w = self.weight(task)
            u = rng.random() or math.ulp(0.0)
            keyed.append((math.log(u) / w if w > 0 else -math.inf, i))
        keyed.sort(reverse=True)
        return [tasks[i] for _, i in keyed[:count]]

    def table(self) -> dict[str, dict[str, float]]:
        """Per group: the decayed rollouts and passes, the smoothed rate and the weight (for reports)."""
        return {g: {"tried": round(self.tried[g], 3), "passed": round(self.passed[g], 3),
                    "rate": round(self.rate(g), 3), "weight": round(self.group_weight(g), 4)}
                for g in sorted(self.tried)}


def from_reports(tasks: Sequence[Task], reports: Iterable[Mapping[str, Any]], *, fields: Sequence[str] = GROUP_FIELDS,
                 decay: float = 0.8, floor: float = 0.01) -> Learnability:
    """A :class:`Learnability` from earlier runs' ``report.json`` (oldest first): their ``by_task``
    passes and rollouts, for the tasks of *tasks* (tasks of a report that are not in *tasks* are
    left out: another file's task ids do not name groups here)."""
    known = {str(t["id"]) for t in tasks}
    state = Learnability(fields, decay, floor)
    for report in reports:
        by_task = report.get("by_task")
        if not isinstance(by_task, Mapping):
            raise ValueError("a report without by_task (per-task passes): it was written before that was recorded")
        results: list[tuple[str, bool]] = []
        for task_id, row in by_task.items():
            if str(task_id) in known:
                passed, rollouts = int(row["passed"]), int(row["rollouts"])
                results += [(str(task_id), True)] * passed + [(str(task_id), False)] * (rollouts - passed)
        state.update(tasks, results)
    return state
