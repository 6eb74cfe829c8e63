"""The import graph points one way, read from the source with `ast` (nested and relative imports included):

- data/, generate/ and train/ import nothing from embedded/ or pipeline/; data/ (tasks, formats) knows no model, so it
  imports nothing from generate/ or train/ either, and generate/ nothing from train/;
- the stages in pipeline/ reach the embedded model only through `ensure_base`; the CLI also runs `run_base` (the
  `base` stage), pipeline/config.py composes the `base` section, `BaseConfig`, and pipeline/train.py replays the
  base's corpus (`train.replay`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"data": "redumix.data", "generate": "redumix.generate", "train": "redumix.train",
            "pipeline": "redumix.pipeline", "embedded": "redumix.embedded"}
# Each lower folder, and the packages above it that it must not know.
ABOVE = {"data": ("redumix.embedded", "redumix.pipeline", "redumix.generate", "redumix.train"),
         "generate": ("redumix.embedded", "redumix.pipeline", "redumix.train"),
         "train": ("redumix.embedded", "redumix.pipeline")}
ENSURE_BASE = ("redumix.embedded.stage", "ensure_base")
# What a module of pipeline/ may import from embedded/, as (module, name).
EMBEDDED_ALLOWED = {
    "cli.py": {ENSURE_BASE, ("redumix.embedded.stage", "run_base")},
    "config.py": {ENSURE_BASE, ("redumix.embedded.config", "BaseConfig")},
    "train.py": {ENSURE_BASE, ("redumix.embedded.replay", "replay_conversations"),
                 ("redumix.embedded.replay", "CONTEXT_ONLY")},
}


def imported(path: Path, package: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every import in a file: name is None for `import module`, else the name taken
    `from module`. Relative imports are resolved against `package`."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out += [(node.lineno, module, alias.name) for alias in node.names]
    return out


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _touches(module: str, name: str | None, package: str) -> bool:
    """Whether the import reaches into `package`: `from redumix import embedded` does, as `import redumix.embedded`."""
    return _within(module, package) or (name is not None and _within(f"{module}.{name}", package))


def layer_violations(root: Path) -> list[str]:
    """Every import under `root` that breaks the rules of the module docstring, as `path:line: what`."""
    problems = []
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).glob("**/*.py")):
            where = path.relative_to(root)
            inside = ".".join([package, *path.relative_to(root / folder).parent.parts])  # subfolders are subpackages
            for line, module, name in imported(path, inside):
                shown = f"{module}.{name}" if name else module
                if folder in ABOVE:
                    problems += [f"{where}:{line}: imports {shown} ({folder}/ must not know {above})"
                                 for above in ABOVE[folder] if _touches(module, name, above)]
                elif folder == "pipeline" and _touches(module, name, "redumix.embedded"):
                    allowed = EMBEDDED_ALLOWED.get(path.name, {ENSURE_BASE})
                    if (module, name) not in allowed:
                        names = ", ".join(sorted(n for _, n in allowed))
                        problems.append(f"{where}:{line}: imports {shown} (pipeline/{path.name} may take only "
                                        f"{names} from embedded/)")
    return problems


def test_the_repository_keeps_its_layers():
    assert layer_violations(ROOT) == []


def test_the_check_sees_every_kind_of_forbidden_import(tmp_path):
    files = {
        "data/chat.py": "from redumix.embedded.vocab import END\n",
        "data/grading.py": "from redumix.generate.loop import Generation\n",
        "generate/loop.py": "from ..train import loss\n",
        "generate/plain.py": "def f():\n    import redumix.pipeline.run\n",
        "train/loss.py": "from redumix import embedded\n",
        "pipeline/harvest.py": "from redumix.embedded.stage import ensure_base, run_base\n",
        "pipeline/eval.py": "from ..embedded import measure\n",
        "pipeline/rounds.py": "from redumix.embedded.stage import ensure_base\nfrom .run import RunDir\n",
        "pipeline/cli.py": "def f():\n    from redumix.embedded.stage import run_base\n",
        "pipeline/config.py": "from redumix.embedded.config import BaseConfig\n",
        "embedded/stage.py": "from redumix.pipeline.config import Config\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = layer_violations(tmp_path)
    assert [p.split(":")[0] for p in found] == ["data/chat.py", "data/grading.py", "generate/loop.py",
                                                "generate/plain.py", "train/loss.py", "pipeline/eval.py",
                                                "pipeline/harvest.py"]
    assert "imports redumix.embedded.stage.run_base" in found[-1]
    assert "imports redumix.embedded.measure" in found[-2]
