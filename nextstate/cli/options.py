"""Option groups shared by the commands, as decorators (datasette's ``publish/common.py`` habit).

A default that a dataclass or the settings object already has is read from it (:func:`field_default`),
never written here again, so ``--help`` shows what the code does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from base.settings import Settings
from base.vocab import CaptureKind, Objective, PauseMode, SessionMode, TrainBackend, values

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def settings(**overrides: Any) -> Settings:
    """The settings with the flags that were given (None: not given) on top; a usage error if invalid."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except (ValidationError, ValueError) as exc:
        raise click.UsageError(f"invalid settings: {exc}") from exc


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "LiteLLM", "LiteLLM Router", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field *name* of *cls*."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise LookupError(f"{cls.__name__}.{name} has no default")


def choice(enum: type[StrEnum]) -> click.Choice:
    """``click.Choice`` of an enum's values (the vocabulary of ``base.vocab``)."""
    return click.Choice(values(enum))


def group(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Several option decorators as one, applied in the order given (as --help lists them)."""
    def apply(fn: F) -> F:
        for d in reversed(decorators):
            fn = d(fn)
        return fn
    return apply


def database_url(help: str = "[env NEXTSTATE_DATABASE_URL]") -> Callable[[F], F]:
    return click.option("--database-url", metavar="DSN", help=help)


DB_HELP = "SQLAlchemy URL of the pool (default: SQLite in the data dir). [env NEXTSTATE_DATABASE_URL]"


def log_level(default: str = "info") -> Callable[[F], F]:
    return click.option("--log-level", default=default, show_default=True)


def vllm_urls(help: str) -> Callable[[F], F]:
    return click.option("--vllm-url", "vllm_urls", multiple=True, metavar="URL", help=help)


pause_mode = click.option(
    "--pause-mode", type=choice(PauseMode), default=PauseMode.WAIT.value, show_default=True,
    help="Full versions only, while the weights are reloaded: `wait` lets running requests finish "
         "on the old weights first (new ones queue); `keep` freezes them and they continue on the new "
         "weights (shorter pause).")

reason = click.option("--reason", help="Why (recorded in the policy_events row).")


def objective(**kw: Any) -> Callable[[F], F]:
    return click.option("--objective", type=choice(Objective), **kw)


OBJECTIVE_HELP = ("rl: binary RL (PPO clip on r standardized within task groups, else within the batch: "
                  "--rl-baseline); opd: hindsight OPD toward the teacher logprobs of hinted turns; combined: "
                  "w_rl·A_rl + w_opd·(teacher − student).")


def label_filters(specs: tuple[str, ...]) -> tuple[str, ...]:
    """``--labels`` values checked against ``datapool.labels``."""
    from base.errors import LabelError
    from datapool.labels import check_filter

    try:
        return tuple(check_filter(s) for s in specs)
    except LabelError as exc:
        raise click.BadParameter(str(exc), param_hint="--labels") from exc


def turn_filters() -> Callable[[F], F]:
    """Which scored turns a run trains on (``datapool.leases.Filters``)."""
    return group(
        click.option("--since", type=click.DateTime(), help="Only turns captured at or after this time (UTC)."),
        click.option("--until", type=click.DateTime(), help="Only turns captured before this time (UTC)."),
        click.option("--min-abs-reward", type=float, help="Only turns with |reward| at least this."),
        click.option("--capture", type=choice(CaptureKind), help="Only this capture kind."),
        click.option("--task-id", help="Only sessions of this task."),
        click.option("--mode", "modes", multiple=True,
                     type=click.Choice([m for m in values(SessionMode) if m != SessionMode.EVAL]),
                     help="Only sessions of this mode (repeatable; default both). Eval sessions are never "
                          "trained on."),
        click.option("--labels", "label_filters", multiple=True, metavar="LABEL",
                     callback=lambda _ctx, _param, value: label_filters(value),
                     help="Only turns carrying this label (repeatable; all must hold): labeled, unlabeled, "
                          "thumb-up, thumb-down, override, correction, or tag:NAME. Turns a person excluded "
                          "are never trained on."),
        click.option("--new-only", is_flag=True,
                     help="Only turns no earlier run trained on: for periodic runs (e.g. a Kubernetes CronJob of "
                          "--backend verl), each training on what arrived since the last."),
    )


def backend() -> Callable[[F], F]:
    return click.option("--backend", type=choice(TrainBackend), default=TrainBackend.LOCAL.value, show_default=True,
                        help="local: torch + peft on the CPU or one GPU. verl: veRL's Ray trainer, FSDP over --gpus "
                             "GPUs on each of --nnodes nodes (docs/trainer-verl.md).")


def model_dir(help: str) -> Callable[[F], F]:
    return click.option("--model-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), help=help)
