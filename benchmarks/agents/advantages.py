"""The advantages an agents-benchmark iteration's turns get, without a model: where they go.

    python -m benchmarks.agents.advantages [--seeds 20] [--jitter 0.6] [--turns 3] [--batch-size 64]

A GPU iteration in miniature: 16 tasks x 8 episodes (one GRPO group per task), 4 of the 16 tasks
with some successes (the GPU runs' 6-25 % of groups with signal at temperature 1), each episode of
``--turns`` turns (terminal: always 3; toolcall 1-4: ``--turns 1,2,3,4``), every turn a model call
and a command of jittered length, all episodes at once, so the pool's lease order (created_at)
interleaves turns of different steps. The integrated arm adds the rule judge's −1 votes on a
quarter of the turns (mostly of failed episodes). Each turn's advantage comes from
``trainer.objectives`` as the local trainer takes it, on two paths:

- ``step``: what the GPU runs trained with: each optimizer step's ``--batch-size`` turns leased
  alone, R_t standardized per step index across them, then within the task's group;
- ``iteration``: ``--advantage-scope iteration --integrated-norm group``: the iteration's turns at
  once (``trainer.offline.mini_batches``), R_t only within the whole group;
- ``iteration, dense``: the benchmark's ``--integrated-norm dense``: the outcome's advantage in the
  group plus the votes' bounded, centred credit (``trainer.offline.batch_advantages``, ``trainer.rewards.vote_credit``).

Prints, per arm and path, for the turns of groups with no signal (all failed or all passed) and of
groups with signal: the share with A ≠ 0, the mean A and |A|, and their share of Σ|A|.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from trainer import objectives  # noqa: E402
from trainer.objectives import ObjectiveConfig  # noqa: E402
from trainer.offline import mini_batches  # noqa: E402
from trainer.samples import Sample  # noqa: E402


def iteration(seed: int, arm: str, *, turns: list[int], jitter: float, tasks: int = 16,
              n: int = 8) -> list[tuple[Sample, bool]]:
    """The iteration's turns in lease order, each with whether its episode passed."""
    rng = random.Random(seed)
    rates = [0.0] * (tasks - 4) + [0.25, 0.5, 0.5, 0.75]
    rng.shuffle(rates)
    rows = []
    for t in range(tasks):
        for e in range(n):
            ok = rng.random() < rates[t]
            clock = 0.0
            for k in range(rng.choice(turns)):
                clock += 1.0 + rng.uniform(-jitter, jitter)
                vote = -1.0 if arm == "integrated" and rng.random() < 0.25 and (not ok or rng.random() < 0.3) else 0.0
                rows.append((clock, Sample(
                    turn_id=f"{t}-{e}-{k}", session_id=f"{t}-{e}", group_id=f"task{t}", step_index=k, prompt_ids=[1],
                    response_ids=[1], behaviour_logprobs=None, teacher_logprobs=None, reward=vote,
                    integrated_reward=float(ok) + vote, capture="white_box"), ok))
    rows.sort(key=lambda r: r[0])
    return [(s, ok) for _, s, ok in rows]


def step_path(rows: list[tuple[Sample, bool]], batch_size: int) -> list[float]:
    out: list[float] = []
    cfg = ObjectiveConfig(integrated_norm="step")
    for lo in range(0, len(rows), batch_size):
        batch = [s for s, _ in rows[lo:lo + batch_size]]
        mask = torch.ones((len(batch), 1))
        tok = objectives.scores_to_token_rewards(objectives.sample_rewards(batch), mask)
        out += objectives.compute_advantages(cfg, response_mask=mask, token_level_rewards=tok,
                                             index=[s.group_id for s in batch])[:, 0].tolist()
    return out


def iteration_path(rows: list[tuple[Sample, bool]], batch_size: int, norm: str = "group") -> list[float]:
    parts = mini_batches([s for s, _ in rows], ObjectiveConfig(integrated_norm=norm), batch_size)
    adv = {s.turn_id: float(s.reward or 0.0) for p in parts for s in p}
    return [adv[s.turn_id] for s, _ in rows]


def dense_path(rows: list[tuple[Sample, bool]], batch_size: int) -> list[float]:
    return iteration_path(rows, batch_size, "dense")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--jitter", type=float, default=0.6, help="± share of a turn's mean length")
    p.add_argument("--turns", default="3", help="episode lengths to draw from, comma-separated")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    turns = [int(x) for x in args.turns.split(",")]
    print("| arm | path | turns of | turns | A ≠ 0 | mean A | mean abs A | share of Σ abs A |")
    print("|---|---|---|---|---|---|---|---|")
    for arm in ("outcome", "integrated"):
        for name, path in (("step", step_path), ("iteration", iteration_path), ("iteration, dense", dense_path)):
            cats: dict[str, list[float]] = defaultdict(list)
            for seed in range(args.seeds):
                rows = iteration(seed, arm, turns=turns, jitter=args.jitter)
                groups: dict[str, set[bool]] = defaultdict(set)
                for s, ok in rows:
                    groups[s.group_id or ""].add(ok)
                for (s, ok), a in zip(rows, path(rows, args.batch_size), strict=True):
                    kind = ("no-signal group" if len(groups[s.group_id or ""]) == 1
                            else f"signal group, {'success' if ok else 'failure'}")
                    cats[kind].append(a)
            total = sum(abs(x) for v in cats.values() for x in v)
            for kind, v in sorted(cats.items()):
                print(f"| {arm} | {name} | {kind} | {len(v)} | {sum(abs(x) > 1e-9 for x in v) / len(v):.1%} | "
                      f"{statistics.fmean(v):+.3f} | {statistics.fmean(abs(x) for x in v):.3f} | "
                      f"{sum(abs(x) for x in v) / total:.1%} |")


if __name__ == "__main__":
    main()
