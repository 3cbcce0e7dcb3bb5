"""Traces out: captured turns and their judgements as OpenTelemetry spans, for any OTLP receiver.

Off by default (``otel_traces``); on, each process that writes turns or judgements exports over
OTLP/HTTP to the endpoint of the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) variables. Needs the ``otel`` extra
(``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``).

What is exported, and when (docs/security.md, "Traces"):

- **A turn** is one span, ``chat {model}`` (or ``text_completion {model}``), exported by the
  gateway's capture writer once the turn is written to the pool: after redaction, so a span
  carries only what the pool does, and once its session is known (a turn that carries no session
  id is stitched into one only then). Its attributes follow the OpenTelemetry GenAI semantic
  conventions (``gen_ai.*``: operation, provider, request and response model, usage, finish
  reasons, ``gen_ai.conversation.id`` = the session, and, with ``otel_content``, the messages as
  ``gen_ai.input.messages`` / ``gen_ai.output.messages`` / ``gen_ai.system_instructions`` JSON),
  plus ``nextstate.*`` (turn id, policy version, tenant, what redaction replaced). It covers
  the call's own time: from the request to the end of the reply.
- **A judgement** lands later (the scoring worker votes once the turn's next state is known), so
  it is a second span, ``nextstate.judgement``, exported by the worker each time it scores the
  turn: a child of the turn's span, with the reward, the votes, the judge and the policy version,
  and a ``gen_ai.evaluation.result`` event.

The two are linked by the turn id alone: a turn's trace id *is* its id (the 32 hex digits), and
its span id is derived from it, so the worker names the parent without asking anyone, and a person
finds a turn's trace from the id the admin UI shows.

Exporting never holds up capture: spans are queued to a batch span processor whose thread sends
them; a full queue drops spans, and an unreachable receiver only costs log lines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.models import Judgement, Session, Turn, Vote
from datapool.records import TurnRecord
from base.errors import TracesUnavailable
from base.settings import Settings
from base.vocab import Endpoint, TurnStatus, VoteKind

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("nextstate.traces")

INSTALL_HINT = "pip install 'nextstate[otel]'"
JUDGEMENT_SPAN = "nextstate.judgement"
EVALUATION_EVENT = "gen_ai.evaluation.result"
EVALUATION_NAME = "nextstate.prm"

# LiteLLM's provider prefix -> gen_ai.provider.name (the conventions' well-known values)
PROVIDERS = {
    "openai": "openai", "text-completion-openai": "openai", "azure": "azure.ai.openai",
    "azure_ai": "azure.ai.inference", "anthropic": "anthropic", "bedrock": "aws.bedrock",
    "vertex_ai": "gcp.vertex_ai", "gemini": "gcp.gemini", "cohere": "cohere", "deepseek": "deepseek",
    "groq": "groq", "mistral": "mistral_ai", "perplexity": "perplexity", "xai": "x_ai",
    "watsonx": "ibm.watsonx.ai", "hosted_vllm": "vllm",
}
# request parameters -> gen_ai.request.* (OpenAI's names; Messages and Responses are stored as chat)
PARAMS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "n": "choice.count",
}


def trace_id_of(turn_id: str) -> int:
    """The trace id of a turn: its id itself when it is 32 hex digits (the gateway's), else a hash."""
    try:
        if len(turn_id) == 32:
            value = int(turn_id, 16)
            if value:
                return value
    except ValueError:
        pass
    return int.from_bytes(hashlib.sha256(turn_id.encode()).digest()[:16], "big") or 1


def span_id_of(turn_id: str) -> int:
    """The span id of a turn's span, derived from its id (never 0, which is invalid)."""
    return int.from_bytes(hashlib.sha256(b"turn:" + turn_id.encode()).digest()[:8], "big") or 1


def _ns(at: datetime) -> int:
    return int(at.timestamp() * 1e9)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _text_parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}] if content else []
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append({"type": "text", "content": part["text"]})
        elif isinstance(part, dict):  # an image, audio or file: named, its bytes not sent
            parts.append({"type": str(part.get("type") or "unknown")})
        else:
            parts.append({"type": "text", "content": str(part)})
    return parts


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def message_parts(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message in the conventions' shape: ``{"role", "parts": [...]}``."""
    role = str(message.get("role") or "user")
    parts: list[dict[str, Any]] = []
    if role == "tool":
        parts.append({"type": "tool_call_response", "id": message.get("tool_call_id"),
                      "response": message.get("content")})
    else:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "reasoning", "content": reasoning})
        parts += _text_parts(message.get("content"))
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                          "arguments": _arguments(fn.get("arguments"))})
    out: dict[str, Any] = {"role": role, "parts": parts}
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _provider(record: TurnRecord) -> str:
    if record.policy_version:  # only a vLLM upstream serves a policy version (its capture may
        return "vllm"              # still be black-box: ids that could not be masked are dropped)
    prefix, sep, _ = (record.upstream_model or "").partition("/")
    if not sep:
        return "openai"  # LiteLLM sends an unprefixed model name through OpenAI's API
    return PROVIDERS.get(prefix, prefix)


