"""JSON on the hot paths (the proxy's events, the capture spool, the pool's JSON columns): orjson,
about ten times the standard library's speed, and the standard library for what orjson refuses.

Both write and read the same JSON: compact, UTF-8 as is (``ensure_ascii=False``). What orjson
refuses goes to the standard library, as before: writing, a key that is not a string or an
integer past 64 bits; reading, NaN or Infinity (which :func:`loads` hands to *parse_constant*),
an unpaired surrogate escape, nesting past orjson's depth limit. Two differences remain: orjson
writes a float NaN or infinity as ``null`` (the standard library writes ``NaN``, which is not
JSON), and reads an integer past 64 bits as a float.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson


#: ``json.dumps(value, sort_keys=True, ensure_ascii=False)``, the encoder built once: the text the
#: pool's stitching hashes are taken of (datapool.canonical, datapool.edits), so it stays the
#: standard library's, byte for byte; json.dumps builds a new encoder at every call with these options
canonical_dumps = json.JSONEncoder(sort_keys=True, ensure_ascii=False).encode


def dumps(value: Any) -> bytes:
    """*value* as compact UTF-8 JSON bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: what it cannot write, the standard library may
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def dumps_str(value: Any) -> str:
    """:func:`dumps` as text (SQLAlchemy's ``json_serializer``)."""
    return dumps(value).decode()


def loads(data: bytes | str, *, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """JSON text as Python values; raises ValueError (json.JSONDecodeError) for invalid JSON,
    as the standard library does."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        if parse_constant is None:
            return json.loads(data)
        return json.loads(data, parse_constant=parse_constant)
