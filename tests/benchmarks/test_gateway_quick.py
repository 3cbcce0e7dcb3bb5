"""The gateway benchmark's guard, `python -m benchmarks.gateway --quick`: what it runs (its
arguments) and what it prints (the ratios to the ASGI floor, the acceptance it misses, the turns
stored per format), on a made-up run's results; no process is started."""

from __future__ import annotations

from typing import Any

from benchmarks.gateway.__main__ import parse_args, report


def _row(p50: float, p99: float, cpu: float | None, sat: float) -> dict[str, Any]:
    fixed = {"ok": 600, "errors": {}, "elapsed_s": 3.0, "ttft_p50": p50, "ttft_p95": p99, "ttft_p99": p99,
             "total_p50": p50, "total_p95": p99, "total_p99": p99, "loadgen_cpu_s_per_1k": 0.5}
    if cpu is not None:
        fixed["cpu_s_per_1k"] = cpu
    return {"fixed_rate": fixed, "saturation_rps": sat, "saturation_errors": {}}


def _results(args: dict[str, Any], *, settle_s: float | None) -> dict[str, Any]:
    modes = ("whole", "stream")
    return {
        "args": args, "notes": [], "cpus": 2, "loadavg": {"start": [1.0, 1.2, 1.5], "end": [1.4, 1.3, 1.5]},
        "rows": {
            "direct": {m: _row(0.5, 1.0, 0.1, 10000) for m in modes},
            "asgi-floor": {m: _row(0.7, 1.5, 0.4, 4000) for m in modes},
            # chat meets everything; responses misses p50 and CPU; messages misses p99 and saturation
            "nextstate": {m: _row(0.9, 3.0, 0.72, 2500) for m in modes},
            "nextstate responses": {m: _row(1.5, 4.0, 1.2, 2100) for m in modes},
            "nextstate messages": {m: _row(0.95, 40.0, 0.75, 1500) for m in modes},
        },
        "capture": {"requests_sent": 9000, "turns_stored": 8990, "queue_depth": 0, "spool_records": 0,
                    "sent_by_format": {"chat": 3000, "responses": 3000, "messages": 3000},
                    "stored_by_format": {"chat": 3000, "responses": 3000, "messages": 2990},
                    "settle_s": settle_s, "waited_s": 60.0, "pool": "sqlite"},
    }


def test_quick_runs_every_format_beside_the_floor_in_about_a_minute() -> None:
    args = parse_args(["--quick"])
    assert args.floor and args.skip_litellm and not args.litellm_db and args.vllm_url == ""
    assert args.formats == "responses,messages" and args.leak_requests == 0
    # 10 rows (direct, floor, 3 formats; whole and streamed), each at the rate and at saturation,
    # the saturation in rounds whose ratios to the floor's are taken one by one
    assert args.sat_rounds >= 3 and 10 * (args.duration + args.sat_rounds * args.sat_duration) <= 60
    assert parse_args(["--quick", "--pool", "sqlite", "--soak", "60"]).pool == "sqlite"
    full = parse_args([])
    assert not full.quick and full.duration == 10 and full.leak_requests == 20000


def test_quick_report_gives_the_ratios_to_the_floor_and_what_is_not_met() -> None:
    args = vars(parse_args(["--quick"]))
    text = report(_results(args, settle_s=2.5))
    lines = {tuple(line.split()[:2]): line for line in text.splitlines() if line.startswith(("whole", "stream"))}
    # chat: added 0.40 ms against the floor's 0.20 (+0.20), CPU 0.7 / 0.4, saturation 2500 / 4000
    chat = lines[("whole", "chat")]
    assert "0.40 (0.20, +0.20)" in chat and "(1.8x)" in chat and "(0.62x)" in chat and chat.endswith(" -")
    assert lines[("stream", "responses")].endswith("p50, CPU")
    assert lines[("whole", "messages")].endswith("p99, saturation")
    assert "stored / sent: chat 3000 / 3000, responses 3000 / 3000, messages 2990 / 3000" in text
    assert "all stored 2.5 s after the load" in text and "pool sqlite" in text
    assert "load average (1/5/15 min) 1.0/1.2/1.5 -> 1.4/1.3/1.5" in text


def test_quick_report_takes_the_median_of_each_rounds_ratio_to_the_floor() -> None:
    results = _results(vars(parse_args(["--quick"])), settle_s=1.0)
    for mode in ("whole", "stream"):
        results["rows"]["asgi-floor"][mode]["saturation_rounds"] = [4000, 5000, 2000]
        # rounds of 0.50x, 0.60x and 0.60x the floor's next to them; the row's median (2000)
        # against the floor's (4000) would read 0.50x
        results["rows"]["nextstate"][mode]["saturation_rounds"] = [2000, 3000, 1200]
        results["rows"]["nextstate"][mode]["saturation_rps"] = 2000
    text = report(results)
    chat = next(line for line in text.splitlines() if line.startswith("whole  chat"))
    assert "(0.60x 0.50-0.60)" in chat, chat
    # a row measured once keeps the plain ratio
    responses = next(line for line in text.splitlines() if line.startswith("whole  responses"))
    assert "(0.53x)" in responses, responses


def test_quick_report_says_when_turns_were_not_all_stored() -> None:
    text = report(_results(vars(parse_args(["--quick"])), settle_s=None))
    assert "NOT all stored 60 s after the load" in text


def test_the_full_run_prints_the_table_alone() -> None:
    text = report(_results(vars(parse_args(["--skip-litellm"])), settle_s=1.0))
    assert "asgi-floor" in text and "stored / sent" not in text
