"""The import graph points one way, read from the source with `ast` (nested and relative imports included):

- common/ (files, processes) is the bottom: it imports nothing of redumix outside itself;
- data/, generate/ and train/ import nothing from embedded/ or pipeline/; data/ (tasks, formats) knows no model, so it
  imports nothing from generate/ or train/ either (nor torch or a model library: a tokenizer's type alone), and
  generate/ nothing from train/;
- embedded/ is a library: it imports nothing from pipeline/;
- pipeline/ takes from embedded/ only what `redumix.embedded` exports (`__all__`: the build, its settings, measuring
  and the corpus replay), never one of its modules directly;
- the product's stages (pipeline/, outside pipeline/studies/) never import the studies, which run them.

No exception list: a new import that breaks a rule fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import redumix.embedded

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"common": "redumix.common", "data": "redumix.data", "generate": "redumix.generate",
            "train": "redumix.train", "pipeline": "redumix.pipeline", "embedded": "redumix.embedded"}
LAYERS = ("redumix.common", "redumix.data", "redumix.generate", "redumix.train", "redumix.embedded",
          "redumix.pipeline")
# Each folder, and the packages it must not know.
FORBIDDEN = {"common": tuple(p for p in LAYERS if p != "redumix.common"),
             "data": ("redumix.embedded", "redumix.pipeline", "redumix.generate", "redumix.train", "torch",
                      "transformers", "peft", "trl", "deepspeed"),
             "generate": ("redumix.embedded", "redumix.pipeline", "redumix.train"),
             "train": ("redumix.embedded", "redumix.pipeline"),
             "embedded": ("redumix.pipeline",)}
# data/ renders chat text with a tokenizer, so it may name the tokenizer's type; no model.
DATA_MAY_TAKE = {("transformers", "PreTrainedTokenizerBase")}
EMBEDDED_API = set(redumix.embedded.__all__)


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
                if folder == "data" and (module, name) in DATA_MAY_TAKE:
                    continue
                problems += [f"{where}:{line}: imports {shown} ({folder}/ must not know {above})"
                             for above in FORBIDDEN.get(folder, ()) if _touches(module, name, above)]
                studies = "redumix.pipeline.studies"
                if folder == "pipeline" and not _within(inside, studies) and _touches(module, name, studies):
                    problems.append(f"{where}:{line}: imports {shown} (the product's stages never import the "
                                    "studies, which run them)")
                if folder == "pipeline" and _touches(module, name, "redumix.embedded"):
                    if module != "redumix.embedded" or name not in EMBEDDED_API:
                        problems.append(f"{where}:{line}: imports {shown} (pipeline/ takes from embedded/ only "
                                        f"`from redumix.embedded import NAME` with NAME in its __all__)")
    return problems


def test_the_repository_keeps_its_layers():
    assert layer_violations(ROOT) == []


def test_the_check_sees_every_kind_of_forbidden_import(tmp_path):
    files = {
        "common/files.py": "from redumix.pipeline.run import RunDir\n",
        "data/chat.py": "from redumix.embedded.vocab import END\n",
        "data/grading.py": "from redumix.generate.loop import Generation\n",
        "data/shards.py": "import torch\n",
        "generate/loop.py": "from ..train import loss\n",
        "generate/plain.py": "def f():\n    import redumix.pipeline.run\n",
        "train/loss.py": "from redumix import embedded\n",
        "embedded/build.py": "def f():\n    from ..pipeline.config import Config\n",
        "pipeline/harvest.py": "from redumix.embedded import build_embedded\n",  # allowed: the package's API
        "pipeline/eval.py": "from ..embedded.measure import measure\n",
        "pipeline/studies/rounds.py": "from redumix.embedded import corpus_episodes\n",
        "pipeline/studies/evidence.py": "from redumix.pipeline.studies.rft import kept_rows\n",  # allowed
        "pipeline/train.py": "from redumix.pipeline.studies.rft import kept_rows\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = layer_violations(tmp_path)
    assert [p.split(":")[0] for p in found] == ["common/files.py", "data/chat.py", "data/grading.py", "data/shards.py",
                                                "generate/loop.py", "generate/plain.py", "train/loss.py",
                                                "pipeline/eval.py", "pipeline/studies/rounds.py", "pipeline/train.py",
                                                "embedded/build.py"]
    assert "imports redumix.embedded.measure.measure" in found[-4]
    assert "imports redumix.embedded.corpus_episodes" in found[-3]
    assert "never import the studies" in found[-2]
