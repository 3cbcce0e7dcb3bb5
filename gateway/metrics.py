"""Prometheus metrics of one gateway process (its own registry: no global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
            "nextstate_capture_queue_depth", "Captured turns waiting to be written.", registry=self.registry
        )
        self.spool_records = Gauge(
            "nextstate_spool_records",
            "Captured turns spooled to disk (or memory) while the pool is unreachable.",
            registry=self.registry,
        )
        self.spool_bytes = Gauge(
            "nextstate_spool_bytes", "Size of the capture spool file.", registry=self.registry
        )

    def watch(self, depth: Callable[[], float], spool_records: Callable[[], float],
              spool_bytes: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)
        self.spool_records.set_function(spool_records)
        self.spool_bytes.set_function(spool_bytes)
