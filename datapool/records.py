"""What the gateway hands the pool for each call: a plain record, JSON-serialisable for the spool."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

Message = dict[str, Any]


@dataclass
class TurnRecord:
    """A captured call as the gateway hands it to the pool (and as the spool stores it)."""

    id: str
    created_at: datetime
    endpoint: str
    status: str
    model: str
    capture: str
    request: dict[str, Any]
    session_id: str | None = None
    session_source: str | None = None  # vocab.SessionSource when session_id is given
    task_id: str | None = None
    group_id: str | None = None
    turn_type: str = "main"
    upstream_model: str | None = None
    policy_version: str | None = None
    response: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    latency_ms: float | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    session_done: bool = False  # the client said this is the session's last turn
    wire_format: str | None = None  # vocab.WireFormat the client spoke; None: the endpoint's own
    client: str | None = None  # the client profile that recognised the request (gateway.clients)
    # what redaction replaced (counts per detector) and masked (token positions); None: nothing
    redaction: dict[str, Any] | None = None
    tenant: str | None = None  # the tenant of the client's key (gateway.tenants); None: no tenant's

    def to_json(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["created_at"] = self.created_at.isoformat()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TurnRecord":
        d = dict(d)
        d["created_at"] = datetime.fromisoformat(d["created_at"])
        return cls(**d)

    @property
    def messages(self) -> list[Message]:
        return list(self.request.get("messages") or [])

    @property
    def replies(self) -> list[Message]:
        if not self.response:
            return []
        return [c.get("message") or {} for c in self.response.get("choices") or []]
