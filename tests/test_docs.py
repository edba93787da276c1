"""The documents themselves: one coherent CHANGELOG, the GPU run logs of docs/runs/ that
the documents cite (each cited log exists, each kept log is cited and indexed), and README's
test command, the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_changelog_has_one_unreleased_section_at_the_top() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == "Unreleased", headings
    assert sum("unreleased" in h.lower() for h in headings) == 1, f"more than one unreleased section: {headings}"


def test_ci_runs_readmes_test_command_and_it_selects_every_test() -> None:
    """A plain ``pytest`` leaves out the tests marked slow (pyproject's addopts): README's
    command selects them again, and CI (.ci/run, scripts/check-newest) runs that command."""
    found = re.search(r"^python -m pytest(.*)$", (ROOT / "README.md").read_text(), re.M)
    assert found, "README.md gives no test command"
    assert found.group(1) == ' -m "slow or not slow"', found.group(0)
    for path in (".ci/run", "scripts/check-newest"):
        assert f"-m pytest -q{found.group(1)}\n" in (ROOT / path).read_text(), path


RUNS = ROOT / "docs" / "runs"
INDEX = RUNS / "README.md"
CITED = re.compile(r"(?:docs/)?runs/([A-Za-z0-9][\w.-]*\.(?:log|txt|json))")


def _documents() -> list[Path]:
    """The documents that may cite run logs (the index itself is not one of them)."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _citations() -> dict[str, set[str]]:
    """Each cited log's name -> the documents citing it."""
    found: dict[str, set[str]] = {}
    for doc in _documents():
        for name in CITED.findall(doc.read_text()):
            found.setdefault(name, set()).add(str(doc.relative_to(ROOT)))
    return found


def _index() -> dict[str, set[str]]:
    """Each log of the index -> the documents its line says cite it."""
    rows = re.findall(r"^\| \[([^\]]+)\]\(([^)]+)\) \|.*\| ([^|]+) \|$", INDEX.read_text(), re.M)
    assert rows, "docs/runs/README.md has no index table"
    index = {}
    for name, link, cited_by in rows:
        assert name == link, f"the index links {link} under the name {name}"
        assert name not in index, f"{name} is indexed twice"
        index[name] = {d.strip() for d in cited_by.split(",")}
    return index


def test_every_cited_run_log_exists() -> None:
    missing = {name: docs for name, docs in _citations().items() if not (RUNS / name).is_file()}
    assert not missing, f"documents cite run logs that docs/runs/ does not have: {missing}"


def test_every_kept_run_log_is_cited_and_indexed() -> None:
    kept = {p.name for p in RUNS.iterdir() if p.name != "README.md"}
    cited, index = _citations(), _index()
    uncited = sorted(kept - set(cited))
    assert not uncited, f"no document cites these logs: cite them or git rm them: {uncited}"
    assert set(index) == kept, f"docs/runs/README.md must list exactly the kept logs: {sorted(set(index) ^ kept)}"
    wrong = {name: (index[name], cited[name]) for name in kept if index[name] != cited[name]}
    assert not wrong, f"the index's 'cited by' differs from the documents (index, documents): {wrong}"


def test_every_test_the_documents_cite_exists() -> None:
    """A document that points at a test as the proof of what it says points at one that runs."""
    defined = set()
    for path in (ROOT / "tests").glob("*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    cited = set()
    for doc in _documents():
        cited |= {name for name in re.findall(r"\b(test_\w+)", doc.read_text()) if name not in modules}
    assert cited - defined == set(), f"documents cite tests that do not exist: {sorted(cited - defined)}"
