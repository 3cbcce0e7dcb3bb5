"""`nextstate up`: everything on one machine, supervised.

:class:`Up` starts the policy vLLM (and its teacher replica for scoring), reloads the pool's
active policy version into each, then the scoring worker and the online trainer, then serves
the gateway in this process. Its children share one environment, built once
(:meth:`Up.child_env`). A child that exits is restarted by :class:`nextstate.supervisor.Supervisor`
(a restarted vLLM gets the active version again before it counts as running); the gateway's
``/readyz`` and ``/metrics`` show each child's state. SIGINT, SIGTERM and SIGHUP stop the gateway
and every child's process group; so does giving up on a vLLM or the worker, and then `up` exits 1.
Giving up on the trainer (it keeps exiting the same way: the OOM killer on a round too big for
the machine) stops only the trainer: the policy keeps serving, the console and ``/readyz`` say why.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from base.settings import Settings
from base.vocab import VersionKind
from nextstate.modelserver import TEACHER_ARGS, VLLMServer, ensure_model, ensure_vllm_env
from nextstate.supervisor import Command, RestartPolicy, Supervisor, on_stop_signals

#: what `nextstate train --online` imports beyond the base install (the `train` extra)
TRAIN_MODULES = ("torch", "transformers", "peft")


def missing_train_modules() -> list[str]:
    """The modules of the `train` extra this environment lacks."""
    return [m for m in TRAIN_MODULES if importlib.util.find_spec(m) is None]


class Up:
    """The processes of `nextstate up` (see the module docstring)."""

    def __init__(self, settings: Settings, *, scoring: bool, train_objective: str | None,
                 train_args: Sequence[str] = (), log_level: str = "info", restarts: int = 5,
                 echo: Callable[[str], None] = click.echo):
        self.echo = echo
        self.scoring = scoring
        self.train_objective = train_objective
        self.train_args = list(train_args)
        self.log_level = log_level
        self.logs = settings.data_dir / "logs"
        if train_objective and (missing := missing_train_modules()):
            raise click.ClickException(
                f"--train needs the trainer's packages ({', '.join(missing)} missing here): "
                f"`make up` installs them, or {Path(sys.executable).parent / 'pip'} install "
                "torch==2.13.0 -e '.[train]' (on a machine without a GPU, the CPU build: add "
                "--extra-index-url https://download.pytorch.org/whl/cpu and torch==2.13.0+cpu)")
        python = ensure_vllm_env(settings.cache_dir, log=echo)
        self.model_dir = ensure_model(settings.cache_dir, python, log=echo)
        common = dict(served_name=settings.vllm_served_name, host="127.0.0.1", dev_mode=settings.vllm_dev_mode,
                      max_model_len=settings.vllm_max_model_len, dtype=settings.vllm_dtype)
        self.policy = VLLMServer(python, self.model_dir, name="vllm", port=settings.vllm_port,
                                 log_path=self.logs / "vllm.log", **common)
        self.teacher = VLLMServer(python, self.model_dir, name="vllm-teacher", port=settings.teacher_vllm_port,
                                  log_path=self.logs / "vllm-teacher.log", extra_args=TEACHER_ARGS,
                                  **common) if scoring else None
        self.settings = settings.model_copy(update={
            "upstream_url": self.policy.base_url, "upstream_model": settings.vllm_served_name,
            "teacher_url": self.teacher.base_url if self.teacher else None})
        self.supervisor = Supervisor(echo=echo, policy=RestartPolicy(limit=restarts), on_fatal=self._on_fatal)
        self._gateway: object | None = None  # the uvicorn server, once serving
        self._signal: signal.Signals | None = None

    @property
    def servers(self) -> list[VLLMServer]:
        return [self.policy, *([self.teacher] if self.teacher else [])]

    def child_env(self) -> dict[str, str]:
        """The environment of the worker and the trainer: where the pool, the policy and the
        teacher are."""
        env = {**os.environ, "NEXTSTATE_UPSTREAM_URL": self.policy.base_url,
               "NEXTSTATE_UPSTREAM_MODEL": self.settings.vllm_served_name,
               "NEXTSTATE_DATABASE_URL": self.settings.resolved_database_url}
        if self.teacher:
            env["NEXTSTATE_TEACHER_URL"] = self.teacher.base_url
        return env

    # -- running ---------------------------------------------------------------------------------

    def run(self) -> None:
        """Start everything, serve until a stop signal (or a child given up on: ClickException)."""
        from datapool.db import upgrade

        upgrade(self.settings.resolved_database_url)
        self._check_active_version()
        self.logs.mkdir(parents=True, exist_ok=True)
        with on_stop_signals(self._on_signal):
            try:
                self._run()
            finally:
                self.supervisor.stop()
        if self.supervisor.fatal:
            raise click.ClickException(f"stopped: {self.supervisor.fatal}")
        if self._signal is not None:
            self.echo(f"stopped ({self._signal.name})")

    def _run(self) -> None:
        settings = self.settings
        if settings.vllm_dev_mode:
            self.echo("vLLM dev mode: /pause, /resume, /collective_rpc are open on 127.0.0.1 (full-weight publishing)")
        self.echo(f"starting vLLM on 127.0.0.1:{settings.vllm_port}"
                  + (f" and its teacher replica on :{settings.teacher_vllm_port}" if self.teacher else "")
                  + f" (logs in {self.logs}) ...")
        for server in self.servers:
            self.supervisor.add(server, after_start=self._reloader(server))
        if not self.supervisor.start():
            return
        env = self.child_env()
        if self.scoring:
            self.supervisor.add(Command("worker", [sys.executable, "-m", "nextstate.cli", "worker", "--log-level",
                                                   self.log_level], env=env, log_path=self.logs / "worker.log"))
            self.echo(self._judge_line())
        if self.train_objective:
            self.supervisor.add(Command(
                "trainer", [sys.executable, "-m", "nextstate.cli", "train", "--online", "--objective",
                            self.train_objective, "--model-dir", str(self.model_dir), "--log-level", self.log_level,
                            *self.train_args], env=env, log_path=self.logs / "trainer.log"),
                essential=False)  # a trainer given up on leaves the policy serving; /readyz says why
            self.echo(f"trainer: online, {self.train_objective} (log: {self.logs / 'trainer.log'})")
        if not self.supervisor.start():
            return
        self.echo(f"pool: {settings.resolved_database_url}")
        self.echo(f"model: {settings.vllm_served_name} (also as `policy`)")
        from nextstate.gateway_server import gateway_server

        self._gateway = server = gateway_server(settings, processes=self.supervisor.report, own_signals=False)
        if not self.supervisor.stopping:
            server.run()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._signal is None:
            self.echo(f"{sig.name}: stopping every process ...")
        self._signal = sig
        self._stop_serving()

    def _on_fatal(self, reason: str) -> None:
        self._stop_serving()

    def _stop_serving(self) -> None:
        self.supervisor.request_stop()
        if self._gateway is not None:
            self._gateway.should_exit = True  # type: ignore[attr-defined]

    # -- the active version ------------------------------------------------------------------------

    def _check_active_version(self) -> None:
        """A full version can only be loaded into a vLLM in dev mode: say so before starting."""
        from datapool.db import make_engine
        from datapool.versions import active_version

        engine = make_engine(self.settings.resolved_database_url)
        try:
            current = active_version(engine)
        finally:
            engine.dispose()
        if current is not None and current["kind"] == VersionKind.FULL and not self.settings.vllm_dev_mode:
            raise click.ClickException(
                f"the active policy version {current['name']} is a full checkpoint: its weights can only "
                "be loaded into a vLLM in dev mode; run with --vllm-dev-mode (NEXTSTATE_VLLM_DEV_MODE=1) "
                "or `nextstate policy rollback` first")

    def _reloader(self, server: VLLMServer) -> Callable[[], None]:
        """A fresh vLLM has no runtime adapters: load the pool's active version into *server*
        before it counts as running (and before the gateway's `policy` reaches it)."""

        def reload() -> None:
            from datapool.db import make_engine
            from base.errors import AdminError, PublishError
            from datapool.versions import active_version
            from publishing.publish import activate

            engine = make_engine(self.settings.resolved_database_url)
            try:
                current = active_version(engine)
                if current is None:
                    return
                for attempt in range(3):  # the gateway's watch may be loading it at the same moment
                    try:
                        activate(engine, current["name"], [server.base_url], actor="up",
                                 reason=f"{server.name} started")
                        break
                    except (PublishError, AdminError):
                        if attempt == 2:
                            raise
                        time.sleep(2)
                self.echo(f"{server.name}: policy {current['name']} loaded")
            finally:
                engine.dispose()
        return reload

    def _judge_line(self) -> str:
        settings, log = self.settings, self.logs / "worker.log"
        if settings.judge_backend == "python":
            return f"worker: python judge {settings.judge_python} (log: {log})"
        if settings.judge_model:
            return f"worker: LLM judge {settings.judge_model} (log: {log})"
        return (f"worker: LLM judge on {settings.vllm_served_name}, the policy judging itself: weak "
                f"votes, noisy hints (log: {log})\n"
                "  a stronger judge, any LiteLLM provider: NEXTSTATE_JUDGE_MODEL=openai/gpt-4.1-mini "
                "(OPENAI_API_KEY), anthropic/claude-sonnet-4-5 (ANTHROPIC_API_KEY), or "
                "hosted_vllm/NAME with NEXTSTATE_JUDGE_API_BASE=http://HOST:PORT/v1 (docs/worker.md)")
