"""`redumix export`: the harvest as data sets that TRL's trainers read as they are.

Two sets, both conversational, so the model's own chat template renders them:
- `dpo`: preference pairs where the reflection turned a wrong answer right. prompt = [user: x], chosen =
  [assistant: y (the redo, correct)], rejected = [assistant: y1 (the original, wrong)]. DPOTrainer's format.
- `sft`: prompt-completion rows, SFTTrainer's format (the loss falls on the completion alone). `kind` = "redo":
  prompt = [user: x], completion = [assistant: y], for every redo the verifier judged correct. `kind` =
  "reflection": prompt = [x ‖ y1 ‖ r ‖ REFLECT] (data/prompts.py's `reflect_messages`), completion = [assistant: c],
  for the reflections that turned a wrong answer right (the rows of the DPO pairs). Filter on `kind` for one alone.
Unknown verdicts never qualify. Every row keeps the harvest row's `id`.

Each set is written three ways into RUN_DIR/export/: NAME.jsonl (one JSON object a line), NAME.parquet and NAME/
(a Hugging Face dataset: `datasets.load_from_disk`). Then the resolved config.yaml, and manifest.json last; a
complete export is skipped.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, List, Value

from redumix.common.files import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    read_json,
)
from redumix.common.ranks import print0, rank
from redumix.data.prompts import attempt_messages, reflect_messages
from redumix.data.shards import load_shards
from redumix.pipeline.config import Config
from redumix.pipeline.harvest_folder import check_harvest
from redumix.pipeline.lineage import changed_inputs, harvest_id
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import RunDir

# Declared, so that an empty set still has its columns (a harvest with no fixed row exports no pair).
MESSAGES = List({"role": Value("string"), "content": Value("string")})
FEATURES = {
    "dpo": Features({"id": Value("string"), "prompt": MESSAGES, "chosen": MESSAGES, "rejected": MESSAGES}),
    "sft": Features({"id": Value("string"), "kind": Value("string"), "prompt": MESSAGES, "completion": MESSAGES}),
}


def fixed(row: dict[str, Any]) -> bool:
    """The reflection turned a wrong answer right."""
    return row["redo_correct"] is True and row["original_correct"] is False


def dpo_pairs(rows: Any) -> list[dict[str, Any]]:
    """Rows whose redo is correct and whose original is wrong -> DPO pairs."""
    return [
        {
            "id": row["id"],
            "prompt": attempt_messages(row["prompt"]),
            "chosen": [{"role": "assistant", "content": row["redo"]}],
            "rejected": [{"role": "assistant", "content": row["original"]}],
        }
        for row in rows
        if fixed(row)
    ]


def sft_rows(rows: Any) -> list[dict[str, Any]]:
    """Every correct redo after x, then every reflection that fixed its attempt after [x ‖ y1 ‖ r ‖ REFLECT]."""
    redos = [
        {"id": row["id"], "kind": "redo", "prompt": attempt_messages(row["prompt"]),
         "completion": [{"role": "assistant", "content": row["redo"]}]}
        for row in rows
        if row["redo_correct"] is True
    ]
    reflections = [
        {"id": row["id"], "kind": "reflection", "prompt": reflect_messages(row["prompt"], row["original"],
                                                                          row["feedback"]),
         "completion": [{"role": "assistant", "content": row["reflection"]}]}
        for row in rows
        if fixed(row)
    ]
    return redos + reflections


def write_set(out: Path, name: str, records: list[dict[str, Any]]) -> None:
    """NAME.jsonl, NAME.parquet and the dataset folder NAME/. The folder is built beside its place and renamed in;
    the manifest, written after every set, is what says the export is whole."""
    atomic_write_jsonl(out / f"{name}.jsonl", records, ensure_ascii=False)
    # Column by column, so that an empty set still has its columns (from_list([]) makes a table without any).
    features = FEATURES[name]
    dataset = Dataset.from_dict({key: [r[key] for r in records] for key in features}, features=features)
    buffer = io.BytesIO()
    dataset.to_parquet(buffer)
    atomic_write_bytes(out / f"{name}.parquet", buffer.getvalue())
    partial = out / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    dataset.save_to_disk(str(partial))
    shutil.rmtree(out / name, ignore_errors=True)
    partial.rename(out / name)


def run_export(config: Config, run: RunDir) -> dict[str, Any]:
    out = run.root / "export"
    manifest = out / "manifest.json"
    if rank() != 0:
        return {}
    check_harvest(run.harvest)
    inputs = {"harvest": harvest_id(run.harvest)}
    if manifest.is_file():
        changed = changed_inputs(read_json(manifest).get("inputs"), inputs)
        if not changed:
            print0(f"export: already complete ({manifest}); delete {out} to export again")
            return read_json(manifest)
        print0(f"export: {out} was made from another {' and '.join(changed)}; exporting again")
    rows = load_shards(run.harvest)
    sets = {"dpo": dpo_pairs(rows), "sft": sft_rows(rows)}
    atomic_write_text(out / "config.yaml", config_to_yaml(config))
    for name, records in sets.items():
        write_set(out, name, records)
    sft_kinds = {kind: sum(r["kind"] == kind for r in sets["sft"]) for kind in ("redo", "reflection")}
    result = {"rows": len(rows), "pairs": len(sets["dpo"]), "sft": sft_kinds,
              "sets": {name: {"rows": len(records), "jsonl": f"{name}.jsonl", "parquet": f"{name}.parquet",
                              "dataset": f"{name}/"} for name, records in sets.items()},
              "inputs": inputs}
    atomic_write_json(manifest, result)
    print0(f"export: {len(sets['dpo'])} DPO pairs (redo right, original wrong) and {len(sets['sft'])} SFT rows "
           f"({sft_kinds['redo']} correct redos, {sft_kinds['reflection']} reflections that fixed the attempt) of "
           f"{len(rows)} rows -> {out}/{{dpo,sft}}{{.jsonl,.parquet,/}}")
    return result
