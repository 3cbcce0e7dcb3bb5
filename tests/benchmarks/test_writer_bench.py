"""benchmarks.gateway.writer (the capture writer alone, CPU µs per turn) runs end to end on a small
traffic: each round stores every turn it built, and its report says µs per turn, split."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from benchmarks.gateway import writer
from datapool.db import make_engine
from datapool.models import Turn


def test_a_round_stores_every_turn_and_reports_its_cpu(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from contextlib import ExitStack

    from benchmarks.stitch import database_maker

    with ExitStack() as stack:
        url = database_maker(stack, tmp_path)("sqlite")
        got = writer.one_round(url, 40, 16, seed=1)
        engine = make_engine(url)
        with OrmSession(engine) as db:
            stored = db.scalar(select(func.count()).select_from(Turn))
        engine.dispose()
    assert stored == 40
    assert got["total"] == pytest.approx(got["redact"] + got["transaction"]) and got["transaction"] > 0
    assert writer.main(["--turns", "24", "--batch", "8", "--rounds", "1", "--databases", "sqlite"]) == 0
    assert re.search(r"sqlite +median : +\d+\.\d µs/turn \(redact +\d+\.\d, transaction +\d+\.\d\)",
                     capsys.readouterr().out)
