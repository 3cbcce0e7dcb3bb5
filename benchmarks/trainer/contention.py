"""A training pass beside a serving vLLM-CPU server, with OpenMP's two wait policies.

On one machine the trainer and vLLM share the cores (the embedded ``nextstate up --train``,
online training on a CPU box, the test suite). With OpenMP's default wait policy a torch thread
that reaches a barrier spins for its peers; when a peer waits for a core that vLLM holds, the
spinning thread holds the other, and the pass crawls. ``trainer/__init__.py`` therefore sets
``OMP_WAIT_POLICY=PASSIVE`` unless it is set. This measures why, side by side in one run:

- a vLLM-CPU server (``nextstate.modelserver.VLLMServer``, SmolLM2-135M-Instruct) is started;
- for each policy (``ACTIVE``: OpenMP's default behaviour, spin; ``PASSIVE``: yield) and each
  state of the server (``idle``; ``serving``: ``--clients`` threads, each sending a 4-token chat
  and pausing ``--pause`` s, as the online loop's test does), a fresh process loads SmolLM2 in
  fp32 with torch's default threads, warms up once and times ``--passes`` forward and backward
  passes of a batch of 4 × 60 random tokens (``labels`` = the inputs);
- the table gives seconds per pass, and each row's ratio to PASSIVE on an idle server.

One command, on the machine that runs it (it reads vLLM and the model from the cache that
``nextstate vllm setup`` fills)::

    .venv/bin/python benchmarks/trainer/contention.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from base.settings import Settings  # noqa: E402
from nextstate.modelserver import VLLMServer, ensure_model, ensure_vllm_env, free_port  # noqa: E402

_PASSES = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.randint(0, 1000, (4, 60), generator=torch.Generator().manual_seed(0))
model(ids, labels=ids).loss.backward()  # warm-up
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    times.append(time.perf_counter() - start)
print(json.dumps({"threads": torch.get_num_threads(), "times": times}))
"""


class Clients:
    """Threads that keep the server serving: a 4-token chat, then a pause, until stopped."""

    def __init__(self, base_url: str, clients: int, pause: float) -> None:
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run, args=(base_url, pause), daemon=True) for _ in range(clients)]

    def _run(self, base_url: str, pause: float) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                http.post(f"{base_url}/chat/completions", json={
                    "model": "smollm2", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Say a number."}]}).raise_for_status()
                self.sent += 1
                self.stop.wait(pause)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def passes(model_dir: Path, policy: str, n: int) -> dict[str, object]:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-c", _PASSES, str(model_dir), str(n)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3, help="timed forward+backward passes per row (default 3)")
    ap.add_argument("--clients", type=int, default=2, help="client threads keeping vLLM serving (default 2)")
    ap.add_argument("--pause", type=float, default=0.25, help="seconds each client waits between requests")
    ap.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = ap.parse_args()
    # stopped by TERM (timeout, kill): leave through the with-block, which stops vLLM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cache = Settings().cache_dir
    python = ensure_vllm_env(cache)
    model_dir = ensure_model(cache, python)
    work = Path(tempfile.mkdtemp(prefix="nextstate-contention-"))
    rows = []
    with VLLMServer(python, model_dir, served_name="smollm2", port=free_port(), log_path=work / "vllm.log") as server:
        for state in ("idle", "serving"):
            for policy in ("PASSIVE", "ACTIVE"):
                if state == "serving":
                    with Clients(server.base_url, args.clients, args.pause) as clients:
                        time.sleep(2)
                        result = passes(model_dir, policy, args.passes)
                    sent = clients.sent
                else:
                    result, sent = passes(model_dir, policy, args.passes), 0
                times = result["times"]
                rows.append({"vllm": state, "policy": policy, "torch_threads": result["threads"],
                             "s_per_pass": sum(times) / len(times), "requests_served": sent})
                print(f"{state:8} {policy:8} {rows[-1]['s_per_pass']:.2f} s/pass", file=sys.stderr, flush=True)
    base = rows[0]["s_per_pass"]
    print(f"\nforward+backward of SmolLM2-135M (fp32, 4 x 60 tokens) beside a vLLM-CPU server; "
          f"{os.cpu_count()} cores, {args.passes} passes per row\n")
    print("| vLLM | OMP_WAIT_POLICY | torch threads | s per pass | vs PASSIVE, idle | requests served meanwhile |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['vllm']} | {r['policy']} | {r['torch_threads']} | {r['s_per_pass']:.2f} | "
              f"{r['s_per_pass'] / base:.1f}x | {r['requests_served']} |")
    if args.out:
        args.out.write_text(json.dumps({"cores": os.cpu_count(), "passes": args.passes, "clients": args.clients,
                                        "pause_s": args.pause, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
