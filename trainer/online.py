"""Online continual training: the policy improves while it serves.

One loop (``nextstate train --online``), round after round:

1. wait until ``k`` newly scored turns are in the pool (or ``max_wait_s`` passed with at least
   ``min_turns``);
2. lease them (``datapool.leases``: a killed trainer's lease returns to the pool);
3. staleness: a turn carries the policy version that produced it; one more than ``staleness``
   versions behind the policy being trained is dropped or — the default — corrected with the
   exact importance ratio π_current / π_behaviour from its captured logprobs, capped;
4. train (``LocalTrainer``), save the adapter to a new directory, publish it as a *candidate*
   (loaded into every vLLM, not yet served), and record the step — the step's transaction
   acks the leases, so a turn is trained once whatever happens next;
5. eval gate (``trainer.eval_gate``): the candidate and the active version answer the held-out prompts; a candidate
   scoring more than ``eval_threshold`` below the active one, or (``topic_scorer``) whose on-topic
   share falls more than ``topic_margin`` below the base model's, is refused and the round's
   update dropped (or, ``refused_update="keep"``, trained on while the active version serves on),
   otherwise it is promoted (the alias flips only after the adapter loaded:
   serving never pauses); ``drift_metrics`` adds the candidate's KL to the base, entropy and
   top-k masses on the round's tokens to the step's metrics (``trainer.drift``);
6. live monitor (``trainer.monitor``): a version this loop promoted whose live rewards fall more than
   ``rollback_threshold`` below its parent's is rolled back automatically.

Every decision is a ``policy_events`` row (``GET /api/policy/events``).

Crash safety. The run is one ``training_runs`` row that a restarted trainer continues
(``resume_run`` releases its unacked leases at once). A candidate published but whose step was
never recorded is discarded on restart (its turns are leased and trained again); a recorded
candidate without a decision is put through the gate; a promotion whose event was not written
is recorded. The alias only ever moves through ``publishing.publish``, which loads before it flips,
and each round first makes sure every vLLM still has the active version (a restarted vLLM has
no adapters).

A vLLM that is down or restarting does not stop the loop. A round it could not take (publish,
gate or monitor failing at a vLLM) is undone as a restart would undo it: the update in memory
is dropped, the round's unrecorded turns go back to the pool, and what it left half-done is
finished. Then the loop waits (``poll_s`` doubling up to ``retry_max_s``) and tries again.
"""

from __future__ import annotations

import json
import logging
import pkgutil
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool import leases, queries, siblings, versions
from vllm_client.adapters import ensure_loaded
from base.errors import AdminError, PublishError
from vllm_client.http import openai_base
from base.vocab import PolicyAction, TrainBackend, VersionKind, VersionStatus
from trainer import drift
from trainer.config import OnlineConfig, Scorer
from trainer.eval_gate import EvalGate
from trainer.local import LocalConfig, LocalTrainer, StepProgress
from trainer.monitor import LiveMonitor
from trainer.objectives import ObjectiveConfig
from publishing.publish import PublishRequest, publish
from trainer.samples import Sample, load_samples

log = logging.getLogger("nextstate.online")

#: status of a candidate the eval gate refused (or a restart discarded); never served
REFUSED = VersionStatus.REFUSED
#: what a vLLM that is down, restarting or refusing raises through publish, the gate and the monitor
VLLM_ERRORS = (PublishError, AdminError, httpx.HTTPError)


@dataclass
class RoundResult:
    step: int
    turn_ids: list[str]
    dropped: list[str]
    corrected: list[str]
    candidate: str | None
    decision: str | None  # "promote" | "refuse" | None (nothing trained)
    metrics: dict[str, Any]
    reason: str | None = None  # why the gate refused the candidate


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class RoundProgress:
    """Logs how far a round's training is: its update, tokens passed, time elapsed and an
    estimate of the time left, at most every ``every_s`` seconds (and when an update ends)."""

    def __init__(self, step: int, updates: int, every_s: float = 15.0):
        self.step = step
        self.updates = updates
        self.every_s = every_s
        self.started = time.monotonic()
        self.logged = self.started

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, update: int, progress: StepProgress) -> None:
        now = time.monotonic()
        last = progress.tokens >= progress.tokens_total
        if now - self.logged < self.every_s and not last:
            return
        self.logged = now
        done = (update + progress.tokens / max(progress.tokens_total, 1)) / self.updates
        left = self.elapsed_s * (1 - done) / done if done > 0 else None
        log.info("round %d: update %d/%d, %s/%s tokens, %s elapsed, %s", self.step, update + 1, self.updates,
                 f"{progress.tokens:,}", f"{progress.tokens_total:,}", _duration(self.elapsed_s),
                 f"~{_duration(left)} left" if left is not None else "estimating")


