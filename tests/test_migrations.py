"""Alembic migrations: the same revisions pass on PostgreSQL and SQLite, up and down, and match the models."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from datapool.db import alembic_config, current_revision, head_revision, make_engine
from datapool.models import Base


def test_migrations_round_trip_and_match_models(database_url: str) -> None:
    # the fixture has already upgraded to head
    engine = make_engine(database_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    assert {"sessions", "turns", "turn_continuations", "policy_versions", "votes", "judgements"} <= set(
        inspect(engine).get_table_names())
    engine.dispose()

    command.downgrade(alembic_config(database_url), "base")
    engine = make_engine(database_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    command.upgrade(alembic_config(database_url), "head")
    assert current_revision(database_url) == head_revision()
