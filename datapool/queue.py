"""The producer side of scoring: task names, the Celery app's configuration and the Enqueuer
that the gateway and the sweep send tasks with. The tasks themselves run in
``scoring.worker``; nothing here imports a judge.

Broker: Redis (or any Celery broker) from ``NEXTSTATE_BROKER_URL``. With none configured, kombu's
SQLAlchemy transport over a SQLite file in the data directory — a real queue that needs no
broker server, for the embedded setup. Whatever the broker loses (Redis without persistence
restarting, a worker SIGKILLed mid-task) the pool still knows: the judgement stays ``pending``
and the periodic sweep queues it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from celery import Celery

from base.settings import Settings

log = logging.getLogger("nextstate.worker")

SCORE_TASK = "nextstate.score_turn"
SWEEP_TASK = "nextstate.sweep"


def make_celery(settings: Settings) -> Celery:
    """A Celery app configured for nextstate's broker and queue, without tasks (a producer)."""
    app = Celery("nextstate", broker=settings.resolved_broker_url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        task_acks_late=True,  # a task is acknowledged after it ran, so a killed worker's task returns
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.queue,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=2,
        broker_transport_options=_transport_options(settings),
        worker_hijack_root_logger=False,
        beat_schedule={"sweep": {"task": SWEEP_TASK, "schedule": settings.sweep_interval_s}},
    )
    return app


def _transport_options(settings: Settings) -> dict[str, Any]:
    if not settings.resolved_broker_url.startswith(("redis://", "rediss://")):
        return {}  # kombu's SQLAlchemy transport hands its options to create_engine
    return {
        # Redis: a task unacknowledged this long (its worker died) goes back on the queue;
        # the restore scan runs every interval (kombu's default throttle makes it 10x rarer)
        "visibility_timeout": settings.broker_visibility_timeout_s,
        "unacked_restore_interval": 30,
        "unacked_restore_throttle": 1,
        # a broker that is down or hangs must fail a send fast, not block the capture writer
        "socket_timeout": 5,
        "socket_connect_timeout": 2,
        "max_retries": 0,
    }


class Enqueuer:
    """Sends scoring tasks. Never raises: a task that cannot be sent stays pending in the pool
    and the sweep sends it later."""

    def __init__(self, settings: Settings):
        self.app = make_celery(settings)
        self._lock = threading.Lock()  # one producer connection, used from several threads

    def send(self, turn_ids: Iterable[str]) -> int:
        sent = 0
        with self._lock:
            for tid in turn_ids:
                try:
                    self.app.send_task(SCORE_TASK, args=[tid], retry=False)
                    sent += 1
                except Exception as exc:  # broker down: the sweep will send it
                    log.warning("could not queue scoring of turn %s (%s); the sweep will retry", tid,
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    break
        return sent
