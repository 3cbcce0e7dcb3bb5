"""The training pages in a real headless Chromium (Debian's `chromium`, driven by Playwright),
against a gateway process on real PostgreSQL: a person compares two versions — opens
Training, goes to the comparison, picks two versions, reads their replies to the same held-out
prompts side by side, and sends the URL to someone who opens it in a fresh browser.

Screenshots go to tests/artifacts/ (git-ignored)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from sqlalchemy.orm import Session as OrmSession

from datapool import evals, leases
from datapool.db import make_engine, upgrade
from datapool.models import Judgement, PolicyEvent, PolicyVersion, Session, Turn
from tests.support.pg import fresh_database
from tests.support.browser import require_chromium
from tests.support.processes import GatewayProcess
from tests.support import REPO

ARTIFACTS = REPO / "tests" / "artifacts"
TOKEN = "ui-train-token-" + uuid.uuid4().hex[:6]
PROMPTS = [[{"role": "user", "content": "Name a tree."}], [{"role": "user", "content": "Name a river."}],
           [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a bird."}]]
REPLIES = {"rl-a1": ["Oak.", "The Nile.", "Robin."], "rl-a2": ["A birch tree.", "Danube", "Owl <img src=x onerror=\"window.__xss=1\">"]}

require_chromium()  # skips this module, saying why, without Playwright or chromium


@pytest.fixture(scope="module")
def gateway(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    url, drop = fresh_database(pg_admin_dsn)
    upgrade(url)
    engine = make_engine(url)
    rng = random.Random(7)
    first = leases.start_run(engine, objective="opd", backend="local", config={"lr": 2e-5}, base_version=None)
    for step in range(1, 26):
        leases.record_step(engine, first, step, [], {"loss": 1.2 / step ** 0.5 + rng.uniform(-0.05, 0.05),
                                                     "kl": 0.0004 * step + rng.uniform(0, 0.0003)})
    run = leases.start_run(engine, objective="rl", backend="local", config={"lr": 1e-5, "k": 4}, base_version=None)
    for step in range(1, 41):
        leases.record_step(engine, run, step, [], {"pg_loss": 0.4 / step + rng.uniform(-0.02, 0.02),
                                                   "kl": -0.00475 + 0.0002 * step, "advantage_mean": rng.gauss(0, 0.1)})
    start = datetime.now(UTC) - timedelta(hours=12)
    with OrmSession(engine) as db, db.begin():  # judged turns of the base and each version, over 12 hours
        for i in range(72):
            version = ("smollm2", "rl-a1", "rl-a2")[min(2, i // 24)]
            sid, tid = f"s-{i}", str(uuid.uuid4())
            db.add(Session(id=sid, source="header"))
            db.flush()
            db.add(Turn(id=tid, session_id=sid, endpoint="chat", status="ok", created_at=start + timedelta(minutes=10 * i),
                        model="policy", policy_version=version, capture="white-box", request={"messages": []}))
            db.flush()
            p = {"smollm2": 0.5, "rl-a1": 0.65, "rl-a2": 0.45}[version]
            db.add(Judgement(turn_id=tid, status="scored", reward=1.0 if rng.random() < p else -1.0, attempts=1))
    with OrmSession(engine) as db, db.begin():
        parent = None
        for i, name in enumerate(REPLIES):
            v = PolicyVersion(name=name, base_model="smollm2", kind="lora", path=f"/store/{name}", parent_id=parent,
                              status=("retired", "active")[i], stats={"run_id": run, "step": i + 2})
            db.add(v)
            db.flush()
            parent = v.id
            db.add(PolicyEvent(version_id=v.id, action="eval", actor="eval-gate", metrics={
                "score": (0.667, 0.333)[i], "active_score": 0.5, "against": "smollm2", "n": 3, "threshold": 0.5}))
    for name, replies in REPLIES.items():
        evals.record_replies(engine, name, PROMPTS, replies, [1.0, 1.0, 0.0] if name == "rl-a1" else [1.0, 0.0, 0.0])
    engine.dispose()
    with GatewayProcess(tmp_path_factory.mktemp("ui-train-gw"), database_url=url, upstream_url="http://127.0.0.1:9/v1",
                        env={"NEXTSTATE_ADMIN_TOKEN": TOKEN}) as gw:
        yield gw
    drop()


def _tab(browser: Any, gateway: GatewayProcess, width: int = 1280) -> Any:
    context = browser.new_context(viewport={"width": width, "height": 900}, base_url=gateway.url)
    context.set_default_timeout(30_000)
    tab = context.new_page()
    tab.js_errors = []
    tab.on("pageerror", lambda exc: tab.js_errors.append(str(exc)))
    return tab


def _log_in(tab: Any) -> None:
    """On the login page a shared link led to: the token, then back where the link pointed."""
    assert "/admin/login" in tab.url
    tab.fill("input[name=secret]", TOKEN)
    tab.click("button[type=submit]")


def _replies(tab: Any) -> list[tuple[str, str, str]]:
    rows = tab.get_by_test_id("compare-row")
    return [(rows.nth(i).locator(".prompt").inner_text(), rows.nth(i).get_by_test_id("reply-1").inner_text(),
             rows.nth(i).get_by_test_id("reply-2").inner_text()) for i in range(rows.count())]


def test_compare_two_versions_and_share_the_view(browser: Any, gateway: GatewayProcess) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    tab = _tab(browser, gateway)
    tab.goto("/admin/training")
    _log_in(tab)
    tab.wait_for_url("**/admin/training")
    assert tab.locator("svg.chart[data-testid=chart-loss] polyline").count() == 2  # two runs, two lines
    assert tab.locator("svg.chart[data-testid=chart-reward-by-version] g.series").count() == 3
    tab.screenshot(path=str(ARTIFACTS / "training-charts.png"), full_page=True)
    # hover values without script: each point's <title> names its run, step and value
    title = tab.locator("svg.chart[data-testid=chart-loss] circle title").first.text_content()
    assert " · step " in title and "e-0" not in title
    tab.locator("tr[data-run] [data-testid=run-link]").first.click()  # the newest run: 40 steps of rl
    tab.wait_for_url("**/admin/training/runs/*")
    assert tab.get_by_test_id("run-steps").inner_text() == "40"
    assert tab.locator("svg.chart[data-testid=chart-pg_loss] polyline").count() == 1
    assert '"k": 4' in tab.get_by_test_id("run-config").inner_text()
    tab.screenshot(path=str(ARTIFACTS / "training-run.png"), full_page=True)
    tab.go_back()
    tab.wait_for_url("**/admin/training")
    tab.get_by_test_id("compare-link").click()
    tab.wait_for_url("**/admin/training/compare")
    assert tab.get_by_test_id("compare-empty").is_visible()
    tab.evaluate("window.__same_page = true")
    tab.get_by_test_id("pick-a").select_option("rl-a1")
    tab.get_by_test_id("pick-b").select_option("rl-a2")
    tab.wait_for_url("**/admin/training/compare?*b=rl-a2*")
    tab.get_by_test_id("compare-row").first.wait_for()
    assert tab.evaluate("window.__same_page") is True  # htmx swapped the comparison in place
    query = parse_qs(urlparse(tab.url).query)
    assert query == {"a": ["rl-a1"], "b": ["rl-a2"]}
    seen = _replies(tab)
    assert len(seen) == 3
    for prompt, a, b in seen:  # each prompt once, A's reply beside B's
        i = next(k for k, p in enumerate(PROMPTS) if p[-1]["content"] in prompt)
        assert REPLIES["rl-a1"][i] in a and REPLIES["rl-a2"][i] in b
    river = tab.get_by_test_id("compare-row").filter(has_text="Name a river.")
    assert "better" in river.get_by_test_id("reply-1").get_attribute("class")  # scored 1 against 0
    assert "worse" in river.get_by_test_id("reply-2").get_attribute("class")
    assert "0.667" in tab.get_by_test_id("eval-1").inner_text()
    assert "0.333" in tab.get_by_test_id("eval-2").inner_text()
    assert tab.evaluate("typeof window.__xss") == "undefined"  # a reply's markup is shown as text
    assert "<img" in seen[-1][2] or any("<img" in b for _, _, b in seen)
    tab.screenshot(path=str(ARTIFACTS / "training-compare.png"), full_page=True)
    shared = tab.url
    assert not tab.js_errors
    tab.context.close()

    # the link, opened by someone else: login, then the same comparison
    fresh = _tab(browser, gateway, width=390)
    fresh.goto(shared)
    _log_in(fresh)
    fresh.wait_for_url(shared)
    assert fresh.get_by_test_id("pick-a").input_value() == "rl-a1"
    assert fresh.get_by_test_id("pick-b").input_value() == "rl-a2"
    assert sorted(_replies(fresh)) == sorted(seen)
    fresh.screenshot(path=str(ARTIFACTS / "training-compare-390.png"), full_page=True)
    # the run the versions came from is a click away
    fresh.locator("a[href^='/admin/training/runs/']").first.click()
    fresh.wait_for_url("**/admin/training/runs/*")
    assert fresh.get_by_test_id("run-steps").inner_text() == "40"
    assert fresh.locator("[data-testid=run-versions] tr[data-version]").count() == 2
    assert not fresh.js_errors
    fresh.context.close()
