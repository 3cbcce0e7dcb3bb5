"""The training pages (issue 18): axes a person can read (ticks, labels, time), one series per
run that no line ever leaves, the page per run, reward by policy version, and two versions'
held-out replies side by side — stored by the eval gate against the real vLLM."""

from __future__ import annotations

import itertools
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session as OrmSession

from base.vocab import PolicyAction
from datapool import evals, leases, versions
from datapool.db import make_engine
from datapool.models import (
    EvalReply,
    Judgement,
    PolicyEvent,
    PolicyVersion,
    Session,
    Turn,
)
from base.settings import Settings
from datapool.training_view import series_by_run
from tests.support.vllm_servers import RunningVLLM
from gateway.app import create_app
from gateway.ui import plots

LABEL = re.compile(r"^-?\d+(\.\d+)?[GMkmµn]?$")
SCALE = {"G": 1e9, "M": 1e6, "k": 1e3, "": 1.0, "m": 1e-3, "µ": 1e-6, "n": 1e-9}
SVG = "{http://www.w3.org/2000/svg}"


def parse(label: str) -> float:
    suffix = label[-1] if label[-1] in "GMkmµn" else ""
    return float(label[: len(label) - len(suffix)]) * SCALE[suffix]


# --- ticks -----------------------------------------------------------------------------------


def test_ticks_read_as_numbers_people_write() -> None:
    ticks, step = plots.nice_ticks(-0.00475, 0.0021)
    labels = plots.tick_labels(ticks, step)
    assert labels == ["-0.006", "-0.004", "-0.002", "0", "0.002", "0.004"]
    assert plots.tick_labels(*plots.nice_ticks(0, 1)) == ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]
    assert plots.tick_labels(*plots.nice_ticks(1e-7, 4e-6)) == ["0", "1µ", "2µ", "3µ", "4µ"]
    assert plots.tick_labels(*plots.nice_ticks(12000, 48000, 4)) == ["10k", "20k", "30k", "40k", "50k"]
    steps, step = plots.nice_ticks(1, 3, 6, integer=True)
    assert plots.tick_labels(steps, step) == ["1", "2", "3"]  # training steps are whole numbers
    assert plots.value_label(-0.00475) == "-0.00475" and plots.value_label(123456) == "123456"
    assert plots.value_label(float("nan")) == "nan" and plots.value_label(2e-5) == "20µ"
    assert plots.value_label(0.00085) == "0.00085" and plots.value_label(3.5e6) == "3.5M"


def test_a_span_too_small_to_divide_is_drawn_as_flat() -> None:
    """0 and 5e-324 (the smallest float): a fifth of the span underflows to 0, whose log has no
    value (hypothesis found it through the loss chart). Such a span, or one below 1e-12 of the
    values, is drawn as a flat line in a band around it."""
    for lo, hi in ((0.0, 5e-324), (5e-324, 5e-324), (1e-320, 3e-320), (1e6, 1e6 + 1e-7), (-2.5, -2.5)):
        ticks, step = plots.nice_ticks(lo, hi, 4)
        assert ticks[0] <= lo and ticks[-1] >= hi and len(ticks) >= 2 and step > 0
        assert len(set(plots.tick_labels(ticks, step))) == len(ticks)
    svg = ET.fromstring(str(plots.line_chart("loss", {"run-a": [(0, 0.0), (1, 5e-324)]})))
    assert len(svg.findall(f".//{SVG}polyline")) == 1


magnitudes = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)


@settings(max_examples=400, deadline=None)
@given(lo=magnitudes, width=st.floats(min_value=1e-4, max_value=1e4), count=st.integers(2, 8))
def test_ticks_cover_the_data_and_every_label_is_short_plain_and_distinct(lo: float, width: float,
                                                                          count: int) -> None:
    hi = lo + max(abs(lo), 1e-9) * width if lo else width  # spans from 1e-4 to 1e4 times the value
    assume_finite = math.isfinite(hi)
    if not assume_finite:
        return
    ticks, step = plots.nice_ticks(lo, hi, count)
    labels = plots.tick_labels(ticks, step)
    assert ticks[0] <= lo + step * 1e-9 and ticks[-1] >= hi - step * 1e-9
    assert 2 <= len(ticks) <= 2 * count + 3
    assert all(LABEL.match(t) for t in labels), labels  # never 1.2e-05
    assert len(set(labels)) == len(labels), labels
    assert max(len(t) for t in labels) <= 12, labels
    for t, text in zip(ticks, labels):
        assert abs(parse(text) - t) <= step / 2 + abs(t) * 1e-9, (t, text)