def load_scorer(path: str) -> Scorer:
    """``module:function`` → the function (reply text, prompt messages) -> score in [0, 1]."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"an eval scorer is `module:function`, not {path!r}")
    return pkgutil.resolve_name(path)


def load_prompts(path: Path) -> list[list[dict[str, Any]]]:
    """Held-out prompts: a JSONL file of ``{"messages": [...]}`` (or a bare messages list), or a
    text file with one user prompt per line."""
    out: list[list[dict[str, Any]]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{") or line.startswith("["):
            obj = json.loads(line)
            out.append(list(obj["messages"] if isinstance(obj, dict) else obj))
        else:
            out.append([{"role": "user", "content": line}])
    return out


class OnlineTrainer:
    """The loop's state: its run, the trainer in memory and the version it was built from; its
    candidates go through :attr:`gate` and the version it serves is watched by :attr:`monitor`."""

    def __init__(self, engine: Engine, *, objective: ObjectiveConfig, local: LocalConfig,
                 filters: leases.Filters, config: OnlineConfig, vllm_urls: Sequence[str], base_model: str,
                 output_root: Path, store: Path | None = None,
                 on_round: Callable[[RoundResult], None] | None = None):
        self.engine = engine
        self.objective = objective
        self.local = local
        self.filters = filters
        self.cfg = config
        self.urls = [openai_base(u) for u in vllm_urls]
        self.base_model = base_model
        self.output_root = output_root
        self.store = store
        self.on_round = on_round
        self.trainer: LocalTrainer | None = None
        self.trainer_version: str | None = None  # the version the trainer's weights started from
        #: refused candidates whose updates the weights in memory carry (``refused_update="keep"``)
        self.carried: list[str] = []
        self.gate = EvalGate(engine, self.urls, base_model, prompts=config.eval_prompts,
                             sessions=config.eval_sessions, scorer=config.eval_scorer,
                             threshold=config.eval_threshold, max_tokens=config.eval_max_tokens,
                             topic_scorer=config.topic_scorer, topic_margin=config.topic_margin,
                             topic_reference=config.topic_reference, samples=config.eval_samples,
                             temperature=config.eval_temperature)
        self.monitor = LiveMonitor(engine, self.urls, base_model, window=config.rollback_window,
                                   threshold=config.rollback_threshold)
        self.run_id = self._run()
        self.step = leases.last_step(engine, self.run_id)
        # the samples of the last replay_rounds rounds, trained on again (OnlineConfig.replay_rounds)
        self.replay: deque[list[Sample]] = deque(maxlen=config.replay_rounds)
        self.failures = 0  # rounds in a row a vLLM could not take
        self._stop: Callable[[], bool] = lambda: False  # loop()'s: a round's waits end when it says so
        self.kl = None  # the adaptive KL anchor (OnlineConfig.kl_target)
        if config.kl_target is not None:
            if objective.kl_coef <= 0:
                raise ValueError("kl_target adapts the KL anchor from kl_coef: set kl_coef > 0 as its starting value")
            from verl.trainer.ppo.core_algos import AdaptiveKLController

            self.kl = AdaptiveKLController(objective.kl_coef, config.kl_target, config.kl_horizon)
            self.kl_start = objective.kl_coef  # the floor, with OnlineConfig.kl_floor
        self.last_error: str | None = None

    # -- the run ---------------------------------------------------------------------------------

    def _run(self) -> str:
        """The online run to continue (a restarted trainer picks its run up again) or a new one."""
        mine = leases.running_run(self.engine, TrainBackend.LOCAL, lambda c: (
            c.get("online") == self.cfg.version_prefix
            and c.get("objective", {}).get("objective") == self.objective.objective))
        if mine:
            log.info("continuing online run %s", mine)
            return leases.resume_run(self.engine, mine).id
        config = {"online": self.cfg.version_prefix, "objective": asdict(self.objective), "k": self.cfg.k,
                  "lr": self.local.lr, "lora_rank": self.local.lora_rank, "staleness": self.cfg.staleness,
                  "stale_policy": self.cfg.stale_policy, "ratio_cap": self.cfg.ratio_cap,
                  "filters": {k: str(v) for k, v in asdict(self.filters).items() if v}}
        active = versions.active_row(self.engine)
        return leases.start_run(self.engine, objective=self.objective.objective, backend=TrainBackend.LOCAL,
                                config=config, base_version=active.name if active else None)

    def finish(self, status: str = "done") -> None:
        leases.finish_run(self.engine, self.run_id, status=status)

    def recover(self) -> None:
        """Finish what a killed trainer of this run left half-done (see the module docstring)."""
        recorded = {m.get("candidate") for m in leases.step_metrics(self.engine, self.run_id)}
        for row in versions.versions_of_run(self.engine, self.run_id):
            events = versions.event_actions(self.engine, row.name)
            if row.status == VersionStatus.CANDIDATE and row.name not in recorded:
                self.gate.discard(row.name, "the trainer stopped before the step that trained it was recorded; "
                                            "its turns are trained again")
            elif row.status == VersionStatus.CANDIDATE:
                log.info("recovering: %s was trained and published but not decided", row.name)
                self.gate.decide(row.name, row.stats or {})
            elif row.status == VersionStatus.ACTIVE and PolicyAction.PROMOTE not in events:
                versions.record_event(self.engine, PolicyAction.PROMOTE, version=row.name, actor="eval-gate",
                                      reason="promoted before the trainer stopped; event recorded on restart")

    # -- serving state -----------------------------------------------------------------------------

    def ensure_active_loaded(self) -> None:
        """A restarted vLLM has no runtime adapters: load the active version again (idempotent)."""
        row = versions.active_row(self.engine)
        if row is None:
            return
        try:
            ensure_loaded(row.name, row.path or "", self.urls, base_model=row.base_model)
        except AdminError as exc:
            log.error("the active version %s is not loaded everywhere and could not be reloaded: %s", row.name, exc)

    def lineage(self) -> list[str]:
        """Names from the active version back to the base model (whose turns carry its served name)."""
        return [*versions.lineage(self.engine), self.base_model]

    def _trainer(self) -> LocalTrainer:
        """The trainer, rebuilt from the active version whenever that is not where it started
        (a refused candidate's update, a rollback, another trainer's promotion)."""
        active = versions.active_row(self.engine)
        name = active.name if active else None
        if self.trainer is None or self.trainer_version != name:
            init = Path(active.path) if active is not None and active.path else None
            self.local.init_adapter = init
            log.info("building the trainer from %s", name or "the base model")
            self.trainer = LocalTrainer(self.local, self.objective)
            self.trainer_version = name
            self.carried = []
        return self.trainer

    # -- waiting ---------------------------------------------------------------------------------

    def available(self) -> int:
        """Scored turns this run has not trained on (nor leased) yet."""
        return leases.available(self.engine, self.run_id, self.filters)

    def wait(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Block until a round can start; returns how many turns are ready (0: stopped)."""
        started = time.monotonic()
        seen = -1
        while not stop():
            n = self.available()
            if n >= self.cfg.k or (n >= self.cfg.min_turns and time.monotonic() - started >= self.cfg.max_wait_s):
                return n
            if n != seen:
                log.info("round %d: %d of %d scored turns ready", self.step + 1, n, self.cfg.k)
                seen = n
            self.monitor.check()
            time.sleep(self.cfg.poll_s)
        return 0

    # -- one round -------------------------------------------------------------------------------

    def run_round(self) -> RoundResult | None:
        """Lease up to k turns, train, publish a candidate, gate it. None: nothing to lease."""
        self.ensure_active_loaded()
        ids = leases.lease(self.engine, self.run_id, limit=self.cfg.k, lease_s=self.cfg.lease_s,
                           filters=self.filters)
        if not ids:
            return None
        self._await_siblings(ids)
        trainer = self._trainer()
        parent = self.trainer_version
        lineage = self.lineage()
        with OrmSession(self.engine) as db:
            samples = load_samples(db, ids, trainer.tokenizer)
            produced = queries.produced_by(db, ids)
            scored_at = queries.scored_at(db, ids)
        lag = {tid: (lineage.index(produced[tid]) if produced.get(tid) in lineage else len(lineage)) for tid in ids}
        stale = {tid for tid in ids if lag[tid] > self.cfg.staleness}
        dropped = sorted(stale) if self.cfg.stale_policy == "drop" else []
        # a shadow sibling is as stale as its original (it was sampled from the same prompt, later)
        train = [s for s in samples if (s.sibling_of or s.turn_id) not in dropped]
        corrected = [s.turn_id for s in train if s.turn_id in stale]
        self.step += 1
        metrics: dict[str, Any] = {"turn_ids": ids, "dropped": dropped, "corrected": corrected,
                                   "max_lag": max(lag.values()), "parent": parent}
        if self.carried:  # refused candidates this one trains on top of (refused_update="keep")
            metrics["carried"] = list(self.carried)
        if not train:
            leases.record_step(self.engine, self.run_id, self.step, ids, metrics)
            return self._done(RoundResult(self.step, ids, dropped, corrected, None, None, metrics))
        flags = [(s.sibling_of or s.turn_id) in stale for s in train]
        # earlier rounds' turns again: sampled by an older policy, so corrected as stale turns are
        replayed = [s for past in self.replay for s in past]
        batch, batch_flags = train + replayed, flags + [True] * len(replayed)
        metrics["replayed"] = len(replayed)
        updates = self.cfg.updates_per_round
        log.info("round %d: training on %d turns (%s tokens; %d replayed), %d update%s", self.step, len(batch),
                 f"{sum(len(s.prompt_ids) + len(s.response_ids) for s in batch):,}", len(replayed), updates,
                 "s" * (updates > 1))
        report = RoundProgress(self.step, updates)
        for update in range(updates):
            step_metrics = trainer.step(batch, correct=batch_flags, ratio_cap=self.cfg.ratio_cap,
                                        progress=lambda p, u=update: report(u, p))
        self.replay.append(train)  # kept for the next replay_rounds rounds (none when 0)
        log.info("round %d: trained in %s; publishing the candidate", self.step, _duration(report.elapsed_s))
        metrics |= {k: v for k, v in step_metrics.items() if isinstance(v, float)}
        if self.cfg.drift_metrics or self.kl is not None:
            metrics |= drift.round_drift(trainer, train)
            log.info("round %d: drift %s", self.step, " ".join(f"{k} {metrics[k]:.4g}" for k in drift.KEYS
                                                                if k in metrics))
        if self.kl is not None and "drift_kl_k3" in metrics:
            self._adapt_kl(trainer, metrics)
        if self.objective.opd_topk and 0 < self.cfg.opd_topk_rounds <= self.step:
            self._end_topk(trainer, metrics)
        out = trainer.save(self.output_root / f"run-{self.run_id}" / f"step-{self.step}-{secrets.token_hex(3)}")
        peak = trainer.release_device_memory()  # nothing cached held while the loop waits for the next round
        if peak is not None:
            metrics["device_peak_gib"] = round(peak, 3)
        name = f"{self.cfg.version_prefix}-{self.run_id[:8]}-s{self.step}-{secrets.token_hex(2)}"
        stats = {"run_id": self.run_id, "step": self.step, "turns": len(train), "objective": self.objective.objective,
                 "scored_at": {tid: t.isoformat() for tid, t in scored_at.items()}}
        try:
            publish(self.engine, PublishRequest(
                out, base_model=self.base_model, vllm_urls=self.urls, kind=VersionKind.LORA, name=name, parent=parent,
                stats=stats, activate=False, store=self.store, actor="trainer",
                reason=f"step {self.step} over {len(train)} turns ({len(corrected)} stale, "
                       f"corrected; {len(dropped)} dropped)",
                event_metrics={k: v for k, v in metrics.items() if k != "turn_ids"}))
        finally:
            shutil.rmtree(out, ignore_errors=True)  # the version store has its own copy (or, failed, none)
        metrics["candidate"] = name
        # from here on the turns count as trained: the step's transaction acks their leases
        leases.record_step(self.engine, self.run_id, self.step, ids, metrics)
        decision = self.gate.decide(name, stats)
        if decision == PolicyAction.PROMOTE:
            self.trainer_version = name  # the weights in memory are the version now served
            self.carried = []
        elif self.cfg.refused_update == "keep":
            self.carried.append(name)  # the next round trains on top of it; the active version serves on
        else:
            self.trainer = None  # drop the refused update: the next round starts from the active version
        return self._done(RoundResult(self.step, ids, dropped, corrected, name, decision, metrics,
                                      self.gate.last_reason))

    def _await_siblings(self, ids: Sequence[str]) -> None:
        """Wait (``siblings_wait_s``, stopping when the loop is told to) until no leased turn's shadow
        siblings are still to come: those a worker has yet to resample and those not scored yet."""
        if self.cfg.siblings_wait_s <= 0:
            return
        deadline = time.monotonic() + self.cfg.siblings_wait_s
        while True:
            with OrmSession(self.engine) as db:
                pending = siblings.awaiting(db, ids)
            if not pending or time.monotonic() >= deadline or self._stop():
                break
            time.sleep(self.cfg.poll_s)
        if pending:
            log.info("round %d: training without the siblings of %d of %d turns (not scored within %.0f s)",
                     self.step + 1, len(pending), len(ids), self.cfg.siblings_wait_s)

    def _adapt_kl(self, trainer: LocalTrainer, metrics: dict[str, Any]) -> None:
        """The next round's KL anchor from this round's drift (:attr:`OnlineConfig.kl_target`): the
        coefficient this round trained with goes in the metrics as ``kl_coef``, the next one as
        ``kl_coef_next``; a trainer rebuilt later (a refused candidate) takes the new one too."""
        assert self.kl is not None
        metrics["kl_coef"] = self.objective.kl_coef
        self.kl.update(metrics["drift_kl_k3"], 1)
        if self.cfg.kl_floor:
            self.kl.value = max(self.kl.value, self.kl_start)
        self.objective = replace(self.objective, kl_coef=float(self.kl.value))
        trainer.objective = self.objective
        metrics["kl_coef_next"] = self.objective.kl_coef
        log.info("round %d: KL to the base %.4g (target %.4g): kl_coef %.4g -> %.4g", self.step,
                 metrics["drift_kl_k3"], self.kl.target, metrics["kl_coef"], metrics["kl_coef_next"])

    def _end_topk(self, trainer: LocalTrainer, metrics: dict[str, Any]) -> None:
        """Top-k OPD's last round (:attr:`OnlineConfig.opd_topk_rounds`): the next rounds, and a trainer
        rebuilt later, train with the sampled-token OPD advantage; ``opd_topk_next`` in the metrics."""
        self.objective = replace(self.objective, opd_topk=False)
        trainer.objective = self.objective
        metrics["opd_topk_next"] = False
        log.info("round %d: top-k OPD for %d round(s) done: sampled-token OPD from the next round on", self.step,
                 self.cfg.opd_topk_rounds)

    def _done(self, result: RoundResult) -> RoundResult:
        if self.on_round:
            self.on_round(result)
        return result

    # -- the loop ----------------------------------------------------------------------------------

    def loop(self, stop: Callable[[], bool] = lambda: False) -> None:
        self._stop = stop
        self.recover()
        rounds = 0
        while not stop() and (self.cfg.max_rounds is None or rounds < self.cfg.max_rounds):
            try:
                if self.failures:
                    self.recover()  # what the failed round left half-done, as a restart would
                if not self.wait(stop):
                    break
                if self.run_round() is not None:
                    rounds += 1
                self.monitor.check()
            except VLLM_ERRORS as exc:
                self.failed(exc)
                delay = min(self.cfg.retry_max_s, self.cfg.poll_s * 2 ** self.failures)
                log.error("a vLLM could not take round %d (%s: %s); its turns go back to the pool, trying again "
                          "in %.0f s", self.step + 1, type(exc).__name__, exc, delay)
                deadline = time.monotonic() + delay
                while not stop() and time.monotonic() < deadline:
                    time.sleep(min(0.5, delay))
                continue
            self.failures, self.last_error = 0, None

    def failed(self, exc: BaseException) -> None:
        """Undo a round a vLLM could not take, as a restart would: drop the update in memory
        (the next round starts from the version served), give its unrecorded turns back to the
        pool, and number the next step after the last one recorded."""
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.trainer = None
        leases.release_unacked(self.engine, self.run_id)
        self.step = leases.last_step(self.engine, self.run_id)


