"""`nextstate rollout`: an agent over a task dataset through the gateway, then optionally train."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from vllm_client.http import server_root
from base.vocab import Objective, SessionMode
from nextstate.cli import options as opt
from nextstate.cli.train import train

if TYPE_CHECKING:
    from tqdm import tqdm

    from rollout.runner import RolloutRecord, RunSummary


@click.command()
@click.option("--tasks", "tasks_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL (one JSON object a line) or Parquet file of tasks; each needs an `id`.")
@click.option("--n", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rollouts per task (a GRPO group: the sessions share group_id = the task id).")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="Rollouts running at once.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="Seconds per rollout; the agent is then stopped (a command's whole "
              "process group is killed) and the session is marked timed_out.")
@click.option("--agent", "agent_fn", metavar="MODULE:FN",
              help="White-box agent: an async function (task, client) -> result; client is an "
                   "openai.AsyncOpenAI pointed at the session's base_url. MODULE may be a file.py path.")
@click.option("--agent-cmd", metavar="TEMPLATE",
              help="Black-box agent: a shell command run once per rollout in its own working directory; "
                   "{base_url}, {session_id}, {task_file}, {model} are substituted (shell-quoted) and set "
                   "as OPENAI_BASE_URL, NEXTSTATE_SESSION_ID, NEXTSTATE_TASK_FILE, OPENAI_MODEL (plus "
                   "OPENAI_API_KEY). Its exit code, stdout, stderr and workdir are the result.")
@click.option("--verifier", "verifier_fn", metavar="MODULE:FN",
              help="(task, result, session) -> float, sync or async: the session's outcome, posted to the "
                   "gateway. `session` is GET /api/sessions/{id} (turns included).")
@click.option("--gateway", "gateway_url", metavar="URL",
              help="The gateway (http://host:port). [env NEXTSTATE_GATEWAY_URL; default http://<host>:<port>]")
@click.option("--model", default="policy", show_default=True,
              help="Model name the black-box agent is told to use ({model}, OPENAI_MODEL).")
@click.option("--eval", "evaluate", is_flag=True,
              help="Evaluation: sessions are tagged mode=eval (never trained on); reports pass@1 and "
                   "mean outcome per policy version.")
@click.option("--pass-threshold", type=float, default=1.0, show_default=True,
              help="A rollout passes when its outcome is at least this.")
@click.option("--run-name", metavar="NAME",
              help="Names the run's sessions (<run>:<task>:<index>). Default: from the task file, agent and "
                   "mode, so rerunning the same command resumes it; give a new name to roll out again.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where black-box agents run and report.json goes. Default: <data dir>/rollouts/<run>.")
@click.option("--retries", type=click.IntRange(min=0), default=3, show_default=True,
              help="Retries on infrastructure errors (gateway unreachable, 5xx); agent failures are not retried.")
@click.option("--sample", "sample", type=click.IntRange(min=1), metavar="K",
              help="Roll out K tasks of the file, drawn without replacement (--seed), instead of all of them.")
@click.option("--learnable-from", "learnable_from", multiple=True, metavar="REPORT",
              type=click.Path(exists=True, path_type=Path),
              help="With --sample: earlier runs' report.json (or their workdirs), oldest first. The K tasks are "
                   "then drawn with weight p(1-p) of their group's pass rate p in those runs, so that groups "
                   "the policy always or never passes, which give a GRPO group no signal, are drawn less "
                   "(rollout/curriculum.py). Repeatable.")
@click.option("--group-by", default="kind,level", show_default=True, metavar="FIELDS",
              help="--learnable-from: the task fields that name a task's group (a task without them is its "
                   "own group).")
@click.option("--seed", type=int, default=0, show_default=True, help="--sample: the draw's seed.")
@click.option("--then-train", is_flag=True, help="Afterwards, train on the new sessions (like `nextstate train "
              "--mode offline --since <run start>`) and publish the new version.")
@opt.objective(default=Objective.RL.value, show_default=True, help="--then-train: the objective.")
@click.option("--train-steps", type=int, help="--then-train: stop after this many optimizer steps.")
@click.option("--score-wait", type=float, default=600.0, show_default=True,
              help="--then-train: seconds to wait for the judges to score the new turns first.")
@click.option("--publish/--no-publish", default=True, show_default=True, help="--then-train: publish the version.")
@opt.model_dir("--then-train: the base model (default: the converted SmolLM2 in the cache dir).")
@opt.database_url("--then-train: the pool. [env NEXTSTATE_DATABASE_URL]")
@opt.log_level("warning")
@click.pass_context
def rollout(ctx: click.Context, tasks_path: Path, n: int, concurrency: int, timeout_s: float, agent_fn: str | None,
            agent_cmd: str | None, verifier_fn: str | None, gateway_url: str | None, model: str, evaluate: bool,
            pass_threshold: float, run_name: str | None, workdir: Path | None, retries: int, sample: int | None,
            learnable_from: tuple[Path, ...], group_by: str, seed: int, then_train: bool,
            objective: str, train_steps: int | None, score_wait: float, publish: bool, model_dir: Path | None,
            database_url: str | None, log_level: str) -> None:
    """Run an agent over a task dataset through the gateway: N sessions per task, each tagged
    with its task and group, the verifier's outcome posted to each.

    \b
    Each rollout is one session, <run>:<task>:<index>, created through the gateway's admin API
    before the agent starts (mode offline, or eval with --eval), so the agent needs only its
    base_url (<gateway>/s/<session>/v1). Rerunning the same command skips finished rollouts; one
    an interruption left half-way is kept, marked cancelled, and run again. The runner talks to
    the gateway over HTTP only (NEXTSTATE_ADMIN_TOKEN for /api/*, the first NEXTSTATE_API_KEYS
    entry for the agents).

    \b
    Examples:
      nextstate rollout --tasks examples/arithmetic/tasks.jsonl --n 4 \\
          --agent examples/arithmetic/agent.py:solve --verifier examples/arithmetic/verify.py:verify
      nextstate rollout --tasks examples/terminal/tasks.jsonl --n 2 --timeout 120 \\
          --agent-cmd "python $PWD/examples/terminal/agent.py {task_file}" \\
          --verifier examples/terminal/verify.py:verify
    """
    import asyncio

    from base.errors import InfraError, RolloutError
    from rollout import runner as ro

    opt.setup_logging(log_level)
    if (agent_fn is None) == (agent_cmd is None):
        raise click.UsageError("give exactly one of --agent MODULE:FN and --agent-cmd TEMPLATE")
    if evaluate and then_train:
        raise click.UsageError("--eval sessions are never trained on; drop --then-train or --eval")
    settings = opt.settings(database_url=database_url)
    url = server_root(gateway_url or settings.gateway_url or f"http://{settings.host}:{settings.port}")
    mode = SessionMode.EVAL if evaluate else SessionMode.OFFLINE
    api_key = settings.api_keys[0] if settings.api_keys else None
    try:
        tasks = ro.load_tasks(tasks_path)
        drawn = _draw(tasks, sample, learnable_from, group_by, seed) if sample or learnable_from else None
        tasks = drawn if drawn is not None else tasks
        agent: ro.PythonAgent | ro.CommandAgent = (
            ro.PythonAgent(agent_fn, api_key=api_key) if agent_fn
            else ro.CommandAgent(str(agent_cmd), api_key=api_key, model=model))
        verifier = ro.load_callable(verifier_fn) if verifier_fn else None
        run = run_name or ro.default_run_name(tasks_path, agent.spec, mode, drawn)
        cfg = ro.RolloutConfig(gateway_url=url, run=run, n=n, concurrency=concurrency, timeout_s=timeout_s,
                               mode=mode, retries=retries, admin_token=settings.admin_token,
                               pass_threshold=pass_threshold,
                               workdir=(workdir or settings.data_dir / "rollouts" / run).resolve())
        bar, on_done = _progress(len(tasks) * n, f"{mode} {run}", pass_threshold)
        runner = ro.Runner(cfg, agent, verifier, verifier_fn, on_done=on_done)
        click.echo(f"run {run}: {len(tasks)} tasks x {n} through {url} (rerun the same command to resume)", err=True)
        try:
            summary = asyncio.run(runner.run(tasks))
        except KeyboardInterrupt:
            bar.close()
            click.echo(f"interrupted: rerun the same command (run {run}) to resume", err=True)
            sys.exit(130)
        bar.close()
    except InfraError as exc:
        raise click.ClickException(f"{exc}\nNothing is lost: rerun the same command to resume run {run}.") from exc
    except RolloutError as exc:
        raise click.UsageError(str(exc)) from exc
    report = summary.report()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    (cfg.workdir / "report.json").write_text(json.dumps(report, indent=1))
    click.echo(ro.format_report(report))
    click.echo(f"report: {cfg.workdir / 'report.json'}")
    if then_train:
        _train_on_run(ctx, summary, url, settings.admin_token, score_wait, objective=objective, steps=train_steps,
                      publish=publish, model_dir=model_dir, database_url=database_url, log_level=log_level)


def _draw(tasks: list[dict[str, Any]], sample: int | None, reports: tuple[Path, ...], group_by: str,
          seed: int) -> list[dict[str, Any]]:
    """``--sample`` (and ``--learnable-from``): the tasks to roll out, in the file's order."""
    import random

    from base.errors import RolloutError
    from rollout.curriculum import Learnability, from_reports

    if sample is None:
        raise RolloutError("--learnable-from weights a draw: give --sample K too")
    if sample > len(tasks):
        raise RolloutError(f"--sample {sample}: the file has {len(tasks)} tasks")
    fields = tuple(f.strip() for f in group_by.split(",") if f.strip())
    docs = []
    for path in reports:
        file = path / "report.json" if path.is_dir() else path
        try:
            docs.append(json.loads(file.read_text()))
        except (OSError, ValueError) as exc:
            raise RolloutError(f"--learnable-from {file}: {exc}") from exc
    try:
        state = from_reports(tasks, docs, fields=fields) if docs else Learnability(fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise RolloutError(f"--learnable-from: {exc}") from exc
    order = {id(t): i for i, t in enumerate(tasks)}
    chosen = state.sample(tasks, sample, random.Random(seed))
    if docs:
        click.echo("task groups (rollouts, passes, weight): " + ", ".join(
            f"{g} ({r['tried']:g}, {r['passed']:g}, {r['weight']:.3f})" for g, r in state.table().items()), err=True)
    return sorted(chosen, key=lambda t: order[id(t)])


def _progress(total: int, desc: str, pass_threshold: float) -> tuple[tqdm, Callable[[RolloutRecord], None]]:
    """A progress bar of the rollouts, and the callback that moves it as each one ends."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="rollout", desc=desc, dynamic_ncols=True)
    seen: dict[str, int] = {"done": 0, "passed": 0, "timed_out": 0, "failed": 0}

    def on_done(record: RolloutRecord) -> None:
        seen["done"] += 1
        seen["passed"] += record.passed(pass_threshold)
        if record.status != "ok":
            seen[record.status] += 1
        bar.set_postfix(passed=f"{seen['passed']}/{seen['done']} ({seen['passed'] / seen['done']:.0%})",
                        timed_out=seen["timed_out"], failed=seen["failed"])
        bar.update(1)

    return bar, on_done


def _train_on_run(ctx: click.Context, summary: RunSummary, url: str, admin_token: str | None, score_wait: float,
                  **train_options: Any) -> None:
    """--then-train: wait for the judges to score the run's turns, then train on the sessions
    since the run began."""
    import asyncio
    from datetime import datetime, timezone

    from rollout import runner as ro

    ids = [r.session_id for r in summary.records]
    finished, total = asyncio.run(ro.wait_for_scoring(url, ids, admin_token=admin_token, timeout_s=score_wait))
    click.echo(f"scored {finished}/{total} turns of the run" + ("" if finished == total else
               f" after waiting {score_wait:.0f}s (is a `nextstate worker` running?)"))
    starts = [datetime.fromisoformat(r.created_at) for r in summary.records if r.created_at]
    since = min(starts).astimezone(timezone.utc).replace(tzinfo=None) if starts else None
    ctx.invoke(train, since=since, modes=(SessionMode.OFFLINE.value,), **train_options)
