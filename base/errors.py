"""The base of nextstate's domain errors, and what each means to an HTTP client.

Every error a layer raises on purpose derives from :class:`NextstateError`; its class says
which HTTP status and OpenAI error ``code`` it becomes when it reaches the gateway, so the
mapping is written once (``gateway.errors.install``), not at every route that may meet it.
An error whose class keeps the defaults (500, no code) is not the client's fault.
"""

from __future__ import annotations

from typing import ClassVar


class NextstateError(Exception):
    """Raised on purpose by a nextstate layer. ``status``, ``code`` and ``param``: the HTTP
    status, OpenAI error code and offending parameter it is answered with."""

    status: ClassVar[int] = 500
    code: ClassVar[str | None] = None
    param: ClassVar[str | None] = None