@settings(max_examples=400, deadline=None)
@given(v=st.floats(min_value=-1e15, max_value=1e15, allow_nan=False).filter(lambda x: x == 0 or abs(x) > 1e-12))
def test_a_value_reads_plainly_to_four_digits(v: float) -> None:
    text = plots.value_label(v)
    assert LABEL.match(text), text
    assert abs(parse(text) - v) <= abs(v) * 5e-4 + 1e-15, (v, text)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1_600_000_000, 1_900_000_000), span=st.integers(0, 400 * 86400))
def test_time_ticks_are_whole_and_distinct(lo: int, span: int) -> None:
    ticks, labels = plots.time_ticks(lo, lo + span)
    assert ticks == sorted(ticks) and len(set(labels)) == len(labels) and len(ticks) <= 7
    assert all("e" not in label for label in labels)


# --- one series per run ----------------------------------------------------------------------

values = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from([math.nan, math.inf, -math.inf]))
runs = st.dictionaries(st.sampled_from(["run-a", "run-b", "run-c", "run-d"]),
                       st.dictionaries(st.integers(0, 5000), values, min_size=1, max_size=40), min_size=1)


@settings(max_examples=150, deadline=None)
@given(data=runs, order=st.randoms(use_true_random=False))
def test_no_line_joins_two_runs(data: dict[str, dict[int, float]], order: Any) -> None:
    rows = [(run, step, {"loss": v}) for run, steps in data.items() for step, v in steps.items()]
    order.shuffle(rows)  # steps of runs interleaved, as the pool returns them by time
    series = series_by_run(rows, ("loss",))
    assert set(series) == set(data)
    for run, points in series.items():
        assert [p[0] for p in points] == sorted(data[run])  # each run's own steps, in step order
    svg = ET.fromstring(str(plots.line_chart("loss", series)))
    groups = svg.findall(f"{SVG}g")
    drawn = {g.get("data-series"): g for g in groups}
    finite = {run: [s for s, v in steps.items() if math.isfinite(v)] for run, steps in data.items()}
    assert len(svg.findall(f".//{SVG}polyline")) == sum(len(g.findall(f"{SVG}polyline")) for g in groups)
    for run, g in drawn.items():
        lines = [[tuple(map(float, p.split(","))) for p in pl.get("points").split()] for pl in g.findall(f"{SVG}polyline")]
        # the vertices of a run's lines are exactly its finite points, each line left to right:
        # a line holding a point of another run would need more vertices than this run has
        in_lines = sum(len(line) for line in lines)
        lone = sum(1 for c in g.findall(f"{SVG}circle") if "dot" in (c.get("class") or "") and not any(
            (float(c.get("cx")), float(c.get("cy"))) in line for line in lines))
        assert in_lines + lone <= len(finite[run]) and in_lines <= len(finite[run])
        assert all(a[0] <= b[0] for line in lines for a, b in itertools.pairwise(line))  # 0.1 px rounding
        assert all(len(line) >= 2 for line in lines)
        # every hover target names its own run
        assert all(t.text.startswith(f"{run} · step ") for t in g.iter(f"{SVG}title"))
    skipped = sum(1 for steps in data.values() for v in steps.values() if not math.isfinite(v))
    note = "".join(t.text or "" for t in svg.iter(f"{SVG}text") if t.get("class") == "chart-note")
    assert (f"{skipped} non-finite" in note) if skipped else note == ""


def test_a_chart_legend_sits_below_the_plot_and_points_carry_their_values() -> None:
    chart = str(plots.line_chart("loss", {"abc rl": [(1, 0.5), (2, -0.00475)], "def opd": [(1, 2.0)]}))
    svg = ET.fromstring(chart)
    frame = next(r for r in svg.iter(f"{SVG}rect") if r.get("class") == "chart-frame")
    bottom = float(frame.get("y")) + float(frame.get("height"))
    legend = [t for t in svg.iter(f"{SVG}text") if t.get("class") == "chart-legend"]
    assert [t.text for t in legend] == ["abc rl", "def opd"]
    assert all(float(t.get("y")) > bottom for t in legend)
    titles = [t.text for t in svg.iter(f"{SVG}title")]
    assert "abc rl · step 2: -0.00475" in titles and "def opd · step 1: 2" in titles
    assert "e-0" not in chart


# --- the pages -------------------------------------------------------------------------------


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Any]]:
    settings_ = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=database_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings_)) as c:
        engine = make_engine(database_url)
        yield c, engine
        engine.dispose()


def _version(engine: Any, name: str, run_id: str | None, step: int, score: float | None) -> None:
    with OrmSession(engine) as db, db.begin():
        v = PolicyVersion(name=name, base_model="smollm2", kind="lora", path="/x", status="candidate",
                          stats={"run_id": run_id, "step": step})
        db.add(v)
        db.flush()
        if score is not None:
            db.add(PolicyEvent(version_id=v.id, action="eval", actor="eval-gate",
                               metrics={"score": score, "active_score": 0.5, "against": "smollm2", "n": 2}))


