"""The admin UI on a phone and in dark mode, in Debian's chromium (Playwright): at 390x844 no
page scrolls sideways (tables become stacked cards, the turn's side panel moves below its
content); with ``prefers-color-scheme: dark`` the pages are dark; on a wide screen the side
panel sits beside the content. A gateway process on real PostgreSQL with the fill pool (every
turn state); no vLLM is needed (token texts fall back to ids).

Screenshots go to tests/artifacts/ (git-ignored); the ones in docs/ui/ were taken from here."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datapool import leases as lease
from datapool.db import make_engine, upgrade
from datapool.vocab import CaptureKind, JudgementStatus
from tests.pg import fresh_database
from tests.processes import GatewayProcess
from tests.ui_fill import CONTENTS, TurnSpec, every_state, write_session

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
PHONE = {"width": 390, "height": 844}
WIDE = {"width": 1280, "height": 900}

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
if not CHROMIUM.exists():  # pragma: no cover - CI installs it (.ci/run)
    pytest.skip("needs Debian's chromium package at /usr/bin/chromium (apt-get install -y chromium)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def pool(pg_admin_dsn: str) -> Iterator[dict[str, Any]]:
    url, drop = fresh_database(pg_admin_dsn)
    upgrade(url)
    engine = make_engine(url)
    for specs in every_state()[:-1]:  # every state; not the 200-turn session (the fill test has it)
        write_session(engine, specs)
    # the session the screenshots show: each kind of content, tools, a truncated reply, votes
    sid, ids = write_session(engine, [TurnSpec(content=c, judgement=JudgementStatus.SCORED,
                                               capture=CaptureKind.WHITE_BOX) for c in CONTENTS if c != "huge"])
    run = lease.start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    turns = lease.lease(engine, run, limit=100)
    for step in range(1, 5):
        lease.record_step(engine, run, step, turns[step - 1: step], {"pg_loss": 0.5 / step, "kl": 0.01 * step})
        time.sleep(0.02)
    lease.finish_run(engine, run, status="done")
    engine.dispose()
    yield {"url": url, "session": sid, "turns": ids}
    drop()


@pytest.fixture(scope="module")
def gateway(pool: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    # no admin credential: the UI is open (the gateway is on 127.0.0.1)
    with GatewayProcess(tmp_path_factory.mktemp("layout-gw"), database_url=pool["url"],
                        upstream_url="http://127.0.0.1:9/v1") as gw:
        yield gw


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        yield b
        b.close()


def tab(browser: Any, gateway: GatewayProcess, viewport: dict[str, int], scheme: str = "light") -> Any:
    context = browser.new_context(viewport=viewport, base_url=gateway.url, color_scheme=scheme)
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.js_errors = []
    page.on("pageerror", lambda exc: page.js_errors.append(str(exc)))
    return page


def pages(pool: dict[str, Any]) -> list[str]:
    return ["/admin/sessions", "/admin/turns", f"/admin/sessions/{pool['session']}", "/admin/judgements",
            "/admin/judgements?status=dead", "/admin/training", "/admin/queue"]


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def luminance(css: str) -> float:
    """Relative luminance (0 black … 1 white) of a computed ``rgb(...)``/``rgba(...)`` colour."""
    r, g, b = (int(x) / 255 for x in re.findall(r"[\d.]+", css)[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_no_page_scrolls_sideways_at_390px(browser: Any, gateway: GatewayProcess, pool: dict[str, Any]) -> None:
    page = tab(browser, gateway, PHONE)
    widths = {}
    for url in pages(pool):
        page.goto(url)
        page.wait_for_load_state("networkidle")
        widths[url] = page.evaluate("document.documentElement.scrollWidth")
        shot(page, "390-" + re.sub(r"\W+", "-", url.strip("/")))
    assert all(w <= PHONE["width"] for w in widths.values()), widths
    # the session list and the turns view are stacked cards, not a table wider than the screen
    page.goto("/admin/turns")
    row = page.locator("tr.turn-row").first
    assert row.evaluate("r => getComputedStyle(r).display") == "flex"
    assert row.bounding_box()["width"] <= PHONE["width"]
    assert "latency" in row.locator("td").nth(6).evaluate("td => getComputedStyle(td, '::before').content")
    # on a session page the side panel is below the content, not beside it
    page.goto(f"/admin/sessions/{pool['session']}")
    turn = page.locator(f"#turn-{pool['turns'][0]}")
    main, side = turn.locator(".turn-main").bounding_box(), turn.get_by_test_id("turn-panel").bounding_box()
    assert side["y"] >= main["y"] + main["height"] - 1 and side["width"] > 300
    assert not page.js_errors


def test_wide_screen_puts_the_panel_beside_the_content(browser: Any, gateway: GatewayProcess,
                                                      pool: dict[str, Any]) -> None:
    page = tab(browser, gateway, WIDE)
    page.goto(f"/admin/sessions/{pool['session']}")
    turn = page.locator(f"#turn-{pool['turns'][1]}")  # finish_reason length: the warning shows
    main, side = turn.locator(".turn-main").bounding_box(), turn.get_by_test_id("turn-panel").bounding_box()
    assert side["x"] >= main["x"] + main["width"] and abs(side["y"] - main["y"]) < 2
    assert main["width"] > 700  # the content has the width, not a narrow column
    assert turn.get_by_test_id("finish-warning").is_visible()
    assert "Truncated" in turn.get_by_test_id("finish-warning").inner_text()
    # tokens collapsed; opening shows the legend
    box = page.locator("details.tokens-box").first
    assert box.get_attribute("open") is None and not page.get_by_test_id("token-legend").first.is_visible()
    box.locator("summary").click()
    assert page.get_by_test_id("token-legend").first.is_visible()
    # the tools schema is collapsed too
    tools = page.get_by_test_id("tools").first
    assert tools.get_attribute("open") is None
    shot(page, "1280-session")
    assert not page.js_errors


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_colour_scheme_follows_the_system(browser: Any, gateway: GatewayProcess, pool: dict[str, Any],
                                          scheme: str) -> None:
    page = tab(browser, gateway, PHONE, scheme)
    for url in pages(pool):
        page.goto(url)
        page.wait_for_load_state("networkidle")
        body = luminance(page.evaluate("getComputedStyle(document.body).backgroundColor"))
        text = luminance(page.evaluate("getComputedStyle(document.body).color"))
        if scheme == "dark":
            assert body < 0.1 and text > 0.7, (url, body, text)
        else:
            assert body > 0.9 and text < 0.2, (url, body, text)
        # surfaces follow (cards, tables, messages): none stays white on a dark page
        for sel in (".turn", ".msg", "tbody tr", ".filters"):
            el = page.locator(sel).first
            if el.count():
                bg = el.evaluate("e => getComputedStyle(e).backgroundColor")
                if "rgba(0, 0, 0, 0)" not in bg:
                    assert (luminance(bg) < 0.25) == (scheme == "dark"), (url, sel, bg)
        if scheme == "dark":
            shot(page, "dark-390-" + re.sub(r"\W+", "-", url.strip("/")))
