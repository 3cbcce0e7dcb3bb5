"""Prometheus metrics of one gateway process (its own registry: no global state)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

#: the processes a supervisor (`nextstate up`) runs beside the gateway: name -> {"state":
#: starting | running | restarting | failed | stopped, "restarts": n, "exits": {reason: n},
#: "last_exit": reason or None, ...}
ProcessReport = Callable[[], Mapping[str, Mapping[str, Any]]]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "nextstate_request_seconds",
            "Time from request received to response finished (stream end for streams).",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "nextstate_upstream_seconds",
            "Time the upstream took to answer (to the first byte for streams).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.captured = Counter(
            "nextstate_captured_turns_total", "Turns written to the pool.", registry=self.registry
        )
        self.queue_depth = Gauge(
            "nextstate_capture_queue_depth", "Captured turns waiting in memory to be written (queued, and the "
            "batch being written).", registry=self.registry
        )
        self.shed = Counter(
            "nextstate_capture_shed_turns_total",
            "Captured turns moved from memory to the spool because the pool fell behind the traffic.",
            registry=self.registry,
        )
        self.spool_records = Gauge(
            "nextstate_spool_records",
            "Captured turns spooled to disk (or memory) while the pool is unreachable.",
            registry=self.registry,
        )
        self.spool_bytes = Gauge(
            "nextstate_spool_bytes", "Size of the capture spool file.", registry=self.registry
        )
        self.oldest_unstored = Gauge(
            "nextstate_capture_oldest_unstored_seconds",
            "Age of the oldest answered turn not yet in the pool (in memory or in the spool); 0 when "
            "every turn is stored. Growing under load: the capture writer is behind the traffic.",
            registry=self.registry,
        )
        self.upstream_up = Gauge(
            "nextstate_upstream_up", "1 while a vLLM upstream answers (and serves the active policy version), "
            "else 0: its requests are answered 503 with Retry-After.", ["upstream"], registry=self.registry)
        self.upstream_restarts = Counter(
            "nextstate_upstream_restarts", "A vLLM upstream answering again after it did not (a restart).",
            ["upstream"], registry=self.registry)
        self.upstream_reloads = Counter(
            "nextstate_upstream_reloads", "The active policy version loaded into a vLLM upstream that came "
            "back without it.", ["upstream"], registry=self.registry)
        self.redactions = Counter(
            "nextstate_redactions_total",
            "Spans of captured text replaced by a placeholder before storage, by detector (a message "
            "resent in a conversation's history counts again in each turn that stores it).",
            ["detector"], registry=self.registry,
        )

        # each labelled histogram's children by label values: `labels()` takes a lock and checks
        # its arguments at every call, twice per proxied request otherwise
        self._children: dict[tuple[Histogram, tuple[str, ...]], Any] = {}

    def observe(self, histogram: Histogram, seconds: float, *labels: str) -> None:
        """*seconds* observed in *histogram*'s child of *labels*."""
        child = self._children.get((histogram, labels))
        if child is None:
            child = self._children[(histogram, labels)] = histogram.labels(*labels)
        child.observe(seconds)

    def count_redactions(self, counts: Mapping[str, int]) -> None:
        for detector, n in counts.items():
            self.redactions.labels(detector).inc(n)

    def watch_spool_error(self, error: Callable[[], str | None]) -> None:
        """1 while the spool cannot be written (turns are then held in memory): alert on it."""
        gauge = Gauge("nextstate_spool_error", "1 while the capture spool cannot be written (turns are "
                      "held in memory until the pool answers), else 0.", registry=self.registry)
        gauge.set_function(lambda: 1.0 if error() else 0.0)

    def watch_processes(self, report: ProcessReport) -> None:
        self.registry.register(ProcessCollector(report))

    def watch_pool(self, engine: Engine) -> None:
        self.registry.register(PoolCollector(engine))

    def watch(self, depth: Callable[[], float], spool_records: Callable[[], float],
              spool_bytes: Callable[[], float], oldest_unstored: Callable[[], float] = lambda: 0.0) -> None:
        self.queue_depth.set_function(depth)
        self.spool_records.set_function(spool_records)
        self.spool_bytes.set_function(spool_bytes)
        self.oldest_unstored.set_function(oldest_unstored)


