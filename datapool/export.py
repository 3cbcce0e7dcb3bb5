"""Export the turns a filter selects as JSONL or Parquet, streamed batch by batch.

One row per turn, in a layout both veRL's RL dataset and Hugging Face ``datasets`` read:

* ``prompt`` — the chat messages the model was given (``[{role, content, ...}]``): veRL's
  ``data.prompt_key``; ``response`` — the reply text; ``messages`` — prompt + reply, the chat
  column HF SFT recipes use;
* ``data_source`` (``"nextstate"``), ``ability`` and ``reward_model`` (``{style, ground_truth}``)
  as veRL's reward loop expects; ``extra_info`` with the ids, mode, capture, the wire format the
  client spoke (``chat``, ``completions``, ``responses``, ``messages``), versions, hint;
* ``reward`` — what the trainer uses (a person's override, else the judge's majority),
  ``judge_reward``, ``integrated_reward``, labels (``excluded``, ``thumb``, ``tags``,
  ``correction``, ``note``), and the raw request/response as JSON text for full fidelity.

Nothing is held in memory beyond one batch (``browse.iter_selected``); Parquet gets one row
group per batch through :class:`pyarrow.parquet.ParquetWriter`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool import labels as labels_mod
from datapool.browse import Browse, content_text, iter_selected
from datapool.db import iso
from datapool.models import Judgement, Session, Turn

if TYPE_CHECKING:
    import pyarrow as pa


@functools.cache
def schema() -> pa.Schema:
    """The Parquet export's schema. pyarrow is imported here, at the first Parquet export: it costs
    ~0.4 s of CPU, and most processes that import this module (every gateway, the CLI) never
    write Parquet."""
    import pyarrow as pa

    message = pa.struct([
        ("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
        ("tool_call_id", pa.string()), ("tool_calls", pa.string()), ("reasoning_content", pa.string()),
    ])
    return pa.schema([
        ("id", pa.string()),
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("response", pa.string()),
        ("messages", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("reward", pa.float64()),
        ("judge_reward", pa.float64()),
        ("integrated_reward", pa.float64()),
        ("excluded", pa.bool_()),
        ("thumb", pa.int8()),
        ("tags", pa.list_(pa.string())),
        ("correction", pa.string()),
        ("note", pa.string()),
        ("extra_info", pa.struct([
            ("turn_id", pa.string()), ("session_id", pa.string()), ("mode", pa.string()),
            ("task_id", pa.string()), ("group_id", pa.string()), ("turn_type", pa.string()),
            ("capture", pa.string()), ("wire_format", pa.string()), ("model", pa.string()), ("policy_version", pa.string()),
            ("created_at", pa.string()), ("hint", pa.string()), ("judgement_status", pa.string()),
            ("outcome", pa.float64()),
        ])),
        ("request_json", pa.string()),
        ("response_json", pa.string()),
    ])


def __getattr__(name: str) -> Any:
    if name == "SCHEMA":  # export.SCHEMA, as before: built at first use
        return schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dumps(value: Any) -> bytes:
    """JSON in UTF-8, by orjson (ten times the standard library's speed on a turn's rows); what
    orjson refuses (an integer past 64 bits, a key that is not a string) by the standard library.
    A float that is not finite is null either way: JSON has no NaN."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(_finite(value), ensure_ascii=False, default=str).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _message(m: dict[str, Any]) -> dict[str, Any]:
    calls = m.get("tool_calls")
    return {"role": str(m.get("role") or ""), "content": content_text(m.get("content")),
            "name": m.get("name"), "tool_call_id": m.get("tool_call_id"),
            "tool_calls": _dumps(calls).decode() if calls else None,
            "reasoning_content": m.get("reasoning_content")}


def row(turn: Turn, session: Session, judgement: Judgement | None, labels: dict[str, Any]) -> dict[str, Any]:
    """One turn as an export row (see the module docstring)."""
    request = turn.request or {}
    prompt = [_message(m) for m in request.get("messages") or [] if isinstance(m, dict)]
    if not prompt and isinstance(request.get("prompt"), str):  # /v1/completions
        prompt = [_message({"role": "user", "content": request["prompt"]})]
    choice = ((turn.response or {}).get("choices") or [{}])[0]
    reply = choice.get("message") or {"role": "assistant", "content": choice.get("text")}
    reply_msg = _message({"role": "assistant", **reply})
    eff = labels.get("effective", {})
    judge_reward = judgement.reward if judgement else None
    return {
        "id": turn.id,
        "data_source": "nextstate",
        "prompt": prompt,
        "response": reply_msg["content"],
        "messages": [*prompt, reply_msg],
        "ability": "agent",
        "reward_model": {"style": "model", "ground_truth": ""},
        "reward": float(eff["override"]) if eff.get("override") is not None else judge_reward,
        "judge_reward": judge_reward,
        "integrated_reward": judgement.integrated_reward if judgement else None,
        "excluded": bool(eff.get("exclude")),
        "thumb": eff.get("thumb"),
        "tags": list(eff.get("tags", [])),
        "correction": eff.get("correction"),
        "note": eff.get("note"),
        "extra_info": {
            "turn_id": turn.id, "session_id": session.id, "mode": session.mode, "task_id": session.task_id,
            "group_id": session.group_id, "turn_type": turn.turn_type, "capture": turn.capture,
            "wire_format": turn.wire_format,
            "model": turn.model, "policy_version": turn.policy_version, "created_at": iso(turn.created_at),
            "hint": judgement.hint if judgement else None,
            "judgement_status": judgement.status if judgement else None, "outcome": session.outcome,
        },
        "request_json": _dumps(request).decode(),
        "response_json": _dumps(turn.response).decode() if turn.response is not None else None,
    }


def iter_rows(engine: Engine, f: Browse, batch: int = 500) -> Iterator[list[dict[str, Any]]]:
    """Batches of export rows for the turns *f* selects, oldest first."""
    for items in iter_selected(engine, f, batch):
        with OrmSession(engine) as db:
            found = labels_mod.for_turns(db, [t.id for t, _, _ in items])
        yield [row(t, s, j, found.get(t.id, {})) for t, s, j in items]


def jsonl(engine: Engine, f: Browse, batch: int = 500) -> Iterator[bytes]:
    """JSON Lines, one batch of rows per chunk."""
    for rows in iter_rows(engine, f, batch):
        yield b"".join(_dumps(r) + b"\n" for r in rows)


class _Chunks:
    """A write-only file that hands what was written to the caller chunk by chunk."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def parquet(engine: Engine, f: Browse, batch: int = 500) -> Iterator[bytes]:
    """A Parquet file with one row group per batch, yielded as it is written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = _Chunks()
    writer = pq.ParquetWriter(sink, schema(), compression="zstd")
    try:
        for rows in iter_rows(engine, f, batch):
            writer.write_table(pa.Table.from_pylist(rows, schema=schema()), row_group_size=len(rows))
            yield sink.take()
    finally:
        writer.close()
    yield sink.take()
