"""The README stays a front door (under 10,000 characters), and every relative link in it and in docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_fits_on_a_few_screens():
    assert len((ROOT / "README.md").read_text()) < 10_000


def test_every_relative_link_resolves():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and "://" not in target and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
