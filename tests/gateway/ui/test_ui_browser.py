"""The admin UI in a real headless Chromium (Debian's `chromium`, driven by Playwright), against
a gateway process on real PostgreSQL with seeded sessions and the shared vLLM-CPU servers.

Screenshots of the main pages go to tests/artifacts/ (git-ignored).
"""

from __future__ import annotations

import io
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session as OrmSession

from datapool.models import PolicyEvent
from tests.support.vllm_servers import RunningVLLM
from tests.support.browser import require_chromium
from tests.support.processes import GatewayProcess, wait_for
from tests.support.upstreams import alias_root
from tests.support.ui_seed import TOOL_WORD, XSS_USER, seed
from datapool import leases as lease
from tests.support import REPO

ARTIFACTS = REPO / "tests" / "artifacts"
TOKEN, PASSWORD = "ui-test-token-" + uuid.uuid4().hex[:6], "ui-test-password"

require_chromium()  # skips this module, saying why, without Playwright or chromium


@pytest.fixture(scope="module")
def ids(module_engine: Any, vllm_server: RunningVLLM) -> dict[str, str]:
    root = vllm_server.base_url.removesuffix("/v1")

    def tokenize(text: str) -> list[int]:  # real token ids, so the token view can show texts
        r = httpx.post(f"{root}/tokenize", json={"model": vllm_server.model, "prompt": text,
                                                 "add_special_tokens": False}, timeout=30)
        return r.json()["tokens"]

    found = seed(module_engine, tokenize)
    # a finished training run, so the curves have points
    run = lease.start_run(module_engine, objective="rl", backend="local", config={}, base_version=None)
    turns = lease.lease(module_engine, run, limit=100)
    for step in range(1, 6):
        lease.record_step(module_engine, run, step, turns[step - 1: step], {
            "pg_loss": 0.5 / step, "kl": 0.01 * step, "advantage_mean": 0.2 - 0.05 * step,
            "tokens_per_s": 900.0 + step, "samples": 1.0})
        time.sleep(0.05)
    lease.finish_run(module_engine, run, status="done")
    return found


@pytest.fixture(scope="module")
def gateway(module_db_url: str, ids: dict[str, str], vllm_server: RunningVLLM, teacher_server: RunningVLLM,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    env = {"NEXTSTATE_ADMIN_TOKEN": TOKEN, "NEXTSTATE_ADMIN_PASSWORD": PASSWORD,
           "NEXTSTATE_TEACHER_URL": teacher_server.base_url}
    with GatewayProcess(tmp_path_factory.mktemp("ui-gw"), database_url=module_db_url, upstream_url=vllm_server.base_url,
                        env=env) as gw:
        yield gw


@pytest.fixture(scope="module")
def page(browser: Any, gateway: GatewayProcess) -> Iterator[Any]:
    """One logged-in tab for the module (the login is the first test)."""
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1360, "height": 900}, accept_downloads=True,
                                  base_url=gateway.url)
    context.set_default_timeout(30_000)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.js_errors = errors
    yield tab
    context.close()


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def leased(module_engine: Any) -> set[str]:
    """What a new training run's batch query would hand out now."""
    run = lease.start_run(module_engine, objective="rl", backend="local", config={}, base_version=None)
    return set(lease.lease(module_engine, run, limit=1000))


# ------------------------------------------------------------------------------------------


