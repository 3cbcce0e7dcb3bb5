"""Added latency of the gateway over a direct vLLM call, measured side by side in one run.

    python benchmarks/overhead.py --upstream http://127.0.0.1:8401/v1 [--n 50]

Starts a gateway (SQLite pool in a temp dir) in front of the given vLLM, then alternates direct
and gateway requests (same body, max_tokens=1, greedy) so both see the same machine load, and
prints p50/p95 of each and of the difference. Streaming requests are timed to the last byte.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.processes import GatewayProcess  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="vLLM base URL (…/v1)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=50, help="requests per row and mode")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        gw = GatewayProcess(Path(d), database_url=f"sqlite:///{d}/pool.db", upstream_url=args.upstream).start()
        startup = time.perf_counter() - t0
        try:
            rows = []
            with httpx.Client(timeout=120) as http:
                for stream in (False, True):
                    body = {"model": args.model, "max_tokens": 1, "temperature": 0, "stream": stream,
                            "messages": [{"role": "user", "content": "Say hi."}]}
                    # what the gateway itself asks vLLM for: token ids and logprobs cost vLLM time too
                    flagged = body | {"return_token_ids": True, "logprobs": True}
                    direct, direct_flags, through = [], [], []
                    for i in range(args.n + 3):
                        for url, payload, out in ((args.upstream, body, direct),
                                                  (args.upstream, flagged, direct_flags),
                                                  (gw.base_url, body, through)):
                            t = time.perf_counter()
                            r = http.post(f"{url}/chat/completions", json=payload)
                            r.read()
                            r.raise_for_status()
                            if i >= 3:  # warm-up
                                out.append((time.perf_counter() - t) * 1000)
                    rows.append(("stream" if stream else "whole", direct, direct_flags, through))
        finally:
            gw.stop()
    print(f"gateway startup to /healthz: {startup:.2f} s\n")
    print(f"latency in ms, n={args.n} per cell; 'direct+ids' asks vLLM for token ids and logprobs as "
          "the gateway does;\n'added' = gateway − direct+ids, per request pair\n")
    print(f"{'mode':<7}{'direct p50':>11}{'direct+ids p50':>15}{'gateway p50':>12}{'gateway p95':>12}"
          f"{'added p50':>10}{'added p95':>10}")
    for name, direct, flags, through in rows:
        added = [b - a for a, b in zip(flags, through)]
        print(f"{name:<7}{_pct(direct, 50):>11.2f}{_pct(flags, 50):>15.2f}{_pct(through, 50):>12.2f}"
              f"{_pct(through, 95):>12.2f}{_pct(added, 50):>10.2f}{_pct(added, 95):>10.2f}")


if __name__ == "__main__":
    main()
