"""One exception tree: every exception class the shipped packages define is in base/errors.py,
under NextstateError, and drawn in its docstring where it hangs; the gateway renders one in
each dialect by the path it was raised on."""

from __future__ import annotations

import ast
import builtins
import re
import tomllib
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.testclient import TestClient

import base.errors
from base.errors import NextstateError, RequestError, VersionNotFound
from gateway import errors

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [p.rstrip("*") for p in
           tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]]

# Exception classes that may live outside the tree, and why.
ALLOWED = {
    # a retry signal between two methods of the runner, caught in the same module; never raised to a caller
    "rollout/runner.py:_AgentInfraError",
}

_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _exception_classes() -> dict[str, str]:
    """``path:Class`` -> path, for every class of the shipped packages that derives (through
    base names alone: no module is imported) from a builtin exception, a library's ``*Error`` /
    ``*Exception``, or another such class of ours."""
    bases: dict[str, tuple[str, list[str]]] = {}
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.ClassDef):
                    names = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                    bases[f"{rel}:{node.name}"] = (node.name, names)
    ours = {name for name, _ in bases.values()}
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        known = {key.split(":")[1] for key in found}
        for key, (name, names) in bases.items():
            if key in found:
                continue
            if any(b in _BUILTIN_EXCEPTIONS or b in known
                   or (b not in ours and b.endswith(("Error", "Exception"))) for b in names):
                found[key] = key.split(":")[0]
                changed = True
    return found


def test_every_exception_class_is_in_base_errors_under_nextstate_error() -> None:
    found = _exception_classes()
    assert "gateway/errors.py:RequestError" not in found and "base/errors.py:RequestError" in found
    elsewhere = sorted(k for k, path in found.items() if path != "base/errors.py" and k not in ALLOWED)
    assert elsewhere == [], f"define these in base/errors.py (or justify them in ALLOWED): {elsewhere}"
    assert ALLOWED <= set(found), "an allowed class is gone: drop it from ALLOWED"
    for key, path in found.items():
        if path == "base/errors.py":
            cls = getattr(base.errors, key.split(":")[1])
            assert issubclass(cls, NextstateError), key


def _tree() -> dict[str, str | None]:
    """Class -> the parent it is drawn under in base/errors.py's docstring (None: the root)."""
    drawn: dict[str, str | None] = {}
    stack: list[str] = []
    for line in (base.errors.__doc__ or "").splitlines():
        m = re.match(r"^    ((?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+)\b", line)
        if m is None:
            continue
        depth = len(m[1]) // 4 + (1 if "──" in line else 0)
        stack[depth:] = [m[2]]
        drawn[m[2]] = stack[depth - 1] if depth else None
    return drawn


def test_the_docstring_draws_every_class_of_the_tree_under_its_parent() -> None:
    classes = {n: c for n, c in vars(base.errors).items()
               if isinstance(c, type) and issubclass(c, BaseException) and c.__module__ == "base.errors"}
    drawn = _tree()
    assert set(drawn) == set(classes)
    for name, cls in classes.items():
        parent = next((b.__name__ for b in cls.__bases__ if issubclass(b, NextstateError)), None)
        assert drawn[name] == parent, (name, drawn[name], parent)


def _app() -> FastAPI:
    app = FastAPI()
    errors.install(app)

    def page(request: Request, status: int, message: str, request_id: str | None) -> Response:
        return HTMLResponse(f"<p>{status}: {message}</p>", status_code=status)

    errors.error_page(app, "/admin", page)

    for path in ("/v1/chat/completions", "/s/abc/v1/messages", "/admin/versions"):
        @app.post(path)
        async def missing() -> None:
            raise VersionNotFound("no policy version named 'v9'")

    @app.post("/v1/messages/count_tokens")
    async def down() -> None:
        raise RequestError(503, "upstream policy is unreachable", code="upstream_unavailable",
                          headers={"Retry-After": "2"})

    return app


def test_one_error_in_each_dialect_by_the_path_it_was_raised_on() -> None:
    with TestClient(_app()) as client:
        r = client.post("/v1/chat/completions")
        assert r.status_code == 404 and r.json() == {"error": {
            "message": "no policy version named 'v9'", "type": "not_found_error", "param": None,
            "code": "version_not_found"}}
        r = client.post("/s/abc/v1/messages")
        assert r.status_code == 404 and r.json() == {"type": "error", "error": {
            "type": "not_found_error", "message": "no policy version named 'v9'"}}
        r = client.post("/admin/versions")
        assert r.status_code == 404 and r.text == "<p>404: no policy version named 'v9'</p>"
        # an upstream that is down: Anthropic's overloaded 529, the error's own headers kept
        r = client.post("/v1/messages/count_tokens")
        assert r.status_code == 529 and r.headers["retry-after"] == "2"
        assert r.json()["error"] == {"type": "overloaded_error", "message": "upstream policy is unreachable"}
