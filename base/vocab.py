"""The domain's words: one StrEnum per closed set of values the pool stores.

Each member *is* its string (``JudgementStatus.SCORED == "scored"``), so rows, JSON bodies and
SQL comparisons read and write the same text as before; the enums give the ORM, the pydantic
models of the API and the CLI's ``click.Choice`` one list to agree on.
"""

from __future__ import annotations

from enum import StrEnum


class SessionSource(StrEnum):
    """How the gateway knew a turn's session."""

    HEADER = "header"
    PATH = "path"
    INFERRED = "inferred"  # from the message prefix
    KEY = "key"  # found in the request by a configured session key (settings.session_keys)


class SessionMode(StrEnum):
    """Where a session's traffic came from."""

    ONLINE = "online"  # live users
    OFFLINE = "offline"  # a rollout over a task dataset
    EVAL = "eval"  # never trained on


class EndReason(StrEnum):
    """Why a session ended when it did not end normally."""

    TIMED_OUT = "timed_out"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TurnKind(StrEnum):
    """``X-Turn-Type``: main turns are stitched and scored, side turns (housekeeping) are not.
    A sibling is no client's: an alternative reply the policy server resampled from a main
    turn's exact prompt ids (``turns.sibling_of``), scored against the same next state and
    never shown to anyone but the trainer and the admin UI (``datapool.siblings``)."""

    MAIN = "main"
    SIDE = "side"
    SIBLING = "sibling"


class TurnStatus(StrEnum):
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


class WireFormat(StrEnum):
    """The API the client spoke (``turns.wire_format``). Responses and Messages calls are
    translated to Chat Completions on their way upstream and stored as chat turns."""

    CHAT = "chat"  # POST /v1/chat/completions
    COMPLETIONS = "completions"  # POST /v1/completions
    RESPONSES = "responses"  # OpenAI Responses API, POST /v1/responses
    MESSAGES = "messages"  # Anthropic Messages API, POST /v1/messages


class CaptureKind(StrEnum):
    """White-box: exact token ids and logprobs from vLLM; black-box: text only."""

    WHITE_BOX = "white-box"
    BLACK_BOX = "black-box"


class VoteKind(StrEnum):
    PRM = "prm"  # a judge's vote
    FEEDBACK = "feedback"  # a person's rating


class JudgementStatus(StrEnum):
    PENDING = "pending"  # queued
    WAITING = "waiting"  # no next state yet
    SCORED = "scored"
    TIE = "tie"
    UNPARSABLE = "unparsable"
    SKIPPED = "skipped"  # side or failed turn
    DEAD = "dead"  # kept failing, or failed in a way no retry can mend; see dead_reason, last_error


class DeadReason(StrEnum):
    """Why a judgement went dead. Only RETRIES_EXHAUSTED was retried first; the others cannot
    succeed on retry and go dead after one attempt."""

    CONTEXT_WINDOW_EXCEEDED = "context_window_exceeded"  # the turn cannot fit the judge's (or teacher's) context
    CLIENT_ERROR = "client_error"  # the judge's or teacher's API refused the request (another 4xx: auth, schema, ...)
    INVALID_REQUEST = "invalid_request"  # the judge request could not be built (prompt, schema)
    RETRIES_EXHAUSTED = "retries_exhausted"  # transient failures (connection, 5xx, timeout, 429) kept on
    ERROR = "error"  # anything else (a bug): not retried


class HintSource(StrEnum):
    LABEL = "label"  # a person's corrected reply
    FEEDBACK = "feedback"
    PRM = "prm"


class VersionKind(StrEnum):
    """What a policy version is: the base model, a LoRA adapter on it, or full weights."""

    BASE = "base"
    LORA = "lora"
    FULL = "full"


class VersionStatus(StrEnum):
    CANDIDATE = "candidate"  # published, not activated
    ACTIVE = "active"
    RETIRED = "retired"  # was active, replaced
    ROLLED_BACK = "rolled_back"  # was active and rolled back from
    REFUSED = "refused"  # a candidate the eval gate refused (or a restart discarded); never served


class PolicyAction(StrEnum):
    """A decision about a policy version (``policy_events.action``)."""

    PUBLISH = "publish"
    PROMOTE = "promote"
    REFUSE = "refuse"
    ROLLBACK = "rollback"
    EVAL = "eval"


class PauseMode(StrEnum):
    """How vLLM pauses while full weights are reloaded: ``wait`` lets running requests finish
    on the old weights, ``keep`` freezes them and they continue on the new ones."""

    WAIT = "wait"
    KEEP = "keep"


class Objective(StrEnum):
    RL = "rl"
    OPD = "opd"
    COMBINED = "combined"


class TrainBackend(StrEnum):
    LOCAL = "local"
    VERL = "verl"


class RunStatus(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class LabelKind(StrEnum):
    THUMB = "thumb"
    OVERRIDE = "override"
    EXCLUDE = "exclude"
    CORRECTION = "correction"
    TAG = "tag"
    UNTAG = "untag"  # removes that tag from the same turn or session (rows are never deleted)
    NOTE = "note"


def values(enum: type[StrEnum]) -> tuple[str, ...]:
    """The strings of an enum, in order (for ``click.Choice`` and regex-free validation)."""
    return tuple(m.value for m in enum)


class AuditAction(StrEnum):
    """What an ``audit_log`` row records."""

    FORGET = "forget"
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    TAINT = "taint"
    EXPIRE = "expire"
    KEY_ISSUE = "key_issue"
    KEY_REVOKE = "key_revoke"
