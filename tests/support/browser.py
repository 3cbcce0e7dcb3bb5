"""Debian's chromium driven by Playwright, for the admin UI's browser tests (Playwright's own
browser downloads are never used: `make browser` installs the `chromium` package).

A browser test module calls ``require_chromium()`` at import (it skips the module, saying
why, where Playwright or chromium is missing) and takes the ``browser`` fixture from
tests/conftest.py: one headless chromium per module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")


def require_chromium() -> Any:
    """Playwright's sync API, or a module-level skip that says what to install."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    if not CHROMIUM.exists():  # pragma: no cover - CI installs it (make browser)
        pytest.skip("needs Debian's chromium package at /usr/bin/chromium (apt-get install -y chromium)",
                    allow_module_level=True)
    return sync_api


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless chromium (no sandbox: tests run as root in containers)."""
    sync_api = require_chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()
