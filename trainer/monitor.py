"""The online loop's live monitor: a version whose live rewards fall more than
``rollback_threshold`` below its parent's (over ``rollback_window`` scored turns) is rolled back
to the parent automatically, with a ``rollback`` event by ``live-monitor``."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from base.errors import PublishError
from datapool import queries, versions
from publishing import publish

log = logging.getLogger("nextstate.online")


class LiveMonitor:
    """Watches the active version's live rewards against its parent's."""

    def __init__(self, engine: Engine, urls: Sequence[str], base_model: str, *, window: int, threshold: float):
        self.engine = engine
        self.urls = list(urls)
        self.base_model = base_model
        self.window = window
        self.threshold = threshold

    def check(self) -> str | None:
        """Roll the active version back when its live rewards regressed; returns the version
        rolled back from, or None."""
        found = versions.active_and_parent(self.engine)
        if found is None or self.window <= 0:
            return None
        name, parent = found
        parent_name = parent if parent is not None else self.base_model
        with OrmSession(self.engine) as db:
            live = queries.live_rewards(db, name, self.window)
            before = queries.live_rewards(db, parent_name, self.window)
        if len(live) < self.window or not before:
            return None
        mean, base = sum(live) / len(live), sum(before) / len(before)
        if mean >= base - self.threshold:
            return None
        target = parent if parent is not None else versions.BASE
        try:
            publish.rollback(self.engine, self.urls, to=target, actor="live-monitor",
                              reason=f"mean live reward of {name} {mean:+.3f} over {len(live)} turns < "
                                     f"{parent_name} {base:+.3f} - {self.threshold}",
                              event_metrics={"live_reward": mean, "parent_reward": base, "n": len(live),
                                             "regressed": name})
        except PublishError as exc:
            log.error("live rewards of %s regressed but the rollback failed: %s", name, exc)
            return None
        log.warning("rolled back %s to %s: live reward %.3f vs %.3f", name, target, mean, base)
        return name