def _usage(usage: Mapping[str, Any] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, names in (("input_tokens", ("prompt_tokens", "input_tokens")),
                       ("output_tokens", ("completion_tokens", "output_tokens"))):
        for name in names:
            value = (usage or {}).get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                out[f"gen_ai.usage.{key}"] = value
                break
    return out


def turn_attributes(record: TurnRecord, session_id: str | None, *, content: bool) -> dict[str, Any]:
    """The span attributes of a stored turn (*record* as stored: redacted)."""
    chat = record.endpoint == Endpoint.CHAT
    response = record.response or {}
    choices = list(response.get("choices") or ())
    params = dict((record.request or {}).get("params") or {})
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if chat else "text_completion",
        "gen_ai.provider.name": _provider(record),
        "gen_ai.request.model": record.model,
        "nextstate.turn.id": record.id,
        "nextstate.turn.type": record.turn_type,
        "nextstate.turn.status": record.status,
        "nextstate.capture": record.capture,
        "nextstate.wire_format": record.wire_format or record.endpoint,
    }
    attrs["gen_ai.system"] = attrs["gen_ai.provider.name"]  # its name before semantic conventions 1.37
    if session_id:
        attrs["gen_ai.conversation.id"] = session_id
    for key, value in (("gen_ai.response.model", response.get("model") or record.upstream_model),
                       ("gen_ai.response.id", response.get("id")),
                       ("nextstate.policy.version", record.policy_version),
                       ("nextstate.upstream.model", record.upstream_model),
                       ("nextstate.tenant", record.tenant), ("nextstate.client", record.client),
                       ("nextstate.session.source", record.session_source),
                       ("nextstate.task.id", record.task_id), ("nextstate.group.id", record.group_id)):
        if value:
            attrs[key] = str(value)
    for name, key in PARAMS.items():
        value = params.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attrs[f"gen_ai.request.{key}"] = value
    stop = params.get("stop")
    if isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        attrs["gen_ai.request.stop_sequences"] = [stop] if isinstance(stop, str) else stop
    reasons = [str(c.get("finish_reason")) for c in choices if c.get("finish_reason")]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    attrs.update(_usage(record.usage))
    if record.latency_ms is not None:
        attrs["nextstate.latency_ms"] = float(record.latency_ms)
    for detector, n in ((record.redaction or {}).get("counts") or {}).items():
        attrs[f"nextstate.redacted.{detector}"] = int(n)
    if (record.redaction or {}).get("failed"):
        attrs["nextstate.redaction_failed"] = True
    if record.error:
        attrs["error.type"] = str(record.error.get("code") or record.error.get("type") or record.status)
    if content:
        attrs.update(_content(record, chat, choices))
    return attrs


