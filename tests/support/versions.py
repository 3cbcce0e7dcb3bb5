"""Policy versions in a test's pool: a LoRA version registered from a stub adapter (in this process
or, by `python -c`, in another, as a trainer would), and promotions started together as several
operators or processes would (tests/publishing/test_version_races.py on the pool alone,
test_publish.py against real servers)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from base.vocab import VersionKind
from datapool import versions
from datapool.db import make_engine
from publishing.publish import activate


def promote_at_once(engine: Any, names: list[str], urls: list[str], n: int = 9) -> list[BaseException]:
    """*n* promotions started together, by threads (several operators, several processes), cycling
    through *names*; returns what they raised."""
    errors: list[BaseException] = []

    def promote(name: str) -> None:
        try:
            activate(engine, name, urls)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=promote, args=(names[i % len(names)],)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def register_lora(url: str, name: str, tmp: Path, *, activate: bool = True) -> None:
    """Register (and by default activate) version *name* in the pool at *url*: a LoRA adapter
    stub written under *tmp*, nothing served."""
    engine = make_engine(url)
    try:
        path = tmp / name
        path.mkdir()
        (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
        versions.register(engine, name=name, kind=VersionKind.LORA, base_model="smollm2", path=path,
                          parent_id=None, activate=activate, stats=None, actor="test", reason=None, metrics={})
    finally:
        engine.dispose()
