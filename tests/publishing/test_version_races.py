"""Status changes of policy versions under concurrency, on both databases. Only the pool's side of
a promotion is exercised here (making vLLM serve the version, ``publishing.publish.serve``, is
replaced by a no-op); tests/publishing/test_publish.py runs the same against real servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from datapool.db import make_engine
from datapool.versions import list_versions, register
from publishing import publish
from publishing.publish import activate
from base.vocab import VersionKind
from tests.support.versions import promote_at_once

BASE_MODEL = "smollm2"
URLS = ["http://127.0.0.1:9/v1"]  # never called: serve is replaced


def test_concurrent_promotions_leave_exactly_one_active(database_url: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Nine promotions at once, from no active version (where each could read "none active" and
    demote nothing): exactly one version ends active, every round. SQLite once ended with two
    (its driver begins a transaction only at the first write)."""
    monkeypatch.setattr(publish, "serve", lambda *a, **kw: {})
    engine = make_engine(database_url)
    names = ["v1", "v2", "v3"]
    for name in names:
        (tmp_path / name).mkdir()
        register(engine, name=name, kind=VersionKind.LORA, base_model=BASE_MODEL, path=tmp_path / name,
                 parent_id=None, activate=False, stats={}, actor="test", reason=None, metrics={})

    def actives() -> list[str]:
        return [v["name"] for v in list_versions(engine) if v["status"] == "active"]

    for _ in range(3):
        assert activate(engine, "base", URLS) is None and actives() == []
        assert not promote_at_once(engine, names, URLS)
        assert len(actives()) == 1
    engine.dispose()