def _content(record: TurnRecord, chat: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
    request = record.request or {}
    out: dict[str, Any] = {}
    if chat:
        system = [p for m in record.messages if m.get("role") in ("system", "developer")
                  for p in _text_parts(m.get("content"))]
        inputs = [message_parts(m) for m in record.messages if m.get("role") not in ("system", "developer")]
        outputs = [{**message_parts(c.get("message") or {"role": "assistant"}),
                    "finish_reason": c.get("finish_reason")} for c in choices]
        if system:
            out["gen_ai.system_instructions"] = _json(system)
        if request.get("tools"):
            out["gen_ai.tool.definitions"] = _json(request["tools"])
    else:
        prompt = request.get("prompt")
        prompts = prompt if isinstance(prompt, list) else [prompt]
        inputs = [{"role": "user", "parts": _text_parts(p if isinstance(p, str) else _json(p))}
                  for p in prompts if p is not None]
        outputs = [{"role": "assistant", "parts": _text_parts(c.get("text")),
                    "finish_reason": c.get("finish_reason")} for c in choices]
    out["gen_ai.input.messages"] = _json(inputs)
    if outputs:
        out["gen_ai.output.messages"] = _json(outputs)
    return out


@dataclass(frozen=True)
class JudgementView:
    """What a judgement span tells: the judgement and the turn it judged."""

    turn_id: str
    session_id: str
    response_id: str | None
    policy_version: str | None
    tenant: str | None
    status: str
    reward: float | None
    prm_reward: float | None
    vote_mean: float | None
    integrated_reward: float | None
    votes: list[float]
    unparsable_votes: int
    judge: str | None
    prompt_version: str | None
    hint: str | None
    hint_source: str | None
    at: datetime  # when the judgement was last written


def judgement_view(engine: Engine, turn_id: str) -> JudgementView | None:
    """The judgement of *turn_id* as the pool holds it now; None when there is none."""
    with OrmSession(engine) as db:
        row = db.execute(select(Turn, Judgement).join(Judgement, Judgement.turn_id == Turn.id)
                         .where(Turn.id == turn_id)).first()
        if row is None:
            return None
        turn, judgement = row
        session = db.get(Session, turn.session_id)
        values = list(db.scalars(select(Vote.value).where(
            Vote.turn_id == turn_id, Vote.kind == VoteKind.PRM, Vote.judge == judgement.judge,
            Vote.prompt_version.is_(None) if judgement.prompt_version is None
            else Vote.prompt_version == judgement.prompt_version).order_by(Vote.vote_index)))
        return JudgementView(
            turn_id=turn.id, session_id=turn.session_id, response_id=turn.response_id,
            policy_version=turn.policy_version, tenant=session.tenant if session else None,
            status=judgement.status, reward=judgement.reward, prm_reward=judgement.prm_reward,
            vote_mean=judgement.vote_mean, integrated_reward=judgement.integrated_reward,
            votes=[float(v) for v in values if v is not None],
            unparsable_votes=sum(1 for v in values if v is None),
            judge=judgement.judge, prompt_version=judgement.prompt_version,
            hint=judgement.hint, hint_source=judgement.hint_source, at=judgement.updated_at)


def judgement_attributes(view: JudgementView, *, content: bool) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "nextstate.turn.id": view.turn_id,
        "gen_ai.conversation.id": view.session_id,
        "nextstate.judgement.status": view.status,
        "nextstate.judge.votes": view.votes,
        "nextstate.judge.unparsable_votes": view.unparsable_votes,
    }
    for key, value in (("nextstate.reward", view.reward), ("nextstate.prm_reward", view.prm_reward),
                       ("nextstate.vote_mean", view.vote_mean),
                       ("nextstate.integrated_reward", view.integrated_reward)):
        if value is not None:
            attrs[key] = float(value)
    for key, text in (("nextstate.policy.version", view.policy_version), ("nextstate.tenant", view.tenant),
                      ("nextstate.judge.name", view.judge), ("nextstate.judge.prompt_version", view.prompt_version),
                      ("gen_ai.response.id", view.response_id), ("nextstate.hint.source", view.hint_source)):
        if text:
            attrs[key] = text
    if content and view.hint:
        attrs["nextstate.hint"] = view.hint
    return attrs


