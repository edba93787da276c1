"""The documents themselves: one coherent CHANGELOG, and the GPU run logs of docs/runs/
that the documents cite (each cited log exists, each kept log is cited and indexed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_changelog_has_one_unreleased_section_at_the_top() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == "Unreleased", headings
    assert sum("unreleased" in h.lower() for h in headings) == 1, f"more than one unreleased section: {headings}"
