"""The gateway benchmark's printed reports: the full table, and ``--quick``'s ratios to the floor.

``table`` prints every row; ``quick_report`` prints, per wire format and mode, what the issue's
acceptance compares: the latency nextstate adds against what the bare ASGI forwarder
(``asgi-floor``) adds in the same run, CPU per 1,000 requests and saturation as ratios to the
floor's, and the turns stored against the requests sent per format.
"""

from __future__ import annotations

import statistics
from typing import Any

# the rows of the gateway spoken to in each wire format, and the format each stores as
FORMAT_ROWS = {"nextstate": "chat", "nextstate responses": "responses", "nextstate messages": "messages"}
# the acceptance: added p50 within this of the floor's, p99 under this, CPU and saturation ratios
P50_OVER_FLOOR_MS, P99_MS, CPU_RATIO, SAT_RATIO = 0.3, 10.0, 2.0, 0.5


def table(results: dict[str, Any]) -> str:
    rows = results["rows"]
    out = []
    w = max([20, *(len(n) + 1 for n in rows)])
    hdr = (f"{'row':<{w}}{'mode':<7}{'ok/err':>10}{'TTFT p50/p95/p99 ms':>24}{'total p50/p95/p99 ms':>24}"
           f"{'added total p50/p95/p99':>26}{'added TTFT p50/p99':>20}{'sat RPS':>9}{'CPU s/1k':>9}")
    out.append(hdr)
    out.append("-" * len(hdr))
    for mode in ("whole", "stream"):
        base = rows.get("direct", {}).get(mode, {}).get("fixed_rate")
        vbase = rows.get("vllm direct+ids", {}).get(mode, {}).get("fixed_rate")
        for name, row in rows.items():
            r = row.get(mode)
            if not r:
                continue
            f = r["fixed_rate"]
            ref = vbase if name.startswith("vllm") else base
            errs = sum(f["errors"].values())
            okerr = f"{f['ok']}/{errs}"
            line = (f"{name:<{w}}{mode:<7}{okerr:>10}"
                    f"{f['ttft_p50']:>10.2f}/{f['ttft_p95']:>6.2f}/{f['ttft_p99']:>6.2f}"
                    f"{f['total_p50']:>10.2f}/{f['total_p95']:>6.2f}/{f['total_p99']:>6.2f}")
            if ref is not None and name not in ("direct", "vllm direct", "vllm direct+ids"):
                line += (f"{f['total_p50'] - ref['total_p50']:>12.2f}/{f['total_p95'] - ref['total_p95']:>6.2f}/"
                         f"{f['total_p99'] - ref['total_p99']:>6.2f}"
                         f"{f['ttft_p50'] - ref['ttft_p50']:>13.2f}/{f['ttft_p99'] - ref['ttft_p99']:>6.2f}")
            else:
                line += " " * 46
            sat = r.get("saturation_rps")
            line += f"{sat:>9.0f}" if sat else " " * 9
            cpu = f.get("cpu_s_per_1k")
            line += f"{cpu:>9.2f}" if cpu is not None else ""
            out.append(line)
    out.append("")
    for name, row in rows.items():
        if "memory_mib" in row:
            m = row["memory_mib"]
            out.append(f"memory {name}: RSS {' -> '.join(f'{x:.1f}' for x in m)} MiB "
                       f"(start, after {results['args']['leak_requests'] // 2} whole, after as many streamed)")
    off = rows.get("nextstate redact=none", {})
    for name in ("nextstate redact=secrets", "nextstate redact=all"):
        on = rows.get(name, {})
        for mode in ("whole", "stream"):
            if mode in on and mode in off and mode in rows.get("direct", {}):
                d = rows["direct"][mode]["fixed_rate"]
                a, b = on[mode]["fixed_rate"], off[mode]["fixed_rate"]
                added = [(a[f"total_p{q}"] - d[f"total_p{q}"]) / (b[f"total_p{q}"] - d[f"total_p{q}"]) for q in (50, 99)]
                # the ratio of two small added latencies swings with a tenth of a millisecond: the
                # difference in ms says how much that is
                more = [a[f"total_p{q}"] - b[f"total_p{q}"] for q in (50, 99)]
                out.append(f"redaction {name.split('=')[1]} / off ({mode}, {results['args']['rate']:.0f} RPS): added "
                           f"latency p50 {added[0]:.2f}x ({more[0]:+.2f} ms), p99 {added[1]:.2f}x ({more[1]:+.2f} ms); "
                           f"CPU s/1k {a['cpu_s_per_1k'] / b['cpu_s_per_1k']:.2f}x; saturation RPS "
                           f"{on[mode]['saturation_rps'] / off[mode]['saturation_rps']:.2f}x")
    if results.get("redactions"):
        out.append(f"redactions counted (/metrics): {results['redactions']}")
    ns, ll = rows.get("nextstate", {}), rows.get("litellm-proxy", {})
    for mode in ("whole", "stream"):
        if mode in ns and mode in ll:
            out.append(f"throughput nextstate / LiteLLM proxy ({mode}): "
                       f"{ns[mode]['saturation_rps'] / ll[mode]['saturation_rps']:.2f}x")
    if "capture" in results:
        c = results["capture"]
        waiting = c.get("queue_depth") or 0
        after = (f"all stored {c['settle_s']:.1f} s after the load" if c.get("settle_s") is not None
                 else f"{c.get('waited_s', 60):.0f} s after the load")
        out.append(f"nextstate capture, {after}: {c['turns_stored']} turns stored for {c['requests_sent']} "
                   f"requests sent, {waiting:.0f} still queued in the gateway's memory, "
                   f"{c['requests_sent'] - c['turns_stored'] - waiting:.0f} unaccounted; spool now {c['spool_records']}")
    if "litellm_db" in results:
        out.append(f"LiteLLM proxy with PostgreSQL spend logs: {results['litellm_db']}")
    d = rows.get("direct", {})
    if d:
        out.append("load generator: " + ", ".join(
            f"{m} {d[m]['fixed_rate']['loadgen_cpu_s_per_1k']:.2f} CPU s/1k, ceiling >= {d[m]['saturation_rps']:.0f} RPS "
            "(direct row)" for m in ("whole", "stream") if m in d))
    load = results.get("loadavg") or {}
    if load.get("start"):
        out.append(f"machine: {results.get('cpus')} CPUs, load average (1/5/15 min) "
                   + " -> ".join(f"{'/'.join(f'{x:.1f}' for x in load[k])}" for k in ("start", "end") if k in load)
                   + " (start -> end of the run)")
    out.extend(results["notes"])
    return "\n".join(out)


