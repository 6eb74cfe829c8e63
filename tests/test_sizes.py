"""Every Python file outside tests/ holds one idea in at most 400 lines. The exception list is named and empty: a file
that grows past the limit is split, or named here with the reason it may not be."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 400
FOLDERS = ("common", "data", "embedded", "generate", "pipeline", "train", "bench")
EXCEPTIONS: dict[str, str] = {}  # path -> why it may be longer


def too_long(root: Path) -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            name = str(path.relative_to(root))
            if lines > LIMIT and name not in EXCEPTIONS:
                found.append(f"{name}: {lines} lines")
    return found


def test_every_file_outside_tests_is_at_most_400_lines():
    assert too_long(ROOT) == []


def test_the_check_sees_a_long_file(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "big.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "pipeline" / "ok.py").write_text("x = 1\n" * LIMIT)
    assert too_long(tmp_path) == [f"pipeline/big.py: {LIMIT + 1} lines"]
