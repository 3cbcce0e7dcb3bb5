"""Online continual training: the policy improves while it serves.

One loop (``nextstate train --online``), round after round:

1. wait until ``k`` newly scored turns are in the pool (or ``max_wait_s`` passed with at least
   ``min_turns``);
2. lease them (``trainer.lease``: a killed trainer's lease returns to the pool);
3. staleness: a turn carries the policy version that produced it; one more than ``staleness``
   versions behind the policy being trained is dropped or — the default — corrected with the
   exact importance ratio π_current / π_behaviour from its captured logprobs, capped;
4. train (``LocalTrainer``), save the adapter to a new directory, publish it as a *candidate*
   (loaded into every vLLM, not yet served), and record the step — the step's transaction
   acks the leases, so a turn is trained once whatever happens next;
5. eval gate: the candidate and the active version answer the held-out prompts; a candidate
   scoring more than ``eval_threshold`` below the active one is refused, otherwise it is
   promoted (the alias flips only after the adapter loaded: serving never pauses);
6. live monitor: a version this loop promoted whose live rewards fall more than
   ``rollback_threshold`` below its parent's is rolled back automatically.

Every decision is a ``policy_events`` row (``GET /api/policy/events``).

Crash safety. The run is one ``training_runs`` row that a restarted trainer continues
(``resume_run`` releases its unacked leases at once). A candidate published but whose step was
never recorded is discarded on restart (its turns are leased and trained again); a recorded
candidate without a decision is put through the gate; a promotion whose event was not written
is recorded. The alias only ever moves through ``trainer.publish``, which loads before it flips,
and each round first makes sure every vLLM still has the active version (a restarted vLLM has
no adapters).
"""

from __future__ import annotations

import importlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import httpx
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool.models import Judgement, PolicyEvent, PolicyVersion, Session, TrainingRun, TrainingStep, Turn
from datapool.queries import active_policy_version
from trainer import lease as leases
from trainer import publish
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.samples import load_samples

log = logging.getLogger("nextstate.online")

#: status of a candidate the eval gate refused (or a restart discarded); never served
REFUSED = "refused"

Scorer = Callable[[str, list[dict[str, Any]]], float]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


@dataclass
class OnlineConfig:
    """How the loop trains, gates and monitors."""

    k: int = 16  # new scored turns per round
    max_wait_s: float = 600.0  # ... or train on what there is (>= min_turns) after this long
    min_turns: int = 1
    poll_s: float = 2.0
    updates_per_round: int = 1  # optimizer steps over each round's batch
    lease_s: float = 600.0
    staleness: int = 2  # S: turns more than S versions behind are stale
    stale_policy: Literal["correct", "drop"] = "correct"
    ratio_cap: float = 2.0  # cap of the importance ratio of corrected stale turns
    # eval gate: held-out prompts (lists of messages) and a scorer (reply, messages) -> [0, 1]
    eval_prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    eval_sessions: int = 0  # also take prompts from the newest N sessions with mode "eval"
    eval_scorer: Scorer | None = None
    eval_threshold: float = 0.05  # refuse a candidate scoring more than this below the active one
    eval_max_tokens: int = 64
    # live monitor
    rollback_window: int = 16  # live scored turns of a version before it is judged
    rollback_threshold: float = 0.5  # roll back when its mean reward is this far below its parent's
    version_prefix: str = "online"
    max_rounds: int | None = None


@dataclass
class RoundResult:
    step: int
    turn_ids: list[str]
    dropped: list[str]
    corrected: list[str]
    candidate: str | None
    decision: str | None  # "promote" | "refuse" | None (nothing trained)
    metrics: dict[str, Any]