def test_login(page: Any, gateway: GatewayProcess) -> None:
    page.goto("/admin/sessions")
    assert "/admin/login" in page.url  # not logged in: sent to the login page
    shot(page, "01-login")
    page.fill("input[name=secret]", "wrong")
    page.click("button[type=submit]")
    assert page.get_by_role("alert").inner_text() == "Wrong token or password."
    page.fill("input[name=name]", "alice")
    page.fill("input[name=secret]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url("**/admin/sessions")
    assert page.locator(".who").inner_text() == "alice"
    assert int(page.get_by_test_id("session-count").inner_text()) == 8
    shot(page, "02-sessions")


def test_search_finds_a_session_by_a_word_in_a_tool_result(page: Any, ids: dict[str, str]) -> None:
    page.goto("/admin/sessions")
    page.evaluate("window.__same_page = true")
    page.fill("#q", TOOL_WORD)
    page.wait_for_function("document.querySelector('[data-testid=session-count]').innerText === '1'")
    rows = page.locator("tr.session-row")
    assert rows.count() == 1 and rows.first.get_attribute("data-session") == ids["weather"]
    assert page.evaluate("window.__same_page") is True  # counts and rows came without a reload
    shot(page, "03-search")
    # leaving the search box (as a click on a result does) must not run the same search again: its
    # swap would replace the rows under the pointer and the click would be lost. htmx issues a
    # change-triggered request synchronously inside the event, so the count below is exact.
    again = page.evaluate("""() => {
        let n = 0; const count = () => { n += 1; };
        document.body.addEventListener('htmx:beforeRequest', count);
        document.getElementById('q').blur();
        document.body.removeEventListener('htmx:beforeRequest', count);
        return n; }""")
    assert again == 0
    rows.first.locator("a").first.click()
    page.wait_for_url(f"**/admin/sessions/{ids['weather']}")
    # the tool result is rendered as a tool message, the next state is highlighted
    assert TOOL_WORD.capitalize() in page.locator(".next-state .role-tool").first.inner_text()
    assert page.locator(".call .fn").first.inner_text() == "get_weather"
    assert page.locator("ul.votes li").count() >= 6 and "vote 2" in page.locator("ul.votes").first.inner_text()
    # white-box token view with teacher − student on the hinted turn
    reply = page.locator(f"#turn-{ids['weather_reply']}")
    assert reply.locator("details.tokens-box").get_attribute("open") is None  # collapsed at first
    reply.locator("details.tokens-box summary").click()
    assert reply.get_by_test_id("token-legend").is_visible()
    assert reply.locator(".tokens .tok").count() > 3
    assert reply.locator(".tokens.gap").count() == 1
    assert "sunny" in reply.locator(".tokens").first.inner_text()
    shot(page, "04-session")


def test_a_filter_narrows_the_list(page: Any, ids: dict[str, str]) -> None:
    page.goto("/admin/sessions")
    page.select_option("select[name=mode]", "eval")
    page.wait_for_function("document.querySelector('[data-testid=session-count]').innerText === '1'")
    assert page.locator("tr.session-row").first.get_attribute("data-session") == ids["eval"]
    page.select_option("select[name=mode]", "")
    page.select_option("select[name=reward]", "negative")
    page.wait_for_function("document.querySelector('[data-testid=session-count]').innerText === '3'")
    assert page.locator("tr.session-row").count() == 3


def test_exclude_label_changes_what_the_trainer_leases(page: Any, module_engine: Any, ids: dict[str, str],
                                                       gateway: GatewayProcess) -> None:
    target = ids["weather_call"]
    assert target in leased(module_engine)
    page.goto(f"/admin/sessions/{ids['weather']}")
    card = page.locator(f"#turn-{target}")
    card.get_by_test_id("exclude-button").click()
    card.get_by_test_id("excluded").wait_for()
    assert target not in leased(module_engine)
    # keyboard: on a fresh page j focuses the first turn, u thumbs it up — recorded with who and when
    page.reload()
    page.keyboard.press("j")
    page.keyboard.press("j")
    page.keyboard.press("k")
    assert page.locator("[data-turn].focused").get_attribute("data-turn") == target
    page.keyboard.press("u")
    card.locator(".badge.pos").wait_for()
    history = httpx.get(f"{gateway.url}/api/turns/{target}/labels", timeout=10,
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()["history"]
    assert [(h["kind"], h["value"], h["author"]) for h in history] == [("exclude", True, "alice"),
                                                                        ("thumb", 1, "alice")]
    # a corrected reply, through the form
    other = page.locator(f"#turn-{ids['weather_reply']}")
    other.locator("details.label-text summary").click()
    other.locator("textarea[name=value]").first.fill("It is sunny, 31 °C (source: get_weather).")
    other.get_by_role("button", name="Save correction").click()
    other.locator(".badge", has_text="corrected").wait_for()
    shot(page, "05-session-labeled")
    # include again: the trainer sees it again
    card.get_by_test_id("exclude-button").click()
    card.get_by_test_id("excluded").wait_for(state="detached")
    assert target in leased(module_engine)


def test_script_in_a_message_is_inert(page: Any, ids: dict[str, str]) -> None:
    for url in ("/admin/sessions", f"/admin/sessions/{ids['xss']}", "/admin/queue"):
        page.goto(url)
        page.wait_for_load_state("networkidle")
        assert page.evaluate("typeof window.__xss") == "undefined", url
        assert page.locator("img[src=x]").count() == 0, url
    page.goto(f"/admin/sessions/{ids['xss']}")
    assert XSS_USER in page.locator(".msg.role-user .text").first.inner_text()  # shown as text
    assert not page.js_errors


def test_annotation_queue_serves_contested_turns_first(page: Any, ids: dict[str, str]) -> None:
    page.goto("/admin/queue")
    first = page.locator("article.queue-item").first
    assert first.get_attribute("data-turn") == ids["xss_turn"]  # split votes and feedback vs judges
    assert "feedback +1 vs judges -1" in first.locator(".turn-head").inner_text()
    shot(page, "06-queue")


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA adapter for SmolLM2 with non-zero B, as tests/publishing/test_publish.py makes it."""
    pytest.importorskip("peft", reason="the trainer extra makes the adapter")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    out = tmp_path_factory.mktemp("ui-adapter") / "adapter"
    peft_model.save_pretrained(out)
    return out


def test_promote_and_rollback_change_the_policy_alias(page: Any, module_engine: Any, gateway: GatewayProcess,
                                                      adapter: Path, vllm_server: RunningVLLM,
                                                      teacher_server: RunningVLLM, tmp_path: Path) -> None:
    from base.vocab import VersionKind
    from publishing.publish import PublishRequest, publish

    servers = [vllm_server.base_url, teacher_server.base_url]
    name = f"ui-{uuid.uuid4().hex[:8]}"
    try:
        publish(module_engine, PublishRequest(adapter, kind=VersionKind.LORA, name=name, base_model="smollm2",
                                       vllm_urls=servers, parent=None, stats={"run_id": "seeded", "steps": 5},
                                       store=tmp_path / "store", activate=False))
        assert alias_root(gateway) == "smollm2"
        page.goto("/admin/training")
        assert page.get_by_test_id("active-version").inner_text() == "the base model"
        assert page.locator("svg.chart polyline").count() >= 3  # reward, loss, KL, latency curves
        shot(page, "07-training")
        page.get_by_test_id(f"promote-{name}").click()
        page.wait_for_url("**/admin/training/promote")
        shot(page, "08-confirm-promote")
        assert alias_root(gateway) == "smollm2"  # nothing happens before the confirmation
        page.get_by_test_id("confirm-button").click()
        page.wait_for_url("**/admin/training?msg=*")
        assert f"Promoted {name}" in page.get_by_test_id("flash").inner_text()
        wait_for(lambda: alias_root(gateway) == name, 10)
        page.get_by_test_id("rollback-button").click()
        page.get_by_test_id("confirm-button").click()
        page.wait_for_url("**/admin/training?msg=*")
        assert f"Rolled back {name}" in page.get_by_test_id("flash").inner_text()
        wait_for(lambda: alias_root(gateway) == "smollm2", 10)
        assert page.get_by_test_id("active-version").inner_text() == "the base model"
        shot(page, "09-training-after")
        with OrmSession(module_engine) as db:
            events = [(e.action, e.actor) for e in db.query(PolicyEvent).order_by(PolicyEvent.id)
                      if e.action != "publish"]  # the seeded adapter's publish, by publishing.publish
        assert events == [("promote", "admin:alice"), ("rollback", "admin:alice")]
    finally:
        for url in servers:
            httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name}, timeout=10)


def test_export_of_a_filtered_view_round_trips(page: Any, ids: dict[str, str], tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    page.goto("/admin/sessions?mode=offline&reward=positive")
    assert page.get_by_test_id("session-count").inner_text() == "2"
    want = {ids["offline_0"], ids["offline_2"]}
    with page.expect_download() as dl:
        page.get_by_role("link", name="JSONL").click()
    path = tmp_path / "export.jsonl"
    dl.value.save_as(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["id"] for r in rows} == want
    assert all(r["extra_info"]["mode"] == "offline" and r["reward"] == 1.0 for r in rows)
    with page.expect_download() as dl:
        page.get_by_role("link", name="Parquet").click()
    path = tmp_path / "export.parquet"
    dl.value.save_as(path)
    table = pq.read_table(io.BytesIO(path.read_bytes()))
    assert set(table.column("id").to_pylist()) == want
    assert table.to_pylist()[0]["messages"][-1]["role"] == "assistant"


def test_turns_view_finds_negative_turns_and_keeps_its_url(page: Any, ids: dict[str, str]) -> None:
    """Filter the turns view to negative turns: the URL carries the filter, each row opens its
    turn's anchor on the session page, and the back button returns to the same filtered view."""
    page.goto("/admin/turns")
    page.select_option("select[name=reward]", "negative")
    page.wait_for_url("**/admin/turns?*reward=negative*")
    expected = page.request.get("/api/turns?reward=negative").json()["data"]
    assert expected, "the seed has negative turns"
    rows = page.locator("tr.turn-row")
    rows.first.wait_for()
    page.wait_for_function("n => document.querySelectorAll('tr.turn-row').length === n", arg=len(expected))
    assert [rows.nth(i).get_attribute("data-turn-row") for i in range(rows.count())] == [t["id"] for t in expected]
    shot(page, "turns-negative")
    filtered = page.url
    rows.first.locator("a.permalink").click()
    page.wait_for_url(f"**/admin/sessions/*#turn-{expected[0]['id']}")
    card = page.locator(f"#turn-{expected[0]['id']}")
    assert "focused" in (card.get_attribute("class") or "")
    assert card.locator(f"a.permalink[href='#turn-{expected[0]['id']}']").count() == 1
    page.go_back()
    page.wait_for_url(filtered)
    assert page.locator("select[name=reward]").input_value() == "negative"
    assert page.locator("tr.turn-row").count() == len(expected)
    assert not page.js_errors


def test_logout(page: Any) -> None:
    page.goto("/admin/sessions")
    page.get_by_role("button", name="Log out").click()
    page.wait_for_url("**/admin/login")
    page.goto("/admin/training")
    assert "/admin/login" in page.url
    assert not page.js_errors


def teardown_module() -> None:
    shutil.rmtree(ARTIFACTS / "downloads", ignore_errors=True)
