"""`nextstate forget` and `nextstate audit`: delete a person's data and the record of who did what."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from base.vocab import AuditAction
from nextstate.cli import options as opt
from nextstate.cli.policy import _VLLM_HELP, _engine, _settings, _urls


def _summary(report: dict[str, Any]) -> str:
    deleted = report["deleted"]
    verb = "would delete" if report["dry_run"] else "deleted"
    counts = ", ".join(f"{n} {table}" for table, n in deleted.items() if n)
    lines = [f"{verb}: {counts or 'nothing'}"]
    spool = report.get("spool") or {}
    if spool.get("dir"):
        lines.append(f"spool {spool['dir']}: {spool['removed']} record(s) {'to remove' if report['dry_run'] else 'removed'}")
        for path, n in (spool.get("held") or {}).items():
            lines.append(f"  {path}: {n} record(s) still held by a running gateway (not replayed within "
                         "--wait-spool); they reach the pool when it replays its spool: run forget again then")
    if report["versions"]:
        lines.append("versions that learned from it:")
        for v in report["versions"]:
            how = v["learned"] if v["learned"] == "trained" else f"inherited from {v['via']}"
            mark = " [tainted]" if v["name"] in report["tainted"] else ""
            lines.append(f"  {v['name']} ({v['status']}, {how}){mark}")
    else:
        lines.append("no policy version learned from it")
    rb = report.get("rollback")
    if rb:
        lines.append(f"rollback failed: {rb['error']}" if "error" in rb
                     else f"rolled back from {', '.join(rb['rolled_back'])}; policy serves {rb['active'] or 'the base model'}")
    return "\n".join(lines)


@click.command("forget", context_settings=opt.CONTEXT)
@click.option("--session", "session_id", metavar="ID", help="Forget this session.")
@click.option("--tenant", metavar="NAME", help="Forget every session of this tenant.")
@click.option("--user", "end_user", metavar="ID",
              help="Forget every session with a request from this end user (the OpenAI `user` field).")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option("--taint", is_flag=True,
              help="Mark the versions that learned from the data, and their descendants, tainted: never "
                   "promoted again; if the active one is tainted, roll back to the newest clean version "
                   "(or the base model).")
@click.option("--spool-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The gateway's spool directory on this machine. Default: NEXTSTATE_SPOOL_DIR, or data_dir/spool.")
@click.option("--wait-spool", type=click.FloatRange(min=0), default=60.0, show_default=True, metavar="SECONDS",
              help="When a running gateway's spool file holds matching records, wait this long for it to "
                   "replay them into the pool, then forget again.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@opt.database_url(opt.DB_HELP)
@opt.vllm_urls(_VLLM_HELP + " Used only to roll back off a tainted active version.")
def forget(session_id: str | None, tenant: str | None, end_user: str | None, dry_run: bool, taint: bool,
           spool_dir: Path | None, wait_spool: float, as_json: bool, database_url: str | None,
           vllm_urls: tuple[str, ...]) -> None:
    """Delete a session's, a tenant's or an end user's data, and report the versions that learned from it.

    Name exactly one of --session, --tenant, --user. Deleted, in one transaction: the sessions,
    their turns and everything keyed to them (votes, judgements, labels, tool-call arguments,
    continuations, training leases) and the eval gate's stored replies to their prompts. The
    records of this machine's spool files that no running gateway holds are removed too; a
    running gateway's own file is left to it: forget waits (--wait-spool) for it to replay the
    matching records into the pool and forgets again. An audit
    entry records who ran it (cli:<os user>) and the counts. docs/security.md says what is not
    deleted (trained weights, other machines' spools, exports already written).
    """
    from datapool import audit
    from base.errors import NextstateError
    from datapool.forget import forget_waiting
    from publishing.publish import rollback_tainted

    settings = _settings(database_url)
    actor = audit.cli_actor()
    with _engine(database_url) as engine:
        try:
            report = forget_waiting(engine, wait_spool, session_id=session_id, tenant=tenant, end_user=end_user,
                                    actor=actor, dry_run=dry_run, taint=taint,
                                    spool_dir=spool_dir or settings.resolved_spool_dir)
        except NextstateError as exc:
            raise click.UsageError(str(exc)) from exc
        if report["active_tainted"] and not dry_run:
            try:
                done = rollback_tainted(engine, _urls(vllm_urls, database_url), actor=actor)
                report["rollback"] = {"active": (done["active"] or {}).get("name") if done else None,
                                      "rolled_back": list(done["rolled_back"]) if done else []}
            except NextstateError as exc:
                report["rollback"] = {"error": str(exc)}
    click.echo(json.dumps(report, indent=2) if as_json else _summary(report))
    if "error" in (report.get("rollback") or {}):
        raise SystemExit(1)


@click.command("audit", context_settings=opt.CONTEXT)
@click.option("--action", type=opt.choice(AuditAction), help="Only this action.")
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
@opt.database_url(opt.DB_HELP)
def audit_cmd(action: str | None, limit: int, as_json: bool, database_url: str | None) -> None:
    """The audit log, newest first: who forgot, tainted, promoted, rolled back, expired or
    issued/revoked a tenant key, when, and on what."""
    from sqlalchemy.orm import Session as OrmSession

    from datapool import audit

    with _engine(database_url) as engine, OrmSession(engine) as db:
        rows = audit.entries(db, action=action, limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['at']}  {r['actor']:<20} {r['action']:<10} {r['target'] or '-'}  {json.dumps(r['details'])}")