def test_run_page_shows_config_steps_versions_and_curves(client: tuple[TestClient, Any]) -> None:
    c, engine = client
    run = leases.start_run(engine, objective="rl", backend="local", config={"lr": 2e-5, "k": 4}, base_version=None)
    other = leases.start_run(engine, objective="opd", backend="local", config={}, base_version=None)
    for step in range(1, 6):
        leases.record_step(engine, run, step, [], {"pg_loss": 0.5 / step, "kl": 0.001 * step,
                                                   "candidate": f"v-{step}" if step == 5 else None})
        leases.record_step(engine, other, step, [], {"loss": 1.0 + step})
    _version(engine, "v-5", run, 5, 0.75)
    _version(engine, "v-other", other, 3, None)
    page = c.get("/admin/training")
    assert page.status_code == 200
    assert f'href="/admin/training/runs/{run}"' in page.text and "Compare two versions" in page.text
    loss = re.search(r'<svg[^>]*data-testid="chart-loss".*?</svg>', page.text, re.DOTALL).group(0)
    assert loss.count("<polyline") == 2 and loss.count('class="series"') == 2  # one line per run, not one
    assert "step 5" in loss and "e-0" not in page.text
    r = c.get(f"/admin/training/runs/{run}")
    assert r.status_code == 200
    assert '"lr": 2e-05' in r.text and '"k": 4' in r.text  # the config
    assert r.text.count("<tr><td>") >= 5 and ">0.1<" in r.text  # the steps table: 0.5 / 5
    versions = re.search(r'data-testid="run-versions".*?</table>', r.text, re.DOTALL).group(0)
    assert "v-5" in versions and "0.75" in versions and "v-other" not in versions
    assert 'data-testid="chart-pg_loss"' in r.text and 'data-testid="chart-kl"' in r.text
    assert 'data-testid="chart-loss"' not in r.text  # the other run's metric is not this run's
    assert c.get(f"/admin/training/runs/{run}x").status_code == 404


def test_each_version_shows_whether_the_server_serves_what_was_trained(client: tuple[TestClient, Any]) -> None:
    """trainer.agreement's numbers on the publish event: shown per version, flagged above 0.02 nats,
    and an unchecked version says so instead of showing a number."""
    c, engine = client
    for name, metrics in (("v-good", {"train_serve_mean_abs": 0.0041, "train_serve_max_abs": 0.052,
                                      "train_serve_kl": 1e-5, "train_serve_tokens": 812.0}),
                          ("v-scaled", {"train_serve_mean_abs": 0.3127, "train_serve_max_abs": 2.5,
                                        "train_serve_kl": 0.2, "train_serve_tokens": 790.0}),
                          ("v-down", {"train_serve_error": "ConnectError: refused"}),
                          ("v-older", None)):
        _version(engine, name, None, 1, None)
        versions.record_event(engine, PolicyAction.PUBLISH, version=name, actor="trainer")
        if metrics:
            versions.add_event_metrics(engine, name, PolicyAction.PUBLISH, metrics)
    page = c.get("/admin/training").text

    def cell(name: str) -> str:
        return re.search(rf'data-testid="train-serve-{name}">(.*?)</td>', page, re.DOTALL).group(1)

    assert "0.0041" in cell("v-good") and "(0.052)" in cell("v-good") and "812 tokens" in cell("v-good")
    assert "neg" not in cell("v-good")
    assert "0.3127" in cell("v-scaled") and "badge neg" in cell("v-scaled")
    assert "not checked" in cell("v-down") and "refused" in cell("v-down")
    assert cell("v-older").strip() == "–"


def test_a_held_back_candidate_shows_why(client: tuple[TestClient, Any]) -> None:
    """The gate's reason for refusing a candidate (e.g. the topicality check) is on the page,
    under the version's status."""
    c, engine = client
    _version(engine, "v-off", None, 1, None)
    reason = "off topic: held-out on-topic share 0.700 < smollm2 0.950 - 0.05"
    with OrmSession(engine) as db, db.begin():
        v = db.query(PolicyVersion).filter_by(name="v-off").one()
        v.status = "refused"
        db.add(PolicyEvent(version_id=v.id, action="refuse", actor="trainer", reason=reason))
    page = c.get("/admin/training").text
    row = re.search(r'<tr data-version="v-off".*?</tr>', page, re.DOTALL).group(0)
    held = re.search(r'data-testid="held-back">(.*?)</span>', row).group(1)
    assert held == "held back: " + reason.replace("<", "&lt;")