class _TurnIds:
    """Span and trace ids: those given for the next span started on this thread, else random."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self._next = threading.local()

    def give(self, trace_id: int | None, span_id: int | None) -> None:
        self._next.trace_id, self._next.span_id = trace_id, span_id

    def _take(self, name: str) -> int | None:
        value = getattr(self._next, name, None)
        setattr(self._next, name, None)
        return value

    def generate_trace_id(self) -> int:
        return self._take("trace_id") or self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        return self._take("span_id") or self._random.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return False


class Traces:
    """One process's span exporter: turns (the gateway) and judgements (the workers)."""

    def __init__(self, provider: TracerProvider, ids: _TurnIds, *, content: bool):
        self.provider = provider
        self.ids = ids
        self.content = content
        self.tracer = provider.get_tracer("nextstate")
        self.failures = 0

    def stored(self, records: Sequence[TurnRecord], sessions: Mapping[str, str]) -> None:
        """Export one span per turn just written to the pool (*sessions*: turn id -> session id).
        Never raises: a span that cannot be made is logged and skipped."""
        by_id = {r.id: r for r in records}
        for turn_id, session_id in sessions.items():  # a turn stored before (a replayed spool) is not here
            try:
                self._turn(by_id[turn_id], session_id)
            except Exception:
                self._failed(f"turn {turn_id}")

    def _turn(self, record: TurnRecord, session_id: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        attrs = turn_attributes(record, session_id, content=self.content)
        start = _ns(record.created_at)
        end = start + int((record.latency_ms or 0.0) * 1e6)
        self.ids.give(trace_id_of(record.id), span_id_of(record.id))
        try:
            span = self.tracer.start_span(f"{attrs['gen_ai.operation.name']} {record.model}",
                                          kind=SpanKind.CLIENT, attributes=attrs, start_time=start)
        finally:
            self.ids.give(None, None)
        if record.status != TurnStatus.OK:
            span.set_status(Status(StatusCode.ERROR, attrs.get("error.type") or record.status))
        span.end(end_time=end)

    def judged(self, engine: Engine, turn_id: str) -> None:
        """Export the judgement of *turn_id* as the pool holds it now. Never raises."""
        try:
            view = judgement_view(engine, turn_id)
            if view is not None:
                self._judgement(view)
        except Exception:
            self._failed(f"judgement of turn {turn_id}")

    def _judgement(self, view: JudgementView) -> None:
        from opentelemetry import trace

        parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
            trace_id_of(view.turn_id), span_id_of(view.turn_id), is_remote=True,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))))
        attrs = judgement_attributes(view, content=self.content)
        start = _ns(view.at)
        span = self.tracer.start_span(JUDGEMENT_SPAN, context=parent, attributes=attrs, start_time=start)
        event: dict[str, Any] = {"gen_ai.evaluation.name": EVALUATION_NAME,
                                 "gen_ai.evaluation.score.label": view.status}
        if view.reward is not None:
            event["gen_ai.evaluation.score.value"] = float(view.reward)
        if view.response_id:
            event["gen_ai.response.id"] = view.response_id
        span.add_event(EVALUATION_EVENT, event, timestamp=start)
        span.end(end_time=start + 1_000_000)  # the moment it was written: a millisecond long

    def _failed(self, what: str) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 1000 == 0:
            log.exception("trace export: could not make the span of %s (%d so far)", what, self.failures)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self.provider.shutdown()


def traces(settings: Settings, role: str) -> Traces | None:
    """The exporter these settings ask for (None when ``otel_traces`` is off). *role* names the
    process in the resource (``nextstate.role``); ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` override what is set here."""
    if not settings.otel_traces:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracesUnavailable(INSTALL_HINT) from exc
    resource = Resource.create({"service.name": "nextstate", "nextstate.role": role}).merge(
        OTELResourceDetector().detect())
    ids = _TurnIds()
    provider = TracerProvider(resource=resource, id_generator=ids)  # type: ignore[arg-type]
    # the exporter reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION;
    # the processor OTEL_BSP_* (queue size, delay, batch size)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318")
    log.info("exporting %s spans over OTLP/HTTP to %s", role, endpoint)
    return Traces(provider, ids, content=settings.otel_content)
