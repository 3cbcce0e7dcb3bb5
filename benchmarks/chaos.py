"""Chaos: `kill -9` of the policy vLLM mid-stream under client load, and how long until the
active policy version serves again.

The system under test is the one `nextstate vllm serve` and `nextstate gateway` make: vLLM
(``nextstate.modelserver.VLLMServer``) supervised as `vllm serve` supervises it
(``nextstate.supervisor``: restarted with backoff), a `nextstate gateway` in front of it on a
pool (SQLite in a temporary directory unless --database-url), and an active LoRA version (a
random adapter, published as `nextstate policy publish` does). --clients threads stream chat
completions of `policy` in a loop (and --messages-clients ask /v1/messages, Anthropic's
dialect). After --warmup-s, SIGKILL goes to the vLLM's API server: the streams in flight are
cut, the supervisor restarts vLLM, the gateway notices, loads the active version into the new
server and routes `policy` to it again. Between the kill and then, clients are told 503 with
Retry-After (and wait what it says, at most 2 s).

Counted per request: ok (the whole reply), unavailable (503 with Retry-After, in the client's
dialect: Anthropic's is 529 overloaded_error), interrupted (a stream cut at the kill: its error event), failed (anything else).
lost_turns: replies answered 200 whose X-Turn-Id the pool does not hold. engine_deaths: vLLM
exits the supervisor saw. recovered_s: from the kill to the end of the first reply, started
after it, that the active version served. Prints a table and writes JSON (--out).

--replicas 2 serves the model group from two supervised vLLMs (a warm standby: the gateway's
model list names both, each holds the active version); the kill goes to the first, and
recovered_s is then how long until the survivor answers for it (the gateway routes around a
replica its watch sees down or loading). restart_answering_s is the killed one's own restart.

    .venv/bin/python benchmarks/chaos.py --out benchmarks/gateway/results/chaos-cpu.json
    benchmarks/gpu/run.sh chaos      # on a GPU machine (its vLLM and /tmp/smollm2)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nextstate.modelserver import VLLMServer, ensure_model, ensure_vllm_env  # noqa: E402
from nextstate.supervisor import RestartPolicy, Supervisor  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outcome:
    kind: str  # ok | unavailable | interrupted | failed
    started: float
    ended: float
    turn_id: str | None = None
    detail: str = ""


@dataclass
class Clients:
    gateway: str
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def chat(self, i: int, max_tokens: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                started = time.monotonic()
                body = {"model": "policy", "stream": True, "max_tokens": max_tokens, "temperature": 0.7,
                        "messages": [{"role": "user", "content": f"Tell me a short story ({i}-{n})."}]}
                try:
                    with http.stream("POST", f"{self.gateway}/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            self._refused(r, started)
                            continue
                        text = "".join(r.iter_text())
                        kind = "ok" if "data: [DONE]" in text and '"error"' not in text else "interrupted"
                        self._add(Outcome(kind, started, time.monotonic(), r.headers.get("x-turn-id"),
                                          "" if kind == "ok" else text[-300:]))
                except httpx.HTTPError as exc:
                    self._add(Outcome("failed", started, time.monotonic(), detail=f"{type(exc).__name__}: {exc}"))

    def messages(self, i: int, max_tokens: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    r = http.post(f"{self.gateway}/v1/messages", headers={"anthropic-version": "2023-06-01"}, json={
                        "model": "policy", "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": f"Name a river ({i}-{n})."}]})
                except httpx.HTTPError as exc:
                    self._add(Outcome("failed", started, time.monotonic(), detail=f"{type(exc).__name__}: {exc}"))
                    continue
                if r.status_code == 200:
                    self._add(Outcome("ok", started, time.monotonic(), r.headers.get("x-turn-id")))
                else:
                    self._refused(r, started, anthropic=True)

    def _refused(self, r: httpx.Response, started: float, anthropic: bool = False) -> None:
        body = r.read().decode(errors="replace")
        retry = r.headers.get("retry-after")
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        dialect_ok = (doc.get("type") == "error" and isinstance(doc.get("error"), dict)) if anthropic \
            else isinstance(doc.get("error"), dict) and "message" in doc["error"]
        # Anthropic's dialect says it as 529 overloaded_error (with the same Retry-After)
        if r.status_code in ((503, 529) if anthropic else (503,)) and retry and dialect_ok:
            self._add(Outcome("unavailable", started, time.monotonic(), detail=body[:200]))
            self.stop.wait(min(2.0, float(retry)))
        else:
            self._add(Outcome("failed", started, time.monotonic(), detail=f"HTTP {r.status_code} "
                              f"Retry-After={retry}: {body[:300]}"))
            self.stop.wait(0.5)


def random_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter with non-zero B matrices (fixed seed): a version that really differs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    peft_model.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="threads streaming chat completions of `policy`")
    ap.add_argument("--messages-clients", type=int, default=1, help="threads asking /v1/messages")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup-s", type=float, default=20, help="load before the kill")
    ap.add_argument("--after-s", type=float, default=20, help="load after the active version serves again")
    ap.add_argument("--timeout-s", type=float, default=600, help="give up waiting for the recovery after this")
    ap.add_argument("--vllm-python", type=Path, help="python with vLLM (default: nextstate's vLLM venv)")
    ap.add_argument("--model-dir", type=Path, help="the model vLLM serves (default: the converted SmolLM2)")
    ap.add_argument("--database-url", help="the pool (default: SQLite in a temporary directory)")
    ap.add_argument("--replicas", type=int, default=1, choices=(1, 2, 3, 4),
                    help="vLLMs serving the model group, the gateway routing around a dead one (the kill goes "
                         "to the first)")
    ap.add_argument("--vllm-args", default="",
                    help="extra vLLM arguments, one string given with '=' (--vllm-args=--enforce-eager): "
                         "argparse takes a separate value that starts with '-' for an option")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()

    from datapool.db import make_engine, upgrade
    from base.settings import Settings
    from base.vocab import VersionKind
    from publishing.publish import PublishRequest, publish

    cache = Settings().cache_dir
    python = args.vllm_python or ensure_vllm_env(cache)
    model_dir = args.model_dir or ensure_model(cache, python)
    work = Path(tempfile.mkdtemp(prefix="nextstate-chaos-"))
    database_url = args.database_url or f"sqlite:///{work / 'pool.db'}"
    upgrade(database_url)
    servers = [VLLMServer(python, model_dir, served_name="smollm2", port=free_port(),
                          log_path=work / ("vllm.log" if i == 0 else f"vllm-{i}.log"),
                          extra_args=shlex.split(args.vllm_args), name="vllm" if i == 0 else f"vllm-{i}")
               for i in range(args.replicas)]
    server = servers[0]  # the one killed
    supervisor = Supervisor(echo=lambda line: print(f"[supervisor] {line}", flush=True),
                            policy=RestartPolicy(limit=5))
    for each in servers:
        supervisor.add(each)
    gw_port = free_port()
    gateway = None
    clients = None
    started = time.monotonic()
    try:
        print(f"starting vLLM (log {work / 'vllm.log'}) ...", flush=True)
        for each in servers:  # one after another: two vLLMs profiling one GPU's memory at once disagree
            assert supervisor.start(each.name), supervisor.fatal
        first_start_s = time.monotonic() - started
        upstream = ["--upstream", server.base_url]
        if len(servers) > 1:
            (work / "models.yaml").write_text(json.dumps({"model_list": [
                {"model_name": "smollm2", "litellm_params": {"model": "hosted_vllm/smollm2", "api_base": s.base_url}}
                for s in servers]}))
            upstream = ["--model-list", str(work / "models.yaml")]
        gateway = subprocess.Popen(
            [sys.executable, "-m", "nextstate.cli", "gateway", *upstream, "--port", str(gw_port),
             "--database-url", database_url],
            env={**os.environ, "NEXTSTATE_DATA_DIR": str(work), "NEXTSTATE_UPSTREAM_MODEL": "smollm2"},
            stdout=open(work / "gateway.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        gw = f"http://127.0.0.1:{gw_port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{gw}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        engine = make_engine(database_url)
        name = "chaos-" + time.strftime("%H%M%S")
        publish(engine, PublishRequest(random_adapter(model_dir, work / "adapter"), base_model="smollm2",
                                       vllm_urls=[s.base_url for s in servers], kind=VersionKind.LORA, name=name,
                                       store=work / "policies", actor="chaos", reason="the active version"))
        print(f"active version {name}; {args.clients} + {args.messages_clients} clients for {args.warmup_s:.0f} s",
              flush=True)
        clients = Clients(gw)
        threads = [threading.Thread(target=clients.chat, args=(i, args.max_tokens), daemon=True)
                   for i in range(args.clients)]
        threads += [threading.Thread(target=clients.messages, args=(i, 8), daemon=True)
                    for i in range(args.messages_clients)]
        for t in threads:
            t.start()
        time.sleep(args.warmup_s)
        pid = server.pid
        assert pid is not None
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        print(f"SIGKILL to vLLM (pid {pid}) at {killed - started:.1f} s", flush=True)
        answering: list[float] = []  # kill -> the new vLLM's /v1/models answers (before the version loads)

        def watch_answering() -> None:
            while not answering and time.monotonic() - killed < args.timeout_s:
                try:
                    if server.pid != pid and httpx.get(f"{server.base_url}/models", timeout=2).status_code == 200:
                        answering.append(time.monotonic() - killed)
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)

        threading.Thread(target=watch_answering, daemon=True).start()

        def served_by(turn_id: str) -> str | None:
            r = httpx.get(f"{gw}/api/turns/{turn_id}", timeout=10)
            return r.json().get("policy_version") if r.status_code == 200 else None

        recovered_s = None
        checked = 0
        while recovered_s is None and time.monotonic() - killed < args.timeout_s:
            time.sleep(0.5)
            with clients.lock:
                after = [o for o in clients.outcomes[checked:]]
                checked = len(clients.outcomes)
            for o in sorted(after, key=lambda o: o.ended):
                if o.kind == "ok" and o.started > killed and o.turn_id:
                    version = None
                    for _ in range(20):  # the capture is written behind the reply
                        version = served_by(o.turn_id)
                        if version:
                            break
                        time.sleep(0.25)
                    if version == name:
                        recovered_s = o.ended - killed
                        break
        print(f"recovered in {recovered_s:.1f} s" if recovered_s is not None else "not recovered", flush=True)
        time.sleep(args.after_s)
        clients.stop.set()
        for t in threads:
            t.join(150)
        time.sleep(3)  # write-behind capture
        ok = [o for o in clients.outcomes if o.kind == "ok"]
        lost = [o.turn_id for o in ok if not o.turn_id or httpx.get(f"{gw}/api/turns/{o.turn_id}",
                                                                     timeout=10).status_code != 200]
        metrics = httpx.get(f"{gw}/metrics", timeout=10).text
        engine.dispose()
    finally:
        if clients is not None:
            clients.stop.set()
        if gateway is not None and gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGTERM)
            gateway.wait(30)
        report = supervisor.report()
        supervisor.stop()
    counts = {k: sum(o.kind == k for o in clients.outcomes) for k in ("ok", "unavailable", "interrupted", "failed")}
    result = {
        "engine_deaths": sum(sum(report[s.name]["exits"].values()) for s in servers),
        "replicas": len(servers),
        "requests": len(clients.outcomes),
        "failed": counts["failed"],
        "recovered_s": round(recovered_s, 2) if recovered_s is not None else None,
        "first_start_s": round(first_start_s, 1),
        "restart_answering_s": round(answering[0], 1) if answering else None,
        "vllm_args": args.vllm_args,
        "vllm_startup_log": _startup_lines(work / "vllm.log"),
        **{k: counts[k] for k in ("ok", "unavailable", "interrupted")},
        "lost_turns": len(lost),
        "restarts": sum(report[s.name]["restarts"] for s in servers),
        "gateway_upstream_restarts": [line for line in metrics.splitlines()
                                      if line.startswith("nextstate_upstream_restarts_total")],
        "failures": [o.detail for o in clients.outcomes if o.kind == "failed"][:10],
        "interruptions": [o.detail for o in clients.outcomes if o.kind == "interrupted"][:3],
        "clients": args.clients, "messages_clients": args.messages_clients, "max_tokens": args.max_tokens,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs" + (f", {gpu}" if (gpu := _gpu()) else ""),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    rows = [("engine_deaths", result["engine_deaths"]), ("requests", result["requests"]), ("ok", result["ok"]),
            ("unavailable (503 + Retry-After)", result["unavailable"]), ("interrupted mid-stream", result["interrupted"]),
            ("failed", result["failed"]), ("lost_turns", result["lost_turns"]),
            ("recovered_s", result["recovered_s"])]
    print()
    print("| measure | value |\n|---|---|")
    for key, value in rows:
        print(f"| {key} | {value} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")


STARTUP_WORDS = ("took", "Graph capturing", "torch.compile", "compile", "Loading weights took", "init engine",
                 "Starting vLLM", "Application startup complete", "cache")


def _startup_lines(log: Path) -> list[str]:
    """The vLLM log's lines that time its start-ups (both: the first and the restart)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[-300:] for line in lines if any(w in line for w in STARTUP_WORDS)][:80]


def _gpu() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


if __name__ == "__main__":
    main()