def test_reward_by_policy_version(client: tuple[TestClient, Any]) -> None:
    c, engine = client
    from datetime import datetime, timedelta

    now = datetime.now(UTC) - timedelta(minutes=5)
    with OrmSession(engine) as db, db.begin():
        for i, (version, reward) in enumerate([("va", 1.0), ("va", -1.0), ("va", 1.0), ("vb", -1.0), (None, 1.0)]):
            db.add(Session(id=f"s{i}", source="header"))
            db.flush()
            db.add(Turn(id=f"t{i}", session_id=f"s{i}", endpoint="chat", status="ok", created_at=now, model="policy",
                        policy_version=version, capture="white-box", request={"messages": []}))
            db.flush()
            db.add(Judgement(turn_id=f"t{i}", status="scored", reward=reward, attempts=1))
    r = c.get("/admin/training")
    table = re.search(r'data-testid="by-version".*?</table>', r.text, re.DOTALL).group(0)
    row = re.search(r"<b>va</b>.*?</tr>", table, re.DOTALL).group(0)
    assert ">3<" in row and "+0.33" in row and "67%" in row
    assert "<b>vb</b>" in table and "(no version)" in table
    chart = re.search(r'<svg[^>]*data-testid="chart-reward-by-version".*?</svg>', r.text, re.DOTALL).group(0)
    assert 'data-series="va"' in chart and 'data-series="vb"' in chart and "time (UTC)" in chart


def test_compare_shows_scores_and_both_replies_to_the_same_prompts(client: tuple[TestClient, Any]) -> None:
    c, engine = client
    _version(engine, "va", None, 1, 0.9)
    _version(engine, "vb", None, 2, None)
    tree, river = [{"role": "user", "content": "Name a tree."}], [{"role": "user", "content": "Name a river."}]
    evals.record_replies(engine, "va", [tree, river], ["Oak.", "Nile <b>river</b>."], [1.0, 0.0])
    evals.record_replies(engine, "vb", [tree], ["Birch."], [1.0])
    r = c.get("/admin/training/compare", params={"a": "va", "b": "vb"})
    assert r.status_code == 200
    rows = re.findall(r'<section class="compare-row".*?</section>', r.text, re.DOTALL)
    assert len(rows) == 2
    assert "Name a tree." in rows[0] and "Oak." in rows[0] and "Birch." in rows[0]  # the same prompt, both sides
    assert rows[0].index("Oak.") < rows[0].index("Birch.")  # A left, B right
    assert "Name a river." in rows[1] and "no reply stored" in rows[1]
    assert "Nile &lt;b&gt;river&lt;/b&gt;." in rows[1]  # a reply is text, never markup
    assert 'class="reply"' in rows[0]  # equal scores: neither side marked
    scores = re.search(r'data-testid="compare-scores".*?</table>', r.text, re.DOTALL).group(0)
    assert "0.9" in re.search(r'data-testid="eval-1">(.*?)</td>', scores, re.DOTALL).group(1)
    assert "no eval" in re.search(r'data-testid="eval-2">(.*?)</td>', scores, re.DOTALL).group(1)
    # htmx swaps only the comparison; the same URL in a browser is the whole page
    frag = c.get("/admin/training/compare", params={"a": "va", "b": "vb"},
                 headers={"HX-Request": "true", "HX-Target": "compare"})
    assert "<nav>" not in frag.text and "Birch." in frag.text and frag.headers["vary"] == "HX-Request, HX-Target"
    same = c.get("/admin/training/compare", params={"a": "va", "b": "va"})
    assert same.status_code == 200 and 'data-testid="compare-same"' in same.text
    missing = c.get("/admin/training/compare", params={"a": "va", "b": "nowhere"})
    assert missing.status_code == 404 and "nowhere" in missing.text and "<nav>" in missing.text
    assert 'data-testid="compare-empty"' in c.get("/admin/training/compare", params={"a": "va"}).text


def test_the_eval_gate_stores_each_reply_to_the_held_out_prompts(sqlite_engine: Any,
                                                                 vllm_server: RunningVLLM) -> None:
    """The real gate against the suite's vLLM: the base model's greedy replies and their scores
    land in eval_replies, keyed so a second version's replies line up with them."""
    from trainer.eval_gate import EvalGate

    url = vllm_server.base_url

    prompts = [[{"role": "user", "content": "Name a tree."}], [{"role": "user", "content": "Name a river."}]]
    gate = EvalGate(sqlite_engine, [url], "smollm2", prompts=prompts, sessions=0,
                    scorer=lambda reply, messages: float(bool(reply.strip())), threshold=0.1, max_tokens=8)
    result = gate.evaluate("smollm2")
    assert result["n"] == 2
    with OrmSession(sqlite_engine) as db:
        rows = db.query(EvalReply).order_by(EvalReply.id).all()
        assert [(r.version, r.prompt) for r in rows] == [("smollm2", p) for p in prompts]
        assert all(r.reply and r.score == 1.0 for r in rows)
        assert [r.prompt_hash for r in rows] == [evals.prompt_hash(p) for p in prompts]
        assert set(evals.replies_of(db, "smollm2")) == {evals.prompt_hash(p) for p in prompts}
