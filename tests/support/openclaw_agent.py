"""OpenClaw, the agent runtime, for the end-to-end test: installed from npm into the cache, and
run as the real `openclaw agent --local` against a gateway.

`python -m tests.support.openclaw_agent install` installs Node 24 and OpenClaw into
``$NEXTSTATE_CACHE_DIR/openclaw`` (default ``~/.cache/nextstate/openclaw``) and prints how long it
took; `make test` runs it before pytest. It is idempotent (a ready stamp names the pinned
versions) and locked against parallel runs, so the test's fixture calls the same function.

Node comes from the npm package ``node@24`` (its platform package carries the binary), so the
install needs the npm registry and nothing else; npm itself may be any version on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from base.settings import Settings
from nextstate.modelserver import file_lock

OPENCLAW_SPEC = "openclaw@2026.9.6"
NODE_SPEC = "node@24"
READY_STAMP = ".ready"


@dataclass(frozen=True)
class OpenClawInstall:
    root: Path
    node: Path  # the Node 24 binary
    openclaw: Path  # OpenClaw's entry script (run with `node`)
    seconds: float  # how long this call took (the whole install when it installed)
    installed: bool  # False when the cache was already ready

    @property
    def path_env(self) -> str:
        """A PATH with Node 24 first (OpenClaw spawns `node` for its helpers)."""
        return f"{self.node.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def default_root() -> Path:
    """Where Node and OpenClaw are installed: the cache the vLLM venv and models share."""
    return Settings().cache_dir / "openclaw"


def _spec() -> str:
    return f"{NODE_SPEC} {OPENCLAW_SPEC}"


def _paths(root: Path) -> tuple[Path, Path]:
    node = root / "node" / "node_modules" / ".bin" / "node"
    package = root / "agent" / "node_modules" / "openclaw"
    return node, package


def _entry(package: Path) -> Path:
    """OpenClaw's CLI script, from its package.json `bin`."""
    bin_field: Any = json.loads((package / "package.json").read_text()).get("bin")
    rel = bin_field if isinstance(bin_field, str) else (bin_field or {}).get("openclaw")
    if not rel:
        raise RuntimeError(f"{package}/package.json names no `openclaw` bin")
    return (package / rel).resolve()


def _ready(root: Path) -> bool:
    node, package = _paths(root)
    stamp = root / READY_STAMP
    return stamp.exists() and stamp.read_text().strip() == _spec() and node.exists() and package.exists()