def run_online(engine: Engine, *, objective: ObjectiveConfig, local: LocalConfig, filters: leases.Filters,
               config: OnlineConfig, vllm_urls: Sequence[str], base_model: str, output_root: Path,
               echo: Callable[[str], None] = print) -> None:
    """`nextstate train --online`: the loop until SIGINT/SIGTERM (the round in progress finishes
    first; a SIGKILL is safe too, see the module docstring) or ``config.max_rounds``."""
    import signal
    import threading

    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stopping.is_set():
            raise KeyboardInterrupt
        echo("stopping after the round in progress (again to stop now) ...")
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_round(r: RoundResult) -> None:
        echo(f"round {r.step}: {len(r.turn_ids)} turns ({len(r.corrected)} corrected, {len(r.dropped)} dropped)"
             + (f" -> {r.candidate}: {r.decision}" if r.candidate else " -> nothing to train"))

    trainer = OnlineTrainer(engine, objective=objective, local=local, filters=filters, config=config,
                            vllm_urls=vllm_urls, base_model=base_model, output_root=output_root, on_round=on_round)
    echo(f"online run {trainer.run_id}: waiting for {config.k} scored turns per round")
    try:
        trainer.loop(stopping.is_set)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if config.max_rounds is not None and not stopping.is_set():
        trainer.finish()
