"""The pool's schema. Alembic (``migrations/``) is the only way it reaches a database."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    false,
    literal_column,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from datapool.db import UTCDateTime, utcnow
from base.vocab import SessionMode, TurnKind, WireFormat

# JSONB on PostgreSQL (indexable, compact), plain JSON text elsewhere; Python None is SQL NULL.
Json = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


class Base(DeclarativeBase):
    pass


class Session(Base):
    """A trajectory: the turns of one conversation or episode."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # how the gateway knew the session: base.vocab.SessionSource
    source: Mapped[str] = mapped_column(String(16))
    task_id: Mapped[str | None] = mapped_column(String(256), index=True)
    group_id: Mapped[str | None] = mapped_column(String(256), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", Json, default=dict)
    # terminal reward O of the episode (task success, test verdict), posted by a verifier or user
    outcome: Mapped[float | None] = mapped_column(Float)
    outcome_source: Mapped[str | None] = mapped_column(String(256))
    outcome_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # base.vocab.SessionMode
    mode: Mapped[str] = mapped_column(String(16), default=SessionMode.ONLINE, server_default="online", index=True)
    # why the session ended when it did not end normally: base.vocab.EndReason
    end_reason: Mapped[str | None] = mapped_column(String(32))
    # the agent the session came from: a client profile's name (gateway.clients), if one matched
    client: Mapped[str | None] = mapped_column(String(32), index=True)
    # whose traffic it is: the tenant of the client key that opened it; None: no tenant's
    tenant: Mapped[str | None] = mapped_column(String(64), index=True)

    __table_args__ = (Index("ix_sessions_created_at_id", "created_at", "id"),)


def sort_indexes(*columns: str) -> list[Index]:
    """Indexes serving ``ORDER BY col ASC NULLS LAST, id ASC`` and ``col DESC NULLS LAST, id DESC``.
    SQLite sorts NULLs first ascending and last descending, and takes no NULLS LAST in an index:
    there, one plain index serves both (the ascending sort as a full scan)."""
    out = []
    for c in columns:
        col = literal_column(c)
        out.append(Index(f"ix_turns_{c}_asc", c, "id"))
        out.append(Index(f"ix_turns_{c}_desc", col.desc().nulls_last(), literal_column("id").desc())
                   .ddl_if(dialect="postgresql"))
    return out


#: the completion tokens of a turn's usage, as the turns view sorts by them (PostgreSQL), in the
#: two spellings PostgreSQL reflects the ascending and the descending index with (so that
#: autogenerate finds the models and the migrations agree)
COMPLETION_TOKENS = "(((usage ->> 'completion_tokens'::text))::double precision)"
COMPLETION_TOKENS_DESC = "((usage ->> 'completion_tokens'::text)::double precision)"
#: every string of a turn's request, reply and next state as words (``datapool.browse.search_document``)
SEARCH_DOCUMENT = ("""(((jsonb_to_tsvector('english'::regconfig, request, '["string"]'::jsonb) || """
                   """jsonb_to_tsvector('english'::regconfig, COALESCE(response, 'null'::jsonb), '["string"]'::jsonb)) || """
                   """jsonb_to_tsvector('english'::regconfig, COALESCE(next_state, 'null'::jsonb), '["string"]'::jsonb)))""")


class ApiKey(Base):
    """A client key issued through the admin API (``/api/tenants/{tenant}/keys``): only its hash is
    kept. Keys from the settings (``api_keys``, ``tenant_keys``) are not stored here."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Turn(Base):
    """One model call, as the gateway saw it."""

    __tablename__ = "turns"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    # the turn whose reply this turn's request continued; its next_state came from this turn
    parent_turn_id: Mapped[str | None] = mapped_column(String(36), index=True)
    # a shadow sibling's original: the main turn whose exact prompt ids it was resampled from
    # (turn_type "sibling", same session; datapool.siblings)
    sibling_of: Mapped[str | None] = mapped_column(String(36), index=True)
    turn_type: Mapped[str] = mapped_column(String(8), default=TurnKind.MAIN)  # vocab.TurnKind
    endpoint: Mapped[str] = mapped_column(String(16))  # vocab.Endpoint
    # vocab.WireFormat: the API the client spoke (responses and messages are stored as chat)
    wire_format: Mapped[str] = mapped_column(String(16), default=WireFormat.CHAT, server_default="chat")
    status: Mapped[str] = mapped_column(String(16))  # vocab.TurnStatus
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    model: Mapped[str] = mapped_column(String(256))  # as the client asked
    upstream_model: Mapped[str | None] = mapped_column(String(256))  # as the upstream served
    policy_version: Mapped[str | None] = mapped_column(String(256), index=True)
    capture: Mapped[str] = mapped_column(String(16))  # vocab.CaptureKind
    request: Mapped[dict[str, Any]] = mapped_column(Json)
    response: Mapped[dict[str, Any] | None] = mapped_column(Json)
    next_state: Mapped[dict[str, Any] | None] = mapped_column(Json)
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(Json)
    token_ids: Mapped[list[int] | None] = mapped_column(Json)
    logprobs: Mapped[list[float] | None] = mapped_column(Json)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    usage: Mapped[dict[str, Any] | None] = mapped_column(Json)
    error: Mapped[dict[str, Any] | None] = mapped_column(Json)
    # what redaction replaced before storage: {"counts": {detector: n}, "prompt": [positions],
    # "reply": [positions]} (token positions masked; no loss there), None when nothing was
    redaction: Mapped[dict[str, Any] | None] = mapped_column(Json)
    # hash of this request's messages up to its last assistant message: how an earlier turn
    # whose reply arrives later (another replica, a replayed spool) finds its continuation
    link_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    # how this turn continues its parent when its request is not the parent's history and reply as
    # sent: recovery, compaction-insert, compaction-replace, fork, retry, summary (datapool.edits)
    edit: Mapped[str | None] = mapped_column(String(24))
    # the `id` the client received (chatcmpl-...), so feedback can name the turn by it
    response_id: Mapped[str | None] = mapped_column(String(256), index=True)
    # the reward the turn shows and is filtered and sorted by: a person's override in force (the
    # turn's, else its session's), else its judgement's reward. Kept current by the database's
    # own triggers on judgements, labels and turns (migration 0010), whoever writes them.
    effective_reward: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        Index("ix_turns_session_created", "session_id", "created_at"),
        # the turns view's sorts, both ways, NULLs last (and the reward filters)
        *sort_indexes("effective_reward", "latency_ms"),
        Index("ix_turns_completion_tokens_asc", literal_column(COMPLETION_TOKENS), literal_column("id"))
        .ddl_if(dialect="postgresql"),
        Index("ix_turns_completion_tokens_desc", literal_column(COMPLETION_TOKENS_DESC).desc().nulls_last(),
              literal_column("id").desc()).ddl_if(dialect="postgresql"),
        # full-text search (PostgreSQL; SQLite matches words in the JSON text, unindexed)
        Index("ix_turns_search", literal_column(SEARCH_DOCUMENT), postgresql_using="gin").ddl_if(dialect="postgresql"),
    )


class TurnContinuation(Base):
    """Hash of (request messages + reply of one choice): the prefix a continuing request starts with."""

    __tablename__ = "turn_continuations"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    turn_id: Mapped[str] = mapped_column(
        ForeignKey("turns.id", ondelete="CASCADE"), primary_key=True
    )
    choice_index: Mapped[int] = mapped_column(Integer, primary_key=True, default=0)
    # the turn's time and kind, copied here (they never change) so that the first turns of a hash
    # of each kind are one index range (datapool.stitch_reads.first_in_pool), however many share it
    created_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    answered: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # the turn's status is ok
    system_free: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # datapool.edits.is_system_free_index

    __table_args__ = (
        Index("ix_turn_continuations_first", "hash", "system_free", "answered", "created_at", "turn_id"),
    )


class ToolCallArguments(Base):
    """The model's own arguments text of a tool call answered on /v1/messages, by the call's id.

    Anthropic clients send a call back as a parsed ``input`` object; the gateway puts this text
    back in its place (``gateway.formats``), whichever replica answered the call and across
    restarts."""

    __tablename__ = "tool_call_arguments"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    turn_id: Mapped[str] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), index=True)
    arguments: Mapped[str] = mapped_column(Text)


class PolicyVersion(Base):
    """A servable policy: the base model, or base + adapter / checkpoint produced by the trainer."""

    __tablename__ = "policy_versions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(256), unique=True)  # the model name vLLM serves it as
    base_model: Mapped[str] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(16))  # vocab.VersionKind
    path: Mapped[str | None] = mapped_column(String(1024))
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("policy_versions.id"))
    # vocab.VersionStatus
    status: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    stats: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    # learned from data that was forgotten (``nextstate forget --taint``): never served again
    tainted: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Vote(Base):
    """One judgement of a turn: a PRM judge's vote, or a person's feedback."""

    __tablename__ = "votes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    turn_id: Mapped[str] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))  # vocab.VoteKind
    # makes re-delivery harmless: "prm:<judge>:<prompt version>:<i>" is written once per turn
    dedupe_key: Mapped[str] = mapped_column(String(512))
    judge: Mapped[str] = mapped_column(String(256))  # judge model, python path, or "user"
    prompt_version: Mapped[str | None] = mapped_column(String(64))
    vote_index: Mapped[int] = mapped_column(Integer, default=0)
    value: Mapped[int | None] = mapped_column(Integer)  # +1 / 0 / -1; NULL: unparsable
    rationale: Mapped[str | None] = mapped_column(Text)
    hint: Mapped[str | None] = mapped_column(Text)
    raw: Mapped[str | None] = mapped_column(Text)  # what the judge said, kept when unparsable
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index("uq_votes_turn_dedupe", "turn_id", "dedupe_key", unique=True),)


class Judgement(Base):
    """The signal made of a turn's votes: its process reward, hint and teacher logprobs."""

    __tablename__ = "judgements"

    turn_id: Mapped[str] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), primary_key=True)
    # vocab.JudgementStatus
    status: Mapped[str] = mapped_column(String(16), index=True)
    reward: Mapped[float | None] = mapped_column(Float)  # the turn's process reward r_t
    prm_reward: Mapped[float | None] = mapped_column(Float)  # the judges' majority alone
    vote_mean: Mapped[float | None] = mapped_column(Float)  # (1/m) sum_i r_t^(i)
    integrated_reward: Mapped[float | None] = mapped_column(Float)  # O + vote_mean
    hint: Mapped[str | None] = mapped_column(Text)
    hint_source: Mapped[str | None] = mapped_column(String(16))  # vocab.HintSource
    teacher_prompt_ids: Mapped[list[int] | None] = mapped_column(Json)
    teacher_logprobs: Mapped[list[float] | None] = mapped_column(Json)
    # top-k OPD: per response position the teacher's k most likely tokens and their logprobs
    teacher_topk_ids: Mapped[list[list[int]] | None] = mapped_column(Json)
    teacher_topk_logprobs: Mapped[list[list[float]] | None] = mapped_column(Json)
    judge: Mapped[str | None] = mapped_column(String(256))
    prompt_version: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # transient failures retried
    dead_reason: Mapped[str | None] = mapped_column(String(32))  # vocab.DeadReason, when status is dead
    last_error: Mapped[str | None] = mapped_column(Text)
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TrainingRun(Base):
    """One `nextstate train` run: what it optimised, from which version, what it produced."""

    __tablename__ = "training_runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    objective: Mapped[str] = mapped_column(String(16))  # vocab.Objective
    backend: Mapped[str] = mapped_column(String(16))  # vocab.TrainBackend
    config: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    status: Mapped[str] = mapped_column(String(16), index=True)  # vocab.RunStatus
    base_version: Mapped[str | None] = mapped_column(String(256))
    produced_version: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class TrainingLease(Base):
    """A turn handed to a run's batch. Acked once the optimizer step that used it committed;
    an unacked lease past its expiry (the trainer died) is handed out again."""

    __tablename__ = "training_leases"

    run_id: Mapped[str] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"), primary_key=True)
    turn_id: Mapped[str] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), primary_key=True)
    leased_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    acked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    step: Mapped[int | None] = mapped_column(Integer)  # the optimizer step that trained on it


