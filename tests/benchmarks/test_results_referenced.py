"""Every result file kept under benchmarks/**/results/ is named by a page or a script: a run's
JSON, log, plot or table that no page quotes and no script reads is a stray, and goes (git
history keeps it). A page may name files one by one, with `{a,b}` alternatives
(`full-llm.{json,png}`) or with a `*` after a stem of its own (`results/h100-issue20b-*.json`)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = {".json", ".jsonl", ".csv", ".log", ".png", ".svg", ".txt"}
# where a result may be named: the pages and scripts of the benchmarks, the docs, the tests, the README
SOURCES = (".md", ".py", ".sh")
# a pattern counts only with this many characters of its own before the extension: `*.json` names nothing
MIN_STEM = 6


def _data_files() -> list[Path]:
    return sorted(p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and p.suffix in DATA
                  and "results" in p.relative_to(ROOT / "benchmarks").parts[:-1])


def _sources() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in ("benchmarks", "docs", "tests"):
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in SOURCES and p.is_file()]
    return found


def _alternatives(token: str) -> list[str]:
    """`a.{json,png}` -> `a.json`, `a.png` (nested and repeated braces too)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [out for alt in m.group(1).split(",") for out in _alternatives(token[:m.start()] + alt + token[m.end():])]


def names_and_patterns(text: str) -> tuple[set[str], set[str]]:
    """The file names a text gives, and its glob patterns (those with a stem of their own)."""
    names: set[str] = set()
    patterns: set[str] = set()
    for token in re.findall(r"[\w.{},*-]+", text):
        for name in _alternatives(token.strip(",.")):
            if "." not in name:
                continue
            if "*" not in name:
                names.add(name)
            elif len(re.sub(r"\.[\w*]+$", "", name).replace("*", "")) >= MIN_STEM and not name.startswith("*"):
                patterns.add(name)
    return names, patterns


def unreferenced(data: list[Path], texts: list[str]) -> list[Path]:
    names: set[str] = set()
    patterns: set[str] = set()
    for text in texts:
        n, p = names_and_patterns(text)
        names |= n
        patterns |= p
    return [f for f in data if f.name not in names and not any(fnmatch.fnmatchcase(f.name, p) for p in patterns)]


def test_every_result_file_is_named_by_a_page_or_a_script() -> None:
    data = _data_files()
    assert len(data) > 20  # the rule reads the real folders
    texts = [p.read_text(errors="replace") for p in _sources()]
    stray = [str(f.relative_to(ROOT)) for f in unreferenced(data, texts)]
    assert stray == [], ("result files no page or script names: quote them on their results page, or delete "
                         f"them (git history keeps them): {stray}")


def test_a_stray_file_is_caught_and_the_ways_of_naming_one_are_read(tmp_path: Path) -> None:
    files = [tmp_path / n for n in ("full-llm.json", "full-llm.png", "h100-issue20b-q.json", "20261127T030020Z.txt",
                                    "stray.json", "other-run.log")]
    page = ("`full-llm.{json,png}`, `results/h100-issue20b-*.json`, `results/20261127T030020Z.*`; "
            "every run writes `*.json` and `*.log`")
    assert unreferenced(files, [page]) == [tmp_path / "stray.json", tmp_path / "other-run.log"]
