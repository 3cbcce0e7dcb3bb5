"""Pool calls from request handlers: in a worker thread (the event loop never waits on the
database), with a database that is down answered as 503 in the API's dialect."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

from base.errors import RequestError

T = TypeVar("T")


def unavailable(exc: SQLAlchemyError) -> RequestError:
    """The 503 a handler answers when the pool cannot be reached (first line of the error only)."""
    return RequestError(503, f"pool unavailable: {str(exc).splitlines()[0]}")


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a worker thread; SQLAlchemy errors become :func:`unavailable`."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except SQLAlchemyError as exc:
        raise unavailable(exc) from exc


async def in_pool(engine: Engine, fn: Callable[..., T], *args: Any, write: bool = False, **kwargs: Any) -> T:
    """``fn(db, *args, **kwargs)`` with a session of its own, in a worker thread; with *write*,
    inside one transaction committed when *fn* returns."""
    def run() -> T:
        with OrmSession(engine) as db:
            if not write:
                return fn(db, *args, **kwargs)
            with db.begin():
                return fn(db, *args, **kwargs)

    return await in_thread(run)
