"""The admin web UI: server-rendered pages (Jinja2, autoescaped) made live with htmx."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy.orm import Session as OrmSession

from base.errors import LabelError, RequestError, PublishError, VersionNotFound
from datapool import browse, evals, labels, queries, training_view, versions
from base.vocab import CaptureKind, TurnKind
from gateway import actions, auth
from gateway.auth import Admin, require_ui
from gateway.clients import profiles, words_of
from gateway.pool import in_pool, in_thread
from gateway.state import Gateway, gateway_of
from gateway.tenants import tenant_of_request as _tenant  # the login's tenant; None: the admin
from gateway.ui import branches, facts, markup, plots, tokens

HERE = Path(__file__).parent
env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                  trim_blocks=True, lstrip_blocks=True)


def _reward(value: Any) -> str:
    """A reward as the UI prints it: ``+1.00``; "–" for anything that is not a number (None, a
    missing key of a turn without a judgement: jinja's ``Undefined``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–"
    return f"{value:+.2f}"


def _num(value: Any) -> str:
    """A metric as the UI prints it: four significant digits without an exponent (``nan``,
    ``inf`` as such); "–" for None; anything else as text."""
    if value is None:
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return plots.value_label(float(value))
    return str(value)


env.filters["reward"] = _reward
env.filters["num"] = _num
env.filters["when"] = lambda v: "" if v is None else (v.strftime("%Y-%m-%d %H:%M:%S") if hasattr(v, "strftime")
                                                         else str(v)[:19].replace("T", " "))
env.globals["content_text"] = browse.content_text
env.globals["urlencode"] = urlencode
env.globals.update(markdown=markup.markdown, plain=markup.plain, turn_facts=facts.turn_facts,
                   question=facts.question, prob_legend=tokens.PROB_LEGEND, gap_legend=tokens.GAP_LEGEND)

public = APIRouter(prefix="/admin", include_in_schema=False)
router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_ui)])