def _npm(args: list[str], *, path_env: str, log: Any, log_path: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed to install OpenClaw (Debian: apt-get install npm)")
    cmd = [npm, *args, "--no-audit", "--no-fund", "--loglevel=warn"]
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    env = {**os.environ, "PATH": path_env}
    rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise RuntimeError(f"`npm {' '.join(args)}` failed (exit code {rc}); see {log_path}")


def ensure_openclaw(root: Path | None = None, say: Any = print) -> OpenClawInstall:
    """Node 24 and OpenClaw under *root*, installed from npm unless already there."""
    root = root or default_root()
    started = time.monotonic()
    node, package = _paths(root)
    if not _ready(root):
        log_path = root / "install.log"
        with file_lock(root.parent / ".openclaw.lock"):
            if not _ready(root):
                root.mkdir(parents=True, exist_ok=True)
                (root / READY_STAMP).unlink(missing_ok=True)
                # npm's own cache inside ours: the install is the same on a fresh machine and here
                cache = ["--cache", str(root / "npm-cache")]
                with open(log_path, "a") as log:
                    say(f"openclaw: npm install {NODE_SPEC} into {root / 'node'} (log: {log_path})")
                    _npm(["install", "--prefix", str(root / "node"), *cache, NODE_SPEC],
                         path_env=os.environ.get("PATH", ""), log=log, log_path=log_path)
                    if not node.exists():
                        raise RuntimeError(f"`npm install {NODE_SPEC}` left no {node}; see {log_path}")
                    path_env = f"{node.parent}{os.pathsep}{os.environ.get('PATH', '')}"
                    say(f"openclaw: npm install {OPENCLAW_SPEC} into {root / 'agent'} (a few minutes the first time)")
                    _npm(["install", "--prefix", str(root / "agent"), *cache, OPENCLAW_SPEC],
                         path_env=path_env, log=log, log_path=log_path)
                version = subprocess.run([str(node), str(_entry(package)), "--version"], capture_output=True,
                                         text=True, env={**os.environ, "PATH": path_env}, timeout=120)
                if version.returncode != 0:
                    raise RuntimeError(f"`openclaw --version` failed: {version.stderr[-2000:]}")
                (root / READY_STAMP).write_text(_spec() + "\n")
                seconds = time.monotonic() - started
                say(f"openclaw: {version.stdout.strip()} ready in {seconds:.0f}s")
                return OpenClawInstall(root, node, _entry(package), seconds, True)
    return OpenClawInstall(root, node, _entry(package), time.monotonic() - started, False)


# ------------------------------------------------------------------------------------------
# configuration and runs


def lean_config(base_url: str, api_key: str, model: str, *, max_tokens: int = 48,
                context_window: int = 8192, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenClaw's config for a gateway serving a small model (docs/openclaw.md explains each key):
    one custom provider of api `openai-completions` at the gateway, and the settings that shrink
    OpenClaw's ~10k-token default prompt to ~1.8k (no bootstrap files or skills, lean tools, no
    memory plugin), so a conversation fits SmolLM2's 8,192 tokens. *extra* deep-merges on top."""
    config: dict[str, Any] = {
        "models": {"mode": "replace", "providers": {"nextstate": {
            "baseUrl": base_url, "apiKey": api_key, "api": "openai-completions",
            "models": [{"id": model, "name": f"{model} via nextstate", "contextWindow": context_window,
                        "maxTokens": max_tokens, "input": ["text"], "reasoning": False,
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}],
        }}},
        "agents": {"defaults": {
            "model": {"primary": f"nextstate/{model}"},
            "models": {f"nextstate/{model}": {"params": {"temperature": 0}}},
            "skipBootstrap": True, "contextInjection": "never", "skills": [],
            "experimental": {"localModelLean": True},
        }},
        "tools": {"profile": "minimal", "toolSearch": False},
        "plugins": {"slots": {"memory": "none"}},
    }
    return _merge(config, extra or {})


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass
class AgentRun:
    message: str
    returncode: int
    seconds: float
    output: Any  # the --json reply, or None when stdout was not JSON
    stderr: str


class OpenClawAgent:
    """`openclaw agent --local` runs with their own HOME, state dir and config file."""

    def __init__(self, install: OpenClawInstall, home: Path):
        self.install, self.home = install, home
        self.state_dir = home / "state"
        home.mkdir(parents=True, exist_ok=True)

    def run(self, message: str, *, session_id: str, config: dict[str, Any], timeout_s: int = 300) -> AgentRun:
        config_path = self.home / "openclaw.json"
        config_path.write_text(json.dumps(config, indent=1))
        env = {**os.environ, "PATH": self.install.path_env, "HOME": str(self.home), "NO_COLOR": "1",
               "OPENCLAW_STATE_DIR": str(self.state_dir), "OPENCLAW_CONFIG_PATH": str(config_path)}
        cmd = [str(self.install.node), str(self.install.openclaw), "agent", "--local", "--json",
               "--session-id", session_id, "--timeout", str(timeout_s - 30), "--message", message]
        started = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, cwd=self.home)
        seconds = time.monotonic() - started
        try:
            output = json.loads(proc.stdout)
        except ValueError:
            output = None
        return AgentRun(message, proc.returncode, seconds, output, proc.stderr)


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"]:
        print("usage: python -m tests.support.openclaw_agent install   (Node 24 + OpenClaw into the cache)")
        return 2
    inst = ensure_openclaw()
    what = "installed" if inst.installed else "already installed"
    print(f"openclaw: {what} in {inst.seconds:.1f}s: {inst.openclaw}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
