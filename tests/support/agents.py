"""Coding agents people point at a gateway, for the real-agent tests: installed from npm (on the
npm package ``node@24``) or PyPI (each into its own venv) into ``$NEXTSTATE_CACHE_DIR/agents``
(default ``~/.cache/nextstate/agents``), pinned, the way tests/support/openclaw_agent.py installs OpenClaw.

`python -m tests.support.agents install [NAME ...]` installs them (all by default) and prints how long
each took. It is idempotent (a ready stamp per agent names its pinned version) and locked against
parallel runs, so the tests' fixtures call the same function.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from base.settings import Settings
from nextstate.modelserver import file_lock

NODE_SPEC = "node@24"
READY_STAMP = ".ready"


@dataclass(frozen=True)
class AgentPackage:
    name: str  # our name for it, the folder under the cache
    registry: str  # "npm" | "pypi"
    spec: str  # the pinned package
    bin: str  # its command


AGENTS: dict[str, AgentPackage] = {a.name: a for a in (
    AgentPackage("claude-code", "npm", "@anthropic-ai/claude-code@2.1.328", "claude"),
    AgentPackage("codex", "npm", "@openai/codex@0.171.0", "codex"),
    AgentPackage("qwen-code", "npm", "@qwen-code/qwen-code@0.24.4", "qwen"),
    AgentPackage("continue", "npm", "@continuedev/cli@1.5.47", "cn"),
    AgentPackage("mini-swe-agent", "pypi", "mini-swe-agent==2.4.6", "mini"),
)}


@dataclass(frozen=True)
class AgentInstall:
    package: AgentPackage
    root: Path
    command: list[str]  # argv prefix that runs the agent
    path_env: str  # a PATH with Node 24 (npm agents) or the agent's venv first
    seconds: float
    installed: bool  # False when the cache was already ready


def default_root() -> Path:
    return Settings().cache_dir / "agents"


def _node(root: Path) -> Path:
    return root / "node" / "node_modules" / ".bin" / "node"


def _bin(root: Path, a: AgentPackage) -> Path:
    if a.registry == "npm":
        return root / a.name / "node_modules" / ".bin" / a.bin
    return root / a.name / "venv" / "bin" / a.bin


def _ready(root: Path, a: AgentPackage) -> bool:
    stamp = root / a.name / READY_STAMP
    return stamp.exists() and stamp.read_text().strip() == a.spec and _bin(root, a).exists()


def _run(cmd: list[str], *, env: dict[str, str], log: Any, log_path: Path) -> None:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise RuntimeError(f"`{' '.join(cmd[:3])} …` failed (exit code {rc}); see {log_path}")


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed to install the npm agents (Debian: apt-get install npm)")
    return npm


def _path_env(root: Path, a: AgentPackage) -> str:
    first = _node(root).parent if a.registry == "npm" else _bin(root, a).parent
    return f"{first}{os.pathsep}{os.environ.get('PATH', '')}"


def _install(root: Path, a: AgentPackage, say: Any) -> None:
    folder = root / a.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / READY_STAMP).unlink(missing_ok=True)
    log_path = folder / "install.log"
    with open(log_path, "a") as log:
        if a.registry == "npm":
            cache = ["--cache", str(root / "npm-cache")]
            quiet = ["--no-audit", "--no-fund", "--loglevel=warn"]
            env = {**os.environ}
            if not _node(root).exists():
                say(f"agents: npm install {NODE_SPEC} into {root / 'node'}")
                _run([_npm(), "install", "--prefix", str(root / "node"), *cache, *quiet, NODE_SPEC],
                     env=env, log=log, log_path=log_path)
            env["PATH"] = _path_env(root, a)
            say(f"agents: npm install {a.spec} into {folder} (log: {log_path})")
            _run([_npm(), "install", "--prefix", str(folder), *cache, *quiet, a.spec],
                 env=env, log=log, log_path=log_path)
        else:
            venv = folder / "venv"
            say(f"agents: pip install {a.spec} into {venv} (log: {log_path})")
            _run([sys.executable, "-m", "venv", str(venv)], env={**os.environ}, log=log, log_path=log_path)
            _run([str(venv / "bin" / "pip"), "--disable-pip-version-check", "install", a.spec],
                 env={**os.environ}, log=log, log_path=log_path)
    if not _bin(root, a).exists():
        raise RuntimeError(f"installing {a.spec} left no {_bin(root, a)}; see {log_path}")
    (folder / READY_STAMP).write_text(a.spec + "\n")


def _command(root: Path, a: AgentPackage) -> list[str]:
    exe = _bin(root, a)
    if a.registry == "npm" and exe.resolve().suffix == ".js":
        return [str(_node(root)), str(exe.resolve())]
    return [str(exe)]


def ensure_agent(name: str, root: Path | None = None, say: Any = print) -> AgentInstall:
    """The agent *name* (a key of AGENTS) under *root*, installed unless already there."""
    a = AGENTS[name]
    root = root or default_root()
    started = time.monotonic()
    installed = False
    if not _ready(root, a):
        root.mkdir(parents=True, exist_ok=True)
        with file_lock(root / ".install.lock"):
            if not _ready(root, a):
                _install(root, a, say)
                installed = True
    seconds = time.monotonic() - started
    if installed:
        say(f"agents: {a.spec} ready in {seconds:.0f}s")
    return AgentInstall(a, root, _command(root, a), _path_env(root, a), seconds, installed)


@dataclass
class AgentRun:
    argv: list[str]
    returncode: int
    seconds: float
    stdout: str
    stderr: str

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError:
            return None


def run_agent(install: AgentInstall, args: list[str], *, home: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None, timeout_s: int = 300, stdin: str | None = None) -> AgentRun:
    """One run of the agent with its own HOME (its config and state live there); *stdin* is what
    a person types at its prompts (default: nothing, stdin is /dev/null)."""
    home.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PATH": install.path_env, "HOME": str(home), "NO_COLOR": "1",
                "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local" / "share"),
                "XDG_STATE_HOME": str(home / ".local" / "state"), "XDG_CACHE_HOME": str(home / ".cache"),
                **(env or {})}
    argv = [*install.command, *args]
    started = time.monotonic()
    # its own process group: npm agents run their real binary as a child, which a timeout must
    # end too (it would hold the output pipes open)
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, cwd=cwd or home,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[killed after {timeout_s} s]"
    return AgentRun(argv, proc.returncode, time.monotonic() - started, stdout, stderr)


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"] or any(n not in AGENTS for n in argv[1:]):
        print(f"usage: python -m tests.support.agents install [{'|'.join(AGENTS)} ...]   (into the cache)")
        return 2
    for name in argv[1:] or list(AGENTS):
        inst = ensure_agent(name)
        what = "installed" if inst.installed else "already installed"
        print(f"agents: {name} {what} in {inst.seconds:.1f}s: {' '.join(inst.command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