def render(request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    """A page; in open mode (no auth configured) the first one sets the anonymous session cookie
    whose CSRF token the forms then carry."""
    admin: Admin | None = getattr(request.state, "admin", None)
    cookie = None
    if admin is not None and admin.csrf is None and admin.via == "open":
        cookie, csrf = auth.new_session(gateway_of(request).settings, "anonymous")
        admin = Admin(name="anonymous", csrf=csrf, via="open")
    html = env.get_template(template).render(request=request, admin=admin, path=request.url.path,
                                             auth_configured=auth.configured(gateway_of(request).settings), **ctx)
    response = HTMLResponse(html, status_code=status)
    if cookie:
        auth.set_cookie(response, request, cookie)
    return response


def error_page(request: Request, status: int, message: str, request_id: str | None) -> Response:
    """The UI's page for an error: a refused request's message; for an unexpected error, the
    request id the log has. An htmx request gets the bare paragraph to show in place."""
    if request_id is not None:
        message = "Something went wrong on the server while building this page."
    titles = {400: "Bad request", 401: "Log in first", 403: "Refused", 404: "Not found", 405: "Not allowed"}
    try:
        return render(request, "error.html", status=status, request_id=request_id, message=message,
                      title="Server error" if request_id else titles.get(status, "Error"))
    except Exception:  # the page itself could not be built: the same words, without the layout
        return HTMLResponse(f"<!doctype html><title>Error · nextstate admin</title><h1>Server error</h1>"
                            f"<p>Something went wrong on the server. Request id <code>{request_id}</code> "
                            f"(the gateway's log has the details).</p>", status_code=500)


def _is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def _back(request: Request, fallback: str) -> RedirectResponse:
    ref = request.headers.get("referer") or ""
    target = ref if ref.startswith(str(request.base_url)) else fallback
    return RedirectResponse(target, status_code=303)


# --------------------------------------------------------------------------------------------
# login


@public.get("/login")
async def login_page(request: Request, next: str = "/admin/sessions") -> HTMLResponse:
    return render(request, "login.html", next=_safe_next(next), error=None)


def _safe_next(target: str) -> str:
    # only a path of this UI, never another site
    return target if target.startswith("/admin") and not target.startswith("//") else "/admin/sessions"


@public.post("/login")
async def login(request: Request) -> Response:
    form = await request.form()
    settings = gateway_of(request).settings
    secret, name = str(form.get("secret") or ""), str(form.get("name") or "").strip()[:64] or "admin"
    nxt = _safe_next(str(form.get("next") or "/admin/sessions"))
    if not auth.configured(settings):
        return RedirectResponse(nxt, status_code=303)
    tenant = None
    if not auth.check_credentials(settings, secret):
        tenant = await gateway_of(request).keys.tenant_of(secret) if secret else None
        if tenant is None:
            await asyncio.sleep(0.3)  # slows guessing a little; the real defence is a long secret
            return render(request, "login.html", status=401, next=nxt, error="Wrong token or password.")
    if tenant is not None:  # a tenant's key: that tenant's sessions and turns only
        typed = str(form.get("name") or "").strip()[:64]
        cookie, _ = auth.new_session(settings, f"{typed}@{tenant}" if typed else f"tenant:{tenant}",
                                     tenant=tenant, tenant_key=secret)
    else:
        cookie, _ = auth.new_session(settings, name)
    response = RedirectResponse(nxt, status_code=303)
    auth.set_cookie(response, request, cookie)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/admin/login", status_code=303)
    response.delete_cookie(auth.COOKIE, path="/")
    return response


@router.get("")
@router.get("/")
async def home() -> RedirectResponse:
    return RedirectResponse("/admin/sessions", status_code=303)


# --------------------------------------------------------------------------------------------
# sessions


def _scoped(request: Request, f: browse.Browse) -> browse.Browse:
    """*f* within the login's tenant: a tenant's own ``tenant=`` parameter cannot widen it."""
    tenant = _tenant(request)
    return f if tenant is None else dataclasses.replace(f, tenant=tenant)


def _filters(request: Request) -> browse.Browse:
    return _scoped(request, browse.Browse.from_params(request.query_params))


async def _results(request: Request, f: browse.Browse) -> dict[str, Any]:
    gw = gateway_of(request)
    cursor = request.query_params.get("cursor") or None
    before = request.query_params.get("before") or None
    for name, value in (("cursor", cursor), ("before", before)):
        if value:
            try:
                queries.decode_cursor(value)
            except ValueError as exc:
                raise RequestError(400, str(exc), param=name) from exc

    tenant = _tenant(request)

    def run(db: OrmSession) -> dict[str, Any]:
        page, next_cursor, newer = browse.sessions_window(db, f, limit=50, cursor=cursor, before=before,
                                                          words=words_of(profiles(gw.settings)))
        return {"sessions": page, "next_cursor": next_cursor, "newer_cursor": newer, "counts": browse.counts(db, f),
                "show_tenant": tenant is None and bool(browse.filter_choices(db)["tenants"])}

    data = await in_pool(gw.engine, run)
    data["query"] = urlencode({k: v for k, v in f.params().items() if not (tenant and k == "tenant")})
    data["filters"] = f
    return data


@router.get("/sessions")
async def sessions_page(request: Request) -> Response:
    f = _filters(request)
    data = await _results(request, f)
    if _is_htmx(request) and request.headers.get("hx-target") == "results":
        return _fragment(render(request, "_rows.html", **data))
    choices = await in_pool(gateway_of(request).engine, browse.filter_choices, tenant=_tenant(request))
    return _fragment(render(request, "sessions.html", **data, **choices, modes=browse.MODES, captures=browse.CAPTURES,
                            rewards=browse.REWARDS, label_filters=labels.FILTERS, turn_types=browse.TURN_TYPES))


def _fragment(response: Response) -> Response:
    """A URL that answers htmx with a fragment and a browser with the page (what hx-push-url
    pushes): the browser must not cache one for the other, or "back" shows the bare fragment."""
    response.headers["Vary"] = "HX-Request, HX-Target"
    response.headers["Cache-Control"] = "no-store"
    return response


@router.get("/sessions/rows")
async def session_rows(request: Request) -> HTMLResponse:
    """The result list and its counts, for htmx to swap in as filters change."""
    return render(request, "_rows.html", **await _results(request, _filters(request)))


def _conversation(session: dict[str, Any]) -> list[dict[str, Any]]:
    """The session as a person reads it: blocks of messages, each assistant turn followed by
    its next state."""
    blocks: list[dict[str, Any]] = []
    prefix: list[dict[str, Any]] = []
    for t in session["turns"]:
        messages = list((t["request"] or {}).get("messages") or [])
        if t["turn_type"] != TurnKind.MAIN:
            blocks.append({"kind": "side", "turn": t, "messages": messages})
            continue
        same = len(messages) >= len(prefix) and all(
            (a.get("role"), browse.content_text(a.get("content"))) == (b.get("role"), browse.content_text(b.get("content")))
            for a, b in zip(messages, prefix))
        new = messages[len(prefix):] if same and prefix else messages
        if new:
            blocks.append({"kind": "context", "messages": new, "restart": bool(prefix) and not same})
        blocks.append({"kind": "turn", "turn": t})
        reply = ((t["response"] or {}).get("choices") or [{}])[0].get("message") or {}
        state = t["next_state"] or {}
        following = list(state.get("messages") or [])
        blocks.append({"kind": "next", "turn": t, "messages": following, "state": state})
        prefix = messages + ([reply] if reply else []) + following
    return blocks


async def _token_views(gw: Gateway, turns: list[dict[str, Any]]) -> dict[str, list[tokens.Token]]:
    white = [t for t in turns if t["capture"] == CaptureKind.WHITE_BOX and t["token_ids"]]
    base = gw.settings.local_vllm_url

    async def one(t: dict[str, Any]) -> tuple[str, list[tokens.Token]]:
        text = (t["response"] or {}).get("content") or ""
        texts = await tokens.token_texts(gw.http, base, t["upstream_model"], text, t["token_ids"]) if text else None
        teacher = (t.get("judgement") or {}).get("teacher_logprobs")
        return t["id"], tokens.tokens(texts, t["token_ids"], t["logprobs"], teacher)

    return dict(await asyncio.gather(*(one(t) for t in white[:50])))


@router.get("/sessions/{session_id}")
async def session_page(request: Request, session_id: str) -> HTMLResponse:
    gw = gateway_of(request)

    tenant = _tenant(request)

    def run(db: OrmSession) -> dict[str, Any] | None:
        s = queries.get_session(db, session_id)
        if s is None or (tenant is not None and s["tenant"] != tenant):
            return None  # another tenant's session is, to a tenant, no session at all
        return {"session": s, "labels": labels.for_turns(db, [t["id"] for t in s["turns"]]),
                "session_labels": labels.for_session(db, session_id)}

    data = await in_pool(gw.engine, run)
    if data is None:
        return render(request, "error.html", status=404, message=f"No session {session_id!r}.", title="Not found")
    data["blocks"] = _conversation(data["session"])
    data["graph"] = branches.graph(data["session"]["turns"])
    data["token_views"] = await _token_views(gw, data["session"]["turns"])
    return render(request, "session.html", **data)


# --------------------------------------------------------------------------------------------
# labels


async def _label_form(request: Request) -> tuple[str, Any]:
    form = await request.form()
    kind = str(form.get("kind") or "")
    value: Any = form.get("value")
    return kind, None if value in (None, "") and kind not in ("correction", "note") else value


async def _add_label(request: Request, **target: str) -> str | None:
    """Add the form's label to *target* (``turn_id=`` or ``session_id=``); a 400 becomes the
    error shown in the htmx fragment, anything else (or a plain form post) propagates."""
    kind, value = await _label_form(request)
    try:
        await actions.add_label(gateway_of(request), kind=kind, value=value, author=request.state.admin.name,
                                **target)
    except LabelError as exc:  # the person's input: the form shows why, in place
        if not _is_htmx(request):
            raise
        return str(exc)
    except RequestError as exc:
        if exc.status != 400 or not _is_htmx(request):
            raise
        return exc.message
    return None


@router.post("/turns/{turn_id}/labels")
async def label_turn(request: Request, turn_id: str) -> Response:
    error = await _add_label(request, turn_id=turn_id)
    if not _is_htmx(request):
        return _back(request, "/admin/sessions")
    found = await in_pool(gateway_of(request).engine, labels.for_turns, [turn_id])
    response = render(request, "_labels.html", turn_id=turn_id, lab=found.get(turn_id), error=error)
    response.headers["HX-Trigger"] = "labels-changed"  # the queue page's count listens for it
    return response


@router.post("/sessions/{session_id}/labels")
async def label_session(request: Request, session_id: str) -> Response:
    error = await _add_label(request, session_id=session_id)
    if not _is_htmx(request):
        return _back(request, f"/admin/sessions/{session_id}")
    found = await in_pool(gateway_of(request).engine, labels.for_session, session_id)
    return render(request, "_session_labels.html", session_id=session_id, slab=found, error=error)


QUEUE_PAGE = 30  # turns the queue page shows at once


@router.get("/queue")
async def queue_page(request: Request) -> HTMLResponse:
    gw = gateway_of(request)

    tenant = _tenant(request)

    def run(db: OrmSession) -> dict[str, Any]:
        items = browse.queue(db, limit=QUEUE_PAGE, tenant=tenant)
        ids = [i["turn_id"] for i in items]
        views = {t["id"]: t for t in (queries.get_turn(db, tid) for tid in ids) if t}
        return {"items": items, "views": views, "labels": labels.for_turns(db, ids),
                "remaining": browse.queue_size(db, tenant=tenant)}

    return render(request, "queue.html", shown=QUEUE_PAGE, **await in_pool(gw.engine, run))


@router.get("/queue/count")
async def queue_count(request: Request) -> HTMLResponse:
    """The queue's size as a bare number: the queue page refreshes its count after each label."""
    return HTMLResponse(str(await in_pool(gateway_of(request).engine, browse.queue_size, tenant=_tenant(request))))


# --------------------------------------------------------------------------------------------
# training


@router.get("/training")
async def training_page(request: Request) -> HTMLResponse:
    gw = gateway_of(request)

    def run(db: OrmSession) -> dict[str, Any]:
        active = queries.active_policy_version(db)
        return {"versions": training_view.versions(db), "runs": training_view.runs(db),
                "events": training_view.recent_events(db), "curves": training_view.step_curves(db),
                "by_version": training_view.by_version(db), "active": active.name if active else None,
                "heldout": evals.heldout_pass_at_1(db)}

    data = await in_pool(gw.engine, run)
    c, bv = data["curves"], data["by_version"]
    runs = plots.palette(list(c["labels"].values()))
    data["charts"] = [
        plots.line_chart("Loss per optimizer step", c["loss"], testid="chart-loss", colors=runs),
        plots.line_chart("KL to the base policy", c["kl"], testid="chart-kl", colors=runs),
        plots.line_chart("Mean advantage", c["advantage"], testid="chart-advantage", colors=runs),
        plots.line_chart("Learning latency: capture → trained (median s)", c["latency"], testid="chart-latency",
                         colors=runs),
        plots.line_chart("Held-out score of each candidate", c["eval"], testid="chart-eval", colors=runs),
        plots.line_chart(f"Reward of judged turns by policy version ({'hourly' if bv['bucket'] == 3600 else 'daily'}"
                         " mean)", bv["series"], time_axis=True, testid="chart-reward-by-version"),
    ]
    return render(request, "training.html", **data, message=request.query_params.get("msg"))


def _not_found(request: Request, message: str) -> HTMLResponse:
    return render(request, "error.html", status=404, message=message, title="Not found")


@router.get("/training/runs/{run_id}")
async def training_run_page(request: Request, run_id: str) -> HTMLResponse:
    data = await in_pool(gateway_of(request).engine, training_view.run_detail, run_id)
    if data is None:
        return _not_found(request, f"No training run {run_id!r}.")
    label = data["run"]["label"]
    data["charts"] = [plots.line_chart(key, data["series"][key], testid=f"chart-{key}")
                      for key in data["metric_keys"][:16]]
    data["charts"].append(plots.line_chart("Learning latency: capture → trained (median s)", data["latency"],
                                           testid="chart-latency"))
    evals_by_step = {label: sorted((float(v["step"]), float(v["eval"]["score"])) for v in data["versions"]
                                   if v["step"] is not None and v["eval"]
                                   and training_view.number(v["eval"].get("score")) is not None)}
    data["charts"].append(plots.line_chart("Held-out score of each candidate", evals_by_step, testid="chart-eval"))
    return render(request, "training_run.html", **data)


@router.get("/training/compare")
async def training_compare_page(request: Request) -> Response:
    """Two versions side by side (``?a=&b=``): eval results and replies to the same held-out
    prompts. Without both names, the page to pick them; an unknown name is a 404."""
    a = (request.query_params.get("a") or "").strip()
    b = (request.query_params.get("b") or "").strip()

    def run(db: OrmSession) -> dict[str, Any]:
        names = training_view.version_names(db)
        return {"names": names, "cmp": training_view.compare(db, a, b) if a and b else None}

    data = await in_pool(gateway_of(request).engine, run)
    if a and b and data["cmp"] is None:
        missing = [n for n in (a, b) if n not in data["names"]]
        return _fragment(_not_found(request, f"No policy version {', '.join(repr(n) for n in missing)}: "
                                             "nothing to compare."))
    template = "_compare.html" if _is_htmx(request) and request.headers.get("hx-target") == "compare" \
        else "training_compare.html"
    return _fragment(render(request, template, a=a, b=b, **data))


async def _confirmed(request: Request) -> tuple[dict[str, str], bool]:
    form = {k: str(v) for k, v in (await request.form()).items()}
    return form, form.get("confirm") == "yes"


@router.post("/training/promote")
async def promote(request: Request) -> Response:
    form, confirmed = await _confirmed(request)
    name = form.get("name", "").strip()
    if not name:
        raise RequestError(400, "name the version to promote", param="name")
    if not confirmed:
        return render(request, "confirm.html", action="promote", name=name,
                      active=await in_thread(versions.active_name, gateway_of(request).engine))
    try:
        result = await actions.promote(gateway_of(request), name, f"admin:{request.state.admin.name}",
                                       form.get("reason") or None)
        msg = f"Promoted {name}: `policy` serves {result['active'] or 'the base model'}."
    except VersionNotFound:
        raise  # the error page's 404, as for any page naming what does not exist
    except (PublishError, RequestError) as exc:  # refused (409), or the pool down (503): said on the page
        msg = f"Promote failed: {exc}"
    return RedirectResponse("/admin/training?" + urlencode({"msg": msg}), status_code=303)


@router.post("/training/rollback")
async def rollback(request: Request) -> Response:
    form, confirmed = await _confirmed(request)
    to = form.get("to", "").strip() or None
    if not confirmed:
        return render(request, "confirm.html", action="rollback", name=to,
                      active=await in_thread(versions.active_name, gateway_of(request).engine))
    try:
        result = await actions.rollback(gateway_of(request), to, f"admin:{request.state.admin.name}",
                                        form.get("reason") or None)
        msg = (f"Rolled back {', '.join(result['rolled_back']) or 'nothing'}: "
               f"`policy` serves {result['active'] or 'the base model'}.")
    except VersionNotFound:
        raise
    except (PublishError, RequestError) as exc:
        msg = f"Rollback failed: {exc}"
    return RedirectResponse("/admin/training?" + urlencode({"msg": msg}), status_code=303)


# --------------------------------------------------------------------------------------------
# export


@router.get("/export.{fmt}")
async def export_file(request: Request, fmt: str) -> StreamingResponse:
    return actions.export_response(gateway_of(request), _filters(request), fmt)


# --------------------------------------------------------------------------------------------
# turns: one row per turn across sessions

TURNS_PER_PAGE = 50


def turns_query(request: Request) -> tuple[browse.Browse, browse.TurnPage]:
    return _filters(request), browse.TurnPage.from_params(request.query_params)


async def turns_data(request: Request) -> dict[str, Any]:
    """The page of turns the URL names, and the URLs of its neighbours and sort headers."""
    f, p = turns_query(request)
    tenant = _tenant(request)

    def run(db: OrmSession) -> tuple[list[dict[str, Any]], bool, bool]:
        rows, more = browse.turns_page(db, f, p, limit=TURNS_PER_PAGE)
        return rows, more, tenant is None and bool(browse.filter_choices(db)["tenants"])

    rows, more, show_tenant = await in_pool(gateway_of(request).engine, run)
    # a tenant's links do not carry its tenant filter: the login scopes them anyway
    base = {**{k: v for k, v in f.params().items() if not (tenant and k == "tenant")}, **p.params()}

    def url(**change: Any) -> str:
        q = {**base, **{k: str(v) for k, v in change.items() if v not in (None, "", 0)}}
        for k, v in change.items():
            if v in (None, "", 0):
                q.pop(k, None)
        return urlencode(q)

    sorts = {s: url(sort=None if s == "time" else s,
                    order="asc" if p.sort == s and p.order == "desc" else None, offset=None)
             for s in browse.TURN_SORTS}
    return {"turns": rows, "filters": f, "page": p, "query": urlencode(base), "show_tenant": show_tenant,
            "newer": url(offset=max(0, p.offset - TURNS_PER_PAGE)) if p.offset > 0 else None,
            "older": url(offset=p.offset + TURNS_PER_PAGE) if more else None, "sorts": sorts,
            "newer_label": "← Previous" if p.sort != "time" or p.order != "desc" else "← Newer",
            "older_label": "Next →" if p.sort != "time" or p.order != "desc" else "Older →"}


@router.get("/turns")
async def turns_page(request: Request) -> Response:
    data = await turns_data(request)
    if _is_htmx(request) and request.headers.get("hx-target") == "turn-results":
        return _fragment(render(request, "_turn_rows.html", **data))
    choices = await in_pool(gateway_of(request).engine, browse.filter_choices, tenant=_tenant(request))
    return _fragment(render(request, "turns.html", **data, **choices, captures=browse.CAPTURES, rewards=browse.REWARDS,
                            label_filters=labels.FILTERS, statuses=browse.JUDGE_STATUSES, turn_types=browse.TURN_TYPES))
