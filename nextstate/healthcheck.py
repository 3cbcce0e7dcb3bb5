"""Container health checks: ``python -m nextstate.healthcheck gateway|worker|trainer``.

Exit status 0 when the role in this container is healthy, 1 when not (with the reason on
stderr), as Docker's HEALTHCHECK expects. Kubernetes probes the gateway over HTTP
(``/healthz``, ``/readyz``) and runs this for the worker and the trainer.
"""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request

from base.settings import Settings


def check_gateway(settings: Settings, timeout_s: float = 4.0) -> str | None:
    """None when this container's gateway answers ``GET /healthz`` with 200."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    url = f"http://{host}:{settings.port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"{url}: HTTP {resp.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def check_worker(settings: Settings, timeout_s: float = 5.0) -> str | None:
    """None when this host's Celery worker answers a ping over the broker."""
    from datapool.queue import make_celery

    if not settings.resolved_broker_url.startswith(("redis://", "rediss://", "amqp://", "pyamqp://")):
        return "the broker has no broadcast (SQLite transport): cannot ping the worker"
    app = make_celery(settings)
    name = f"celery@{socket.gethostname()}"
    try:
        replies = app.control.ping(destination=[name], timeout=timeout_s)
    except Exception as exc:  # broker down: kombu raises several types
        return f"broker {type(exc).__name__}: {exc}"
    finally:
        app.close()
    return None if any(name in reply for reply in replies) else f"{name} did not answer a ping"


def check_trainer(settings: Settings) -> str | None:
    """None when the pool the trainer leases batches from answers ``SELECT 1``."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import SQLAlchemyError

    engine = create_engine(settings.resolved_database_url, connect_args=_connect_timeout(settings))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return None
    except SQLAlchemyError as exc:
        return f"pool unreachable: {exc.__class__.__name__}: {str(exc).splitlines()[0]}"
    finally:
        engine.dispose()


def _connect_timeout(settings: Settings) -> dict[str, int]:
    return {"connect_timeout": 5} if settings.resolved_database_url.startswith("postgresql") else {}


CHECKS = {"gateway": check_gateway, "worker": check_worker, "trainer": check_trainer}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in CHECKS:
        print(f"usage: python -m nextstate.healthcheck {'|'.join(CHECKS)}", file=sys.stderr)
        return 2
    problem = CHECKS[args[0]](Settings())
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
