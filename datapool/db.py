"""Engines and schema upgrades for the pool (PostgreSQL via psycopg 3, or SQLite)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import JSON, DateTime, Engine, Null, Table, create_engine, event, insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeDecorator

from base.jsonfast import dumps_str, loads

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

# values per IN list or multi-row VALUES, far below SQLite's and PostgreSQL's bound-parameter limits
BIND_CHUNK = 1000

T = TypeVar("T")


def utcnow() -> datetime:
    """Now, as an aware UTC datetime: the only clock the pool is written with."""
    return datetime.now(timezone.utc)


def as_utc(value: datetime) -> datetime:
    """*value* as an aware UTC datetime; a zoneless one is taken to be UTC already."""
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


def iso(value: datetime | None) -> str | None:
    """ISO 8601 text of a pool time (None stays None)."""
    return value.isoformat() if value is not None else None


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that always hands back aware UTC datetimes.

    PostgreSQL stores instants; SQLite stores the wall-clock text and drops the zone, so it
    reads back zoneless values. Every value is converted to UTC on the way in (so SQLite's text
    compares as the instants do) and marked UTC on the way out. The column type in the
    database is unchanged: DDL and migrations see the plain ``DateTime(timezone=True)``.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return as_utc(value) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return as_utc(value) if value is not None else None


def chunked(values: Iterable[T], size: int = BIND_CHUNK) -> Iterator[list[T]]:
    """``values`` in lists of at most ``size``, in order."""
    items = list(values)
    for i in range(0, len(items), size):
        yield items[i : i + size]


def pg_array(values: Iterable[str | int]) -> str:
    """PostgreSQL's text of an array of strings or integers, for a ``CAST(:param AS type[])``: one
    parameter psycopg sends as it is, where it dumps a list value by value in Python (the capture
    writer passes a batch's ids, hashes and lock keys so, up to ~1,000 a statement: 5 % of its profile)."""
    return "{" + ",".join(str(v) if isinstance(v, int) else
                          '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine for ``url`` tuned for the pool: WAL and a busy timeout on SQLite,
    short connect timeouts, pre-ping (so a restarted server is noticed), no JIT, SSD-priced
    random reads and no generic plans on PostgreSQL."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30}, json_serializer=dumps_str, json_deserializer=loads)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        # a bare postgresql:// URL would pick psycopg2; we ship psycopg 3
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    connect: dict[str, Any] = {"connect_timeout": 5}
    if "options" not in parsed.query:  # a URL's own ?options=... replaces these
        # no JIT compilation: the pool's queries are short (pages of 50 rows found by index), and
        # compiling one whose estimate crosses jit_above_cost took 60 ms of an 85 ms UI page; and
        # random reads priced as on SSD or cache (the server default prices a disk seek): the
        # planner then walks the 2,500 turns of 500 eval sessions by index (18 ms) rather than
        # scanning 50,000 (89 ms); and every execution planned for its own values (psycopg prepares a
        # statement on its 5th run, and the server's generic plan for it, made while the pool was
        # empty, kept scanning the turns by sequence as they grew: `SELECT ... WHERE id IN (50 ids)`
        # took 10 ms at 10,000 turns against 0.2 ms planned anew; benchmarks.stitch_openings)
        connect["options"] = "-c jit=off -c random_page_cost=1.1 -c plan_cache_mode=force_custom_plan"
    return create_engine(
        url,
        json_serializer=dumps_str,  # the JSON columns by orjson: a captured turn is mostly JSON
        json_deserializer=loads,
        pool_size=pool_size,
        pool_pre_ping=True,
        connect_args=connect,
    )


def dialect_insert(db: Session) -> Any:
    """``insert`` of the session's dialect, for ``on_conflict_do_nothing`` / ``_do_update``
    (PostgreSQL and SQLite both have them; the generic insert does not)."""
    return postgresql.insert if db.get_bind().dialect.name == "postgresql" else sqlite.insert


def insert_rows(db: Session, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """``db.execute(insert(table), rows)``, as PostgreSQL's ``COPY … FROM STDIN`` there.

    Every row has the same keys (the columns it fills). Each value goes through its column
    type's bind processing as in the insert (the JSON columns as the engine's serializer writes
    them, times in UTC), and a column the rows leave out gets its Python-side default as the
    insert would give it (where that default is a function's, the rows go by the insert as
    before): the same rows. The capture writer's executemany of a batch's turns cost SQLAlchemy's per-row
    parameter handling and one pipelined statement per row (benchmarks/gateway/README.md). A
    failure is raised as SQLAlchemy's ``DBAPIError`` of the driver's error, as from ``execute``."""
    if not rows:
        return
    dialect = db.get_bind().dialect
    given = list(rows[0])
    defaults: dict[str, Any] = {c.name: c.default for c in table.c if c.name not in rows[0] and c.default is not None}
    if dialect.name != "postgresql" or not all(d.is_scalar for d in defaults.values()):
        db.execute(insert(table), list(rows))
        return
    fixed = [d.arg for d in defaults.values()]
    names = given + list(defaults)
    processors = [_copy_processor(table.c[n].type, dialect) for n in names]
    quote = dialect.identifier_preparer.quote
    sql = f"COPY {dialect.identifier_preparer.format_table(table)} ({', '.join(map(quote, names))}) FROM STDIN"
    raw = db.connection().connection.dbapi_connection
    assert raw is not None
    error = dialect.loaded_dbapi.Error
    try:
        with raw.cursor() as cursor, cursor.copy(sql) as copy:
            for row in rows:
                values = [row[n] for n in given]
                values += fixed
                copy.write_row([v if p is None else p(v) for v, p in zip(values, processors)])
    except error as exc:
        raise DBAPIError.instance(sql, None, exc, error, dialect=dialect) from exc


def _copy_processor(type_: Any, dialect: Dialect) -> Callable[[Any], Any] | None:
    """A column's bind processing for insert_rows' COPY: its type's, except that a JSON column's value
    goes as the text the engine's serializer writes (COPY's text format takes it for json and jsonb as
    it is) instead of wrapped in psycopg's ``Jsonb`` for psycopg's dumper to call that same serializer
    (SQLAlchemy's processor, psycopg's Python dumper: a third of the COPY's CPU); SQL NULL and JSON
    null as SQLAlchemy's JSON type makes them."""
    impl = type_.dialect_impl(dialect)
    serialize = getattr(dialect, "_json_serializer", None)
    if not isinstance(impl, JSON) or serialize is None:
        return impl.bind_processor(dialect)
    json_null, none_as_null = impl.NULL, impl.none_as_null

    def process(value: Any) -> Any:
        if value is json_null:
            value = None
        elif value is None and none_as_null or isinstance(value, Null):
            return None
        return serialize(value)

    return process


def alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision`` (creating the SQLite file if needed)."""
    from alembic import command

    make_engine(url).dispose()  # creates the SQLite parent directory
    command.upgrade(alembic_config(url), revision)


def head_revision() -> str:
    """The newest revision in migrations/: what `upgrade` brings a database to."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
