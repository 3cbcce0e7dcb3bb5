"""The admin UI driven through Starlette's TestClient: the app logged in, a page's HTML, the
cells of its tables, the CSRF token it hands htmx, and every admin route of the app."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from base.settings import Settings
from gateway.app import create_app

# routes anyone may reach: the login page itself and the UI's static files
PUBLIC = {("GET", "/admin/login"), ("POST", "/admin/login"), ("GET", "/admin/static")}
ADMIN_PREFIXES = ("/admin", "/api")


def admin_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route of the app under an admin prefix, however it was mounted
    (FastAPI >= 0.16x keeps included routers nested: walk them)."""
    out: list[tuple[str, str]] = []

    def walk(routes: Any) -> None:
        for r in routes:
            if hasattr(r, "effective_route_contexts"):
                for ctx in r.effective_route_contexts():
                    for m in getattr(ctx.original_route, "methods", None) or ():
                        out.append((m, ctx.path))
            elif hasattr(r, "routes") and not hasattr(r, "methods") and getattr(r, "path", "") == "":
                walk(r.routes)
            else:
                for m in getattr(r, "methods", None) or ({"GET"} if hasattr(r, "path") else ()):
                    out.append((m, r.path))

    walk(app.routes)
    return sorted({(m, p) for m, p in out if p.startswith(ADMIN_PREFIXES) and m != "HEAD"})


@contextlib.contextmanager
def admin_client(database_url: str, tmp_path: Path) -> Iterator[TestClient]:
    """The gateway app on *database_url* (admin token ``tok-123``, no upstream), logged in as alice."""
    settings_ = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=database_url, admin_token="tok-123",
                         data_dir=tmp_path / "data")
    with TestClient(create_app(settings_)) as client:
        login(client)
        yield client


def admin_page(database_url: str, tmp_path: Path, path: str) -> str:
    """The HTML of the admin page *path*, which must answer 200."""
    with admin_client(database_url, tmp_path) as client:
        r = client.get(path)
        assert r.status_code == 200, r.text
        return r.text


def cells(html: str, testid: str) -> list[list[str]]:
    """The body rows of the table *testid*, as the text of their cells."""
    table = re.search(rf'data-testid="{testid}">(.*?)</table>', html, re.S)
    assert table, f"no table {testid}"
    body = table.group(1).split("<tbody>")[1]
    return [[" ".join(re.sub(r"<[^>]+>", " ", c).split()) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def login(client: TestClient, secret: str = "tok-123", name: str = "alice") -> str:
    r = client.post("/admin/login", data={"secret": secret, "name": name}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = client.get("/admin/sessions")
    assert page.status_code == 200
    return csrf_of(page.text)


def csrf_of(html: str) -> str:
    """The session's CSRF token, as the page hands it to htmx."""
    return re.search(r'"X-CSRF-Token": "([^"]+)"', html).group(1)
