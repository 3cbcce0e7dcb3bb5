"""`nextstate policy`: list, publish, promote and roll back the versions the `policy` alias serves."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from sqlalchemy import Engine

from vllm_client.http import policy_servers
from base.settings import Settings
from base.vocab import PauseMode
from nextstate.cli import options as opt

_VLLM_HELP = (
    "Base URL (…/v1) of a vLLM server that must have the version loaded; repeat for each "
    "(the policy server and the teacher replica). Default: NEXTSTATE_UPSTREAM_URL (or the "
    "local vLLM, http://127.0.0.1:$NEXTSTATE_VLLM_PORT/v1) plus NEXTSTATE_TEACHER_URL if set."
)


def _settings(database_url: str | None) -> Settings:
    return opt.settings(database_url=database_url)


@contextmanager
def _engine(database_url: str | None) -> Iterator[Engine]:
    from datapool.db import make_engine

    engine = make_engine(_settings(database_url).resolved_database_url)
    try:
        yield engine
    finally:
        engine.dispose()


def _urls(given: Sequence[str], database_url: str | None) -> list[str]:
    return list(given) if given else policy_servers(_settings(database_url))


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def _line(v: dict[str, Any]) -> str:
    return f"{v['name']} ({v['kind']}, {v['path'] or 'no path'})"


@click.group("policy", context_settings=opt.CONTEXT)
def policy_cli() -> None:
    """The versions the `policy` alias serves: list, publish, promote, roll back.

    A version is a LoRA adapter at a path of its own, loaded into every vLLM server (the
    policy server and the teacher replica) under the version's name; or (kind full) a whole
    fine-tuned checkpoint whose weights are reloaded in place into every vLLM, which keeps
    serving them under the base model's name (the servers need VLLM_SERVER_DEV_MODE=1:
    `nextstate vllm serve --dev-mode`). The pool records which version is active; every
    gateway follows it within about 2 seconds. A version becomes active only after every vLLM
    serves it, so the alias never names a model vLLM lacks.

    Statuses: candidate (published, never activated), active, retired (replaced by a newer
    one), rolled_back (rolled back from; a plain `rollback` never returns to it). A version
    tainted by `nextstate forget --taint` (it learned from forgotten data) is never served again.
    """


@policy_cli.command("list")
@opt.database_url(opt.DB_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the versions as a JSON array.")
def list_cmd(database_url: str | None, as_json: bool) -> None:
    """List every policy version, oldest first; `*` marks the one the alias serves."""
    from datapool.versions import active_version, list_versions

    with _engine(database_url) as engine:
        versions = list_versions(engine)
        active = active_version(engine)
    if as_json:
        click.echo(json.dumps(versions, indent=2))
        return
    serving = active["name"] if active else None
    click.echo(f"policy serves: {serving or 'the base model'}")
    if not versions:
        return
    rows = [("", "NAME", "KIND", "STATUS", "CREATED", "PARENT", "PATH")]
    for v in versions:
        rows.append(("*" if v["name"] == serving else "", v["name"], v["kind"], v["status"],
                     (v["created_at"] or "")[:19], v["parent"] or "-", v["path"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


@policy_cli.command("publish")
@click.argument("adapter_dir", type=click.Path(path_type=Path))
@click.option("--name", help="Version name (default: lora-<UTC time>-<random>, or full-... for a checkpoint).")
@click.option("--base-model", metavar="NAME",
              help="Base model the adapter is for, as vLLM serves it (default: "
                   "$NEXTSTATE_VLLM_SERVED_NAME, smollm2). Every vLLM must serve it.")
@click.option("--parent", metavar="VERSION", help="Version it was trained from (recorded only).")
@click.option("--activate/--candidate", default=True, show_default=True,
              help="Make it the active version, or register it as a candidate only.")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path),
              help="Directory the adapter is copied into (default: <data dir>/policies). It must "
                   "be readable by every vLLM server at the same path.")
@opt.database_url(opt.DB_HELP)
@opt.vllm_urls(_VLLM_HELP)
@opt.pause_mode
def publish_cmd(adapter_dir: Path, name: str | None, base_model: str | None, parent: str | None,
                activate: bool, store: Path | None, database_url: str | None,
                vllm_urls: tuple[str, ...], pause_mode: str) -> None:
    """Publish ADAPTER_DIR as a new version: a PEFT LoRA adapter, or a whole fine-tuned
    checkpoint (config.json + safetensors, no adapter_config.json).

    Copies it to a new directory, loads it into every vLLM (an adapter through
    /v1/load_lora_adapter; a checkpoint by pausing generation, reloading the weights in place
    and resuming), and only then registers it (active: the previous active version is
    retired). On failure nothing is registered and every vLLM serves what it served before.
    """
    from base.errors import PublishError
    from publishing.publish import PublishRequest, publish

    settings = _settings(database_url)
    with _engine(database_url) as engine:
        try:
            v = publish(engine, PublishRequest(
                adapter_dir, name=name, base_model=base_model or settings.vllm_served_name,
                vllm_urls=_urls(vllm_urls, database_url), parent=parent, stats={}, activate=activate,
                store=store, pause_mode=PauseMode(pause_mode), actor="cli"))
        except PublishError as exc:
            raise _fail(exc) from exc
    click.echo(f"published {_line(v)} as {v['status']}")


@policy_cli.command("promote")
@click.argument("version")
@opt.database_url(opt.DB_HELP)
@opt.vllm_urls(_VLLM_HELP)
@opt.pause_mode
@opt.reason
def promote_cmd(version: str, database_url: str | None, vllm_urls: tuple[str, ...], pause_mode: str,
                reason: str | None) -> None:
    """Make VERSION the one the `policy` alias serves (`base`: the base model).

    Loads it into every vLLM that lacks it first (after a vLLM restart no adapter is loaded,
    and a full version's weights are gone), then marks it active and the previously active
    version retired. Promoting the active version again just reloads it where it is missing.
    """
    from base.errors import PublishError
    from publishing.publish import activate

    with _engine(database_url) as engine:
        try:
            v = activate(engine, version, _urls(vllm_urls, database_url), pause_mode=pause_mode,  # type: ignore[arg-type]
                         actor="cli", reason=reason)
        except PublishError as exc:
            raise _fail(exc) from exc
    click.echo(f"policy serves {_line(v)}" if v else "policy serves the base model")


@policy_cli.command("rollback")
@click.argument("version", required=False)
@opt.database_url(opt.DB_HELP)
@opt.vllm_urls(_VLLM_HELP)
@opt.pause_mode
@opt.reason
def rollback_cmd(version: str | None, database_url: str | None, vllm_urls: tuple[str, ...], pause_mode: str,
                 reason: str | None) -> None:
    """Roll back from the active version, to VERSION if given (`base`: the base model).

    Without VERSION: to the newest retired version older than the active one, or to the base
    model if there is none. The version rolled back from is marked rolled_back. Servers that
    held a full version's weights reload the target's (or their base weights).
    """
    from base.errors import PublishError
    from publishing.publish import rollback

    with _engine(database_url) as engine:
        try:
            result = rollback(engine, _urls(vllm_urls, database_url), to=version,
                              pause_mode=pause_mode, actor="cli", reason=reason)  # type: ignore[arg-type]
        except PublishError as exc:
            raise _fail(exc) from exc
    v = result["active"]
    gone = ", ".join(result["rolled_back"]) or "nothing"
    click.echo(f"rolled back {gone}; policy serves " + (_line(v) if v else "the base model"))
