"""CPU time of trace export per stored turn, in process: what the capture writer spends making an
agent's turn into a span (datapool.traces) and what the batch processor's thread spends encoding
and sending it over OTLP/HTTP to a real receiver (Arize Phoenix, tests/support/phoenix.py).

    python -m benchmarks.gateway.traces [--turns 2000]

CPU time (time.process_time) of this process, the receiver's own not counted, so other load on
the machine changes it less than it changes latencies.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.gateway.redaction import _turn
from base.settings import Settings
from datapool.traces import Traces, traces


def measure(t: Traces, turns: int) -> dict[str, float]:
    records = [_turn(i) for i in range(turns)]
    sessions = {r.id: "bench-session" for r in records}
    t.stored(records[:10], {r.id: "warm" for r in records[:10]})  # imports, first connection
    t.flush(30)
    start = time.process_time()
    for r in records[10:]:
        t.stored([r], {r.id: sessions[r.id]})
    made = time.process_time() - start
    assert t.flush(120), "the receiver did not take every span"
    total = time.process_time() - start
    n = turns - 10
    return {"make_us": made / n * 1e6, "make_and_send_us": total / n * 1e6}


def main() -> None:
    from tests.support.phoenix import PhoenixProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=2000)
    args = ap.parse_args()
    with PhoenixProcess(Path(tempfile.mkdtemp(prefix="bench-traces-"))) as phoenix:
        os.environ.update(phoenix.env("bench-traces"))
        for content in (True, False):
            t = traces(Settings(otel_traces=True, otel_content=content), "gateway")
            assert t is not None
            m = measure(t, args.turns)
            t.shutdown()
            print(f"content {'on ' if content else 'off'}: {m['make_us']:6.0f} us CPU per turn in the writer, "
                  f"{m['make_and_send_us']:6.0f} us with the batch thread's encoding and sending")
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