def load_scorer(path: str) -> Scorer:
    """``module:function`` → the function (reply text, prompt messages) -> score in [0, 1]."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"an eval scorer is `module:function`, not {path!r}")
    return getattr(importlib.import_module(module), attr)


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


def record_event(engine: Engine, action: str, *, version: str | None, actor: str, reason: str | None = None,
                 metrics: dict[str, Any] | None = None) -> None:
    with OrmSession(engine) as db, db.begin():
        vid = (db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == version)).first()
               if version else None)
        db.add(PolicyEvent(version_id=vid, action=action, actor=actor, reason=reason,
                           metrics=dict(metrics or {}), created_at=utcnow()))


def _chat(http: httpx.Client, url: str, model: str, messages: list[dict[str, Any]], max_tokens: int) -> str:
    resp = http.post(f"{url}/chat/completions", json={"model": model, "messages": messages,
                                                      "temperature": 0, "max_tokens": max_tokens})
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"].get("content") or ""


class OnlineTrainer:
    """The loop's state: its run, the trainer in memory and the version it was built from."""

    def __init__(self, engine: Engine, *, objective: ObjectiveConfig, local: LocalConfig,
                 filters: leases.Filters, config: OnlineConfig, vllm_urls: Sequence[str], base_model: str,
                 output_root: Path, store: Path | None = None,
                 on_round: Callable[[RoundResult], None] | None = None):
        self.engine = engine
        self.objective = objective
        self.local = local
        self.filters = filters
        self.cfg = config
        self.urls = [publish.normalize_vllm_url(u) for u in vllm_urls]
        self.base_model = base_model
        self.output_root = output_root
        self.store = store
        self.on_round = on_round
        self.trainer: LocalTrainer | None = None
        self.trainer_version: str | None = None  # the version the trainer's weights started from
        self.run_id = self._run()
        self.step = self._last_step()
        self._eval_cache: dict[str, float] = {}

    # -- the run ---------------------------------------------------------------------------------

    def _run(self) -> str:
        """The online run to continue (a restarted trainer picks its run up again) or a new one."""
        with OrmSession(self.engine) as db:
            runs = db.scalars(select(TrainingRun).where(TrainingRun.status == "running",
                                                        TrainingRun.backend == "local")
                              .order_by(TrainingRun.created_at.desc())).all()
            mine = [r.id for r in runs if (r.config or {}).get("online") == self.cfg.version_prefix
                    and (r.config or {}).get("objective", {}).get("objective") == self.objective.objective]
        if mine:
            log.info("continuing online run %s", mine[0])
            return leases.resume_run(self.engine, mine[0]).id
        config = {"online": self.cfg.version_prefix, "objective": asdict(self.objective), "k": self.cfg.k,
                  "lr": self.local.lr, "lora_rank": self.local.lora_rank, "staleness": self.cfg.staleness,
                  "stale_policy": self.cfg.stale_policy, "ratio_cap": self.cfg.ratio_cap,
                  "filters": {k: str(v) for k, v in asdict(self.filters).items() if v}}
        with OrmSession(self.engine) as db:
            active = active_policy_version(db)
        return leases.start_run(self.engine, objective=self.objective.objective, backend="local", config=config,
                                base_version=active.name if active else None)

    def _last_step(self) -> int:
        with OrmSession(self.engine) as db:
            return db.scalar(select(func.max(TrainingStep.step)).where(TrainingStep.run_id == self.run_id)) or 0

    def finish(self, status: str = "done") -> None:
        leases.finish_run(self.engine, self.run_id, status=status)

    def _my_versions(self) -> list[PolicyVersion]:
        with OrmSession(self.engine) as db:
            rows = db.scalars(select(PolicyVersion).where(PolicyVersion.kind == "lora")).all()
            for r in rows:
                db.expunge(r)
        return [r for r in rows if (r.stats or {}).get("run_id") == self.run_id]

    def _record_latency(self, name: str, metrics: dict[str, float]) -> None:
        """Adds the learning latency, known only once the alias flipped, to the promote event."""
        with OrmSession(self.engine) as db, db.begin():
            event = db.scalars(select(PolicyEvent).join(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
                               .where(PolicyVersion.name == name, PolicyEvent.action == "promote")
                               .order_by(PolicyEvent.id.desc()).limit(1)).first()
            if event is not None:
                event.metrics = {**(event.metrics or {}), **metrics}

    def _events(self, name: str) -> list[str]:
        with OrmSession(self.engine) as db:
            return list(db.scalars(select(PolicyEvent.action).join(PolicyVersion, PolicyVersion.id ==
                                                                   PolicyEvent.version_id)
                                   .where(PolicyVersion.name == name).order_by(PolicyEvent.id)))

    def recover(self) -> None:
        """Finish what a killed trainer of this run left half-done (see the module docstring)."""
        with OrmSession(self.engine) as db:
            recorded = {(s.metrics or {}).get("candidate") for s in db.scalars(
                select(TrainingStep).where(TrainingStep.run_id == self.run_id))}
        for row in self._my_versions():
            events = self._events(row.name)
            if row.status == "candidate" and row.name not in recorded:
                self._discard(row.name, "the trainer stopped before the step that trained it was recorded; "
                                        "its turns are trained again")
            elif row.status == "candidate":
                log.info("recovering: %s was trained and published but not decided", row.name)
                self.gate(row.name, row.stats or {})
            elif row.status == "active" and "promote" not in events:
                record_event(self.engine, "promote", version=row.name, actor="eval-gate",
                             reason="promoted before the trainer stopped; event recorded on restart")

    def _discard(self, name: str, reason: str) -> None:
        with OrmSession(self.engine) as db, db.begin():
            db.execute(update(PolicyVersion).where(PolicyVersion.name == name,
                                                   PolicyVersion.status == "candidate").values(status=REFUSED))
        with httpx.Client(timeout=30) as http:
            publish.unload(http, self.urls, name)
        record_event(self.engine, "refuse", version=name, actor="trainer", reason=reason)

    # -- serving state -----------------------------------------------------------------------------

    def active(self) -> PolicyVersion | None:
        with OrmSession(self.engine) as db:
            row = active_policy_version(db)
            if row is not None:
                db.expunge(row)
            return row

    def ensure_active_loaded(self) -> None:
        """A restarted vLLM has no runtime adapters: load the active version again (idempotent)."""
        row = self.active()
        if row is None:
            return
        try:
            publish.ensure_loaded(row.name, row.path or "", self.urls, base_model=row.base_model)
        except publish.PublishError as exc:
            log.error("the active version %s is not loaded everywhere and could not be reloaded: %s", row.name, exc)

    def lineage(self) -> list[str]:
        """Names from the active version back to the base model (whose turns carry its served name)."""
        chain: list[str] = []
        with OrmSession(self.engine) as db:
            row = active_policy_version(db)
            while row is not None:
                chain.append(row.name)
                row = db.get(PolicyVersion, row.parent_id) if row.parent_id is not None else None
        return [*chain, self.base_model]

    def _trainer(self) -> LocalTrainer:
        """The trainer, rebuilt from the active version whenever that is not where it started
        (a refused candidate's update, a rollback, another trainer's promotion)."""
        active = self.active()
        name = active.name if active else None
        if self.trainer is None or self.trainer_version != name:
            init = Path(active.path) if active is not None and active.path else None
            self.local.init_adapter = init
            log.info("building the trainer from %s", name or "the base model")
            self.trainer = LocalTrainer(self.local, self.objective)
            self.trainer_version = name
        return self.trainer

    # -- waiting ---------------------------------------------------------------------------------

    def available(self) -> int:
        """Scored turns this run has not trained on (nor leased) yet."""
        q = leases._candidates(self.run_id, self.filters, utcnow()).subquery()
        with OrmSession(self.engine) as db:
            return db.scalar(select(func.count()).select_from(q)) or 0

    def wait(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Block until a round can start; returns how many turns are ready (0: stopped)."""
        started = time.monotonic()
        while not stop():
            n = self.available()
            if n >= self.cfg.k or (n >= self.cfg.min_turns and time.monotonic() - started >= self.cfg.max_wait_s):
                return n
            self.monitor()
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
        trainer = self._trainer()
        parent = self.trainer_version
        lineage = self.lineage()
        with OrmSession(self.engine) as db:
            samples = load_samples(db, ids, trainer.tokenizer)
            produced = dict(db.execute(select(Turn.id, Turn.policy_version).where(Turn.id.in_(ids))).all())
            scored_at = dict(db.execute(select(Judgement.turn_id, Judgement.updated_at)
                                        .where(Judgement.turn_id.in_(ids))).all())
        lag = {tid: (lineage.index(produced[tid]) if produced.get(tid) in lineage else len(lineage)) for tid in ids}
        stale = {tid for tid in ids if lag[tid] > self.cfg.staleness}
        dropped = sorted(stale) if self.cfg.stale_policy == "drop" else []
        train = [s for s in samples if s.turn_id not in dropped]
        corrected = [s.turn_id for s in train if s.turn_id in stale]
        self.step += 1
        metrics: dict[str, Any] = {"turn_ids": ids, "dropped": dropped, "corrected": corrected,
                                   "max_lag": max(lag.values()), "parent": parent}
        if not train:
            leases.record_step(self.engine, self.run_id, self.step, ids, metrics)
            return self._done(RoundResult(self.step, ids, dropped, corrected, None, None, metrics))
        flags = [s.turn_id in stale for s in train]
        for _ in range(self.cfg.updates_per_round):
            step_metrics = trainer.step(train, correct=flags, ratio_cap=self.cfg.ratio_cap)
        metrics |= {k: v for k, v in step_metrics.items() if isinstance(v, float)}
        out = trainer.save(self.output_root / f"run-{self.run_id}" / f"step-{self.step}-{secrets.token_hex(3)}")
        name = f"{self.cfg.version_prefix}-{self.run_id[:8]}-s{self.step}-{secrets.token_hex(2)}"
        stats = {"run_id": self.run_id, "step": self.step, "turns": len(train), "objective": self.objective.objective,
                 "scored_at": {tid: _aware(t).isoformat() for tid, t in scored_at.items() if t is not None}}
        publish.publish_adapter(self.engine, out, name=name, base_model=self.base_model, vllm_urls=self.urls,
                                parent=parent, stats=stats, activate=False, store=self.store, actor="trainer",
                                reason=f"step {self.step} over {len(train)} turns ({len(corrected)} stale, "
                                       f"corrected; {len(dropped)} dropped)",
                                event_metrics={k: v for k, v in metrics.items() if k != "turn_ids"})
        shutil.rmtree(out, ignore_errors=True)  # the version store has its own copy
        metrics["candidate"] = name
        # from here on the turns count as trained: the step's transaction acks their leases
        leases.record_step(self.engine, self.run_id, self.step, ids, metrics)
        decision = self.gate(name, stats)
        if decision == "promote":
            self.trainer_version = name  # the weights in memory are the version now served
        else:
            self.trainer = None  # drop the refused update: the next round starts from the active version
        return self._done(RoundResult(self.step, ids, dropped, corrected, name, decision, metrics))

    def _done(self, result: RoundResult) -> RoundResult:
        if self.on_round:
            self.on_round(result)
        return result

    # -- eval gate -------------------------------------------------------------------------------

    def eval_prompts(self) -> list[list[dict[str, Any]]]:
        prompts = list(self.cfg.eval_prompts)
        if self.cfg.eval_sessions:
            with OrmSession(self.engine) as db:
                sids = db.scalars(select(Session.id).where(Session.mode == "eval")
                                  .order_by(Session.created_at.desc()).limit(self.cfg.eval_sessions)).all()
                for sid in sids:
                    first = db.scalars(select(Turn).where(Turn.session_id == sid, Turn.turn_type == "main")
                                       .order_by(Turn.created_at).limit(1)).first()
                    if first is not None and (first.request or {}).get("messages"):
                        prompts.append(list(first.request["messages"]))
        return prompts

    def evaluate(self, model: str) -> dict[str, Any]:
        """The version's mean score on the held-out prompts (greedy, on the first vLLM)."""
        prompts = self.eval_prompts()
        assert self.cfg.eval_scorer is not None
        with httpx.Client(timeout=300) as http, ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda m: _chat(http, self.urls[0], model, m, self.cfg.eval_max_tokens), prompts))
        scores = [float(self.cfg.eval_scorer(r, m)) for r, m in zip(replies, prompts)]
        return {"score": sum(scores) / len(scores), "n": len(scores)}

    def gate(self, name: str, stats: dict[str, Any]) -> str:
        """Promote the candidate or refuse it; returns "promote" or "refuse"."""
        active = self.active()
        current = active.name if active else self.base_model
        metrics: dict[str, Any] = {"against": current}
        if self.cfg.eval_scorer is not None and self.eval_prompts():
            try:
                if current not in self._eval_cache:
                    self._eval_cache[current] = self.evaluate(current)["score"]
                cand = self.evaluate(name)
            except httpx.HTTPError as exc:
                self._discard(name, f"eval failed: {type(exc).__name__}: {exc}")
                return "refuse"
            metrics |= {"score": cand["score"], "active_score": self._eval_cache[current], "n": cand["n"],
                        "threshold": self.cfg.eval_threshold}
            record_event(self.engine, "eval", version=name, actor="eval-gate", metrics=metrics)
            if cand["score"] < self._eval_cache[current] - self.cfg.eval_threshold:
                self._discard(name, f"held-out score {cand['score']:.3f} < {current} "
                                    f"{self._eval_cache[current]:.3f} - {self.cfg.eval_threshold}")
                log.info("refused %s: held-out %.3f vs %.3f", name, cand["score"], self._eval_cache[current])
                return "refuse"
            self._eval_cache[name] = cand["score"]
            reason = f"held-out score {cand['score']:.3f} vs {current} {self._eval_cache[current]:.3f}"
        else:
            reason = "no held-out set configured: promoted without an eval"
        # learning latency: from a turn being scored to a version trained on it serving (the
        # alias flips at the end of activate; the adapter load before it dominates)
        started = utcnow()
        publish.activate(self.engine, name, self.urls, actor="eval-gate", reason=reason, event_metrics=metrics)
        now = utcnow()
        latencies = [(now - datetime.fromisoformat(t)).total_seconds() for t in (stats.get("scored_at") or {}).values()]
        if latencies:
            self._record_latency(name, {"learning_latency_s_min": min(latencies),
                                        "learning_latency_s_max": max(latencies),
                                        "learning_latency_s_mean": sum(latencies) / len(latencies),
                                        "activate_s": (now - started).total_seconds()})
        log.info("promoted %s (%s)", name, reason)
        return "promote"

    # -- live monitor ----------------------------------------------------------------------------

    def _live_rewards(self, db: OrmSession, version: str, limit: int) -> list[float]:
        return [r for r in db.scalars(
            select(Judgement.reward).join(Turn, Turn.id == Judgement.turn_id)
            .where(Turn.policy_version == version, Judgement.reward.is_not(None),
                   ~select(Session.id).where(Session.id == Turn.session_id, Session.mode == "eval").exists())
            .order_by(Turn.created_at.desc()).limit(limit))]

    def monitor(self) -> str | None:
        """Roll the active version back when its live rewards regressed; returns the version
        rolled back from, or None."""
        with OrmSession(self.engine) as db:
            active = active_policy_version(db)
            if active is None or self.cfg.rollback_window <= 0:
                return None
            parent = db.get(PolicyVersion, active.parent_id) if active.parent_id is not None else None
            parent_name = parent.name if parent is not None else self.base_model
            live = self._live_rewards(db, active.name, self.cfg.rollback_window)
            before = self._live_rewards(db, parent_name, self.cfg.rollback_window)
            name = active.name
        if len(live) < self.cfg.rollback_window or not before:
            return None
        mean, base = sum(live) / len(live), sum(before) / len(before)
        if mean >= base - self.cfg.rollback_threshold:
            return None
        target = parent.name if parent is not None else publish.BASE
        try:
            publish.rollback(self.engine, self.urls, to=target, actor="live-monitor",
                             reason=f"mean live reward of {name} {mean:+.3f} over {len(live)} turns < "
                                    f"{parent_name} {base:+.3f} - {self.cfg.rollback_threshold}",
                             event_metrics={"live_reward": mean, "parent_reward": base, "n": len(live),
                                            "regressed": name})
        except publish.PublishError as exc:
            log.error("live rewards of %s regressed but the rollback failed: %s", name, exc)
            return None
        log.warning("rolled back %s to %s: live reward %.3f vs %.3f", name, target, mean, base)
        return name

    # -- the loop ----------------------------------------------------------------------------------

    def loop(self, stop: Callable[[], bool] = lambda: False) -> None:
        self.recover()
        rounds = 0
        while not stop() and (self.cfg.max_rounds is None or rounds < self.cfg.max_rounds):
            if not self.wait(stop):
                break
            if self.run_round() is not None:
                rounds += 1
            self.monitor()


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