def _sat_ratio(row: dict[str, Any], floor: dict[str, Any]) -> tuple[float, str]:
    """A row's saturation as a ratio to the floor's: with rounds (--sat-rounds), the median of
    each round's ratio to the floor's round next to it, and their range as text; else the ratio."""
    mine, theirs = row.get("saturation_rounds") or [], floor.get("saturation_rounds") or []
    if len(mine) > 1 and len(mine) == len(theirs) and all(theirs):
        ratios = sorted(m / t for m, t in zip(mine, theirs))
        return statistics.median(ratios), f" {ratios[0]:.2f}-{ratios[-1]:.2f}"
    if not floor.get("saturation_rps"):
        return float("nan"), ""
    return (row.get("saturation_rps") or 0) / floor["saturation_rps"], ""


def quick_report(results: dict[str, Any]) -> str:
    """Per wire format and mode: the added latency against the floor's, CPU and saturation as
    ratios to the floor's, whether each meets the acceptance; then stored / sent per format."""
    rows = results["rows"]
    out = [f"{'mode':<7}{'format':<11}{'added p50 ms (floor, +)':>26}{'added p99 ms (floor)':>22}"
           f"{'CPU s/1k (x floor)':>20}{'sat RPS (x floor)':>19}  not met"]
    for mode in ("whole", "stream"):
        direct = rows.get("direct", {}).get(mode, {}).get("fixed_rate")
        floor = rows.get("asgi-floor", {}).get(mode)
        if direct is None or floor is None:
            continue
        ff = floor["fixed_rate"]
        floor_p50, floor_p99 = ff["total_p50"] - direct["total_p50"], ff["total_p99"] - direct["total_p99"]
        for name, fmt in FORMAT_ROWS.items():
            r = rows.get(name, {}).get(mode)
            if r is None:
                continue
            f = r["fixed_rate"]
            p50, p99 = f["total_p50"] - direct["total_p50"], f["total_p99"] - direct["total_p99"]
            cpu = f["cpu_s_per_1k"] / ff["cpu_s_per_1k"] if ff.get("cpu_s_per_1k") else float("nan")
            sat, spread = _sat_ratio(r, floor)
            missed = [what for what, ok in (("p50", p50 - floor_p50 <= P50_OVER_FLOOR_MS), ("p99", p99 <= P99_MS),
                                            ("CPU", cpu <= CPU_RATIO), ("saturation", sat >= SAT_RATIO)) if not ok]
            out.append(f"{mode:<7}{fmt:<11}{p50:>10.2f} ({floor_p50:.2f}, {p50 - floor_p50:+.2f})"
                       f"{p99:>12.2f} ({floor_p99:.2f}){f['cpu_s_per_1k']:>12.2f} ({cpu:.1f}x)"
                       f"{r.get('saturation_rps') or 0:>11.0f} ({sat:.2f}x{spread})  {', '.join(missed) or '-'}")
    c = results.get("capture") or {}
    sent, stored = c.get("sent_by_format") or {}, c.get("stored_by_format") or {}
    if sent:
        counts = ", ".join(f"{fmt} {stored.get(fmt, 0)} / {n}" for fmt, n in sent.items())
        settled = (f"all stored {c['settle_s']:.1f} s after the load" if c.get("settle_s") is not None
                   else f"NOT all stored {c.get('waited_s', 0):.0f} s after the load")
        out.append(f"stored / sent: {counts}; {settled}")
        out.append(f"still queued {c.get('queue_depth') or 0:.0f}, spool {c.get('spool_records') or 0:.0f}, "
                   f"pool {c.get('pool', 'postgresql')}")
    load = results.get("loadavg") or {}
    if load.get("start"):
        out.append("load average (1/5/15 min) " + " -> ".join(
            "/".join(f"{x:.1f}" for x in load[k]) for k in ("start", "end") if k in load) + " (start -> end)")
    out.append(f"acceptance: added p50 <= floor's + {P50_OVER_FLOOR_MS} ms, p99 <= {P99_MS:.0f} ms, "
               f"CPU <= {CPU_RATIO:.0f}x floor, saturation >= {SAT_RATIO}x floor")
    return "\n".join(out)