class ProcessCollector(Collector):
    """The supervised processes beside the gateway (`nextstate up`): up or not, restarts, exits."""

    def __init__(self, report: ProcessReport):
        self.report = report

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        report = self.report()
        up = GaugeMetricFamily("nextstate_process_up", "1 while a process `nextstate up` supervises is running "
                               "(for a vLLM: serving, the active policy version loaded), else 0.", labels=["process"])
        restarts = CounterMetricFamily("nextstate_process_restarts", "Restarts of a supervised process.",
                                       labels=["process"])
        exits = CounterMetricFamily("nextstate_process_exits", "Exits of a supervised process by reason "
                                    "(exit N, killed by SIGNAL, failed to start).", labels=["process", "reason"])
        for name, state in report.items():
            up.add_metric([name], 1.0 if state.get("state") == "running" else 0.0)
            restarts.add_metric([name], float(state.get("restarts") or 0))
            for reason, n in (state.get("exits") or {}).items():
                exits.add_metric([name, reason], float(n))
        yield up
        yield restarts
        yield exits


class PoolCollector(Collector):
    """Scoring state of the whole pool (every worker's work), read at scrape time, cached briefly."""

    TTL_S = 10.0

    def __init__(self, engine: Engine):
        self.engine = engine
        self._at = 0.0
        self._judgements: list[tuple[str, int]] = []
        self._votes: list[tuple[str, bool, int]] = []
        self._dead: list[tuple[str, int]] = []
        self._retries = 0

    def _refresh(self) -> None:
        from datapool.models import Judgement, Vote
        from base.vocab import JudgementStatus

        with OrmSession(self.engine) as db:
            self._judgements = [(s, n) for s, n in db.execute(
                select(Judgement.status, func.count()).group_by(Judgement.status))]
            self._votes = [(k, bool(p), n) for k, p, n in db.execute(
                select(Vote.kind, Vote.value.is_not(None), func.count()).group_by(Vote.kind, Vote.value.is_not(None)))]
            self._dead = [(r or "error", n) for r, n in db.execute(
                select(Judgement.dead_reason, func.count()).where(Judgement.status == JudgementStatus.DEAD)
                .group_by(Judgement.dead_reason))]
            self._retries = int(db.scalar(select(func.coalesce(func.sum(Judgement.retries), 0))) or 0)
        self._at = time.monotonic()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if time.monotonic() - self._at > self.TTL_S:
            try:
                self._refresh()
            except SQLAlchemyError:
                pass  # pool down: report the last known counts
        judgements = GaugeMetricFamily("nextstate_judgements", "Turns by scoring state (tie and "
                                       "unparsable included, dead = dead-lettered).", labels=["status"])
        for status, n in self._judgements:
            judgements.add_metric([status], n)
        yield judgements
        votes = GaugeMetricFamily("nextstate_votes", "Votes in the pool by kind and whether they parsed.",
                                  labels=["kind", "parsed"])
        for kind, parsed, n in self._votes:
            votes.add_metric([kind, str(parsed).lower()], n)
        yield votes
        dead = GaugeMetricFamily(
            "nextstate_judgements_dead", "Dead-lettered judgements by reason: retries_exhausted after transient "
            "failures; context_window_exceeded, client_error, invalid_request, error at once, never retried.",
            labels=["reason"])
        for reason, n in self._dead:
            dead.add_metric([reason], n)
        yield dead
        yield CounterMetricFamily("nextstate_judge_retries", "Scoring tasks retried after a transient judge "
                                  "failure (connection, timeout, 5xx, 429), over the judgements in the pool.",
                                  value=self._retries)