class TrainingStep(Base):
    """Per-step metrics of a run (loss, mean advantage, clip fraction, KL, tokens/s, ...)."""

    __tablename__ = "training_steps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Label(Base):
    """A person's judgement of a turn or a whole session, from the admin UI or API.

    kind: "thumb" (value +1/-1) | "override" (value: the reward that replaces the judge's)
    | "exclude" (value true/false) | "correction" (value: the corrected reply text, an OPD hint)
    | "tag" (value: the tag) | "note" (value: text). For every kind but "tag" the newest label
    of a (target, kind) is the one in force; a label with value null withdraws that kind.
    """

    __tablename__ = "labels"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    turn_id: Mapped[str | None] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    value: Mapped[Any] = mapped_column(Json, nullable=True)
    author: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PolicyEvent(Base):
    """A decision about a policy version: published, promoted, refused by the eval gate,
    rolled back (by a person or automatically), with the numbers that justified it."""

    __tablename__ = "policy_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version_id: Mapped[int | None] = mapped_column(ForeignKey("policy_versions.id", ondelete="CASCADE"), index=True)
    # vocab.PolicyAction
    action: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(256))  # "trainer", "eval-gate", "admin:<name>", ...
    reason: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class EvalReply(Base):
    """A version's reply to one held-out prompt of the eval gate, and its score: what the
    version-vs-version page shows side by side. ``prompt_hash`` keys the same prompt across
    versions (``datapool.evals.prompt_hash``); a later eval of a version adds rows, the newest wins."""

    __tablename__ = "eval_replies"
    __table_args__ = (Index("ix_eval_replies_version_prompt", "version", "prompt_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[str] = mapped_column(String(256))  # a policy version's name, or the base model's
    prompt_hash: Mapped[str] = mapped_column(String(64))
    prompt: Mapped[list[dict[str, Any]]] = mapped_column(Json)  # the chat messages asked
    reply: Mapped[str] = mapped_column(Text)
    score: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AuditEntry(Base):
    """Who did what to the pool or the policy, when (``datapool.audit``): written in the
    transaction of the action it records."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(256))  # "token", "tenant:<name>", "cli:<user>", ...
    action: Mapped[str] = mapped_column(String(32), index=True)  # vocab.AuditAction
    target: Mapped[str | None] = mapped_column(String(512))
    details: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)  # counts, versions, dry run
