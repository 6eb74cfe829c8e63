"""Every JSON file a run folder holds is strict JSON (no NaN, no Infinity), whatever the stages met on the way: a tiny
run of harvest, train, eval and export, at the size where train has no held-out row, walked file by file."""

from __future__ import annotations

import json
from pathlib import Path

from redumix.pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
# Four rows leave train no held-out set (the case), so its held-out KL is undefined.
SETTINGS = ["harvest.n=4", "harvest.shard_rows=4", "harvest.batch_size=4", "sampling.max_new_tokens=8",
            "redumix.reflection_max_tokens=6", "train.max_steps=1", "eval.n=4", "eval.n_other=4",
            "eval.decoders=[greedy]", "eval.tuned_decoders=[greedy]"]


def strict(text: str, where: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{where} holds {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def json_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))


def test_every_json_file_of_a_tiny_run_is_strict(tmp_path, capsys):
    run = tmp_path / "run"
    for stage in ("harvest", "train", "eval", "export"):
        assert main([stage, "--recipe", str(ROOT / "recipes" / "tiny.yaml"), "--run-dir", str(run), *SETTINGS]) == 0
    out = capsys.readouterr().out
    files = json_files(run)
    names = {str(p.relative_to(run)) for p in files}
    assert {"harvest/manifest.json", "train/metrics.json", "eval/report.json", "export/manifest.json",
            "export/sft.jsonl", "logs/metrics.jsonl", "eval/generations/base--greedy.jsonl"} <= names
    for path in files:
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text().split("\n"), start=1):
                if line:
                    strict(line, f"{path}:{number}")
        else:
            strict(path.read_text(), str(path))

    metrics = strict((run / "train" / "metrics.json").read_text(), "metrics.json")
    assert metrics["rows"]["heldout"] == 0
    assert metrics["heldout_kl_base"] is None and metrics["heldout_kl_merged"] is None
    assert metrics["heldout_note"].startswith("no held-out rows: train.heldout_fraction=0.05 of the 4 selected rows "
                                              "held none out")
    assert "train: held-out KL(p_mix ‖ model) per token: undefined (no held-out rows" in out
