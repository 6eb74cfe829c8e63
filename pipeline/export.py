"""`redumix export`: preference pairs for DPO from the harvest, where the reflection turned a wrong answer right.

Each pair is conversational, in the format TRL's DPOTrainer reads directly, so the model's own chat template
renders it: prompt = [user: x], chosen = [assistant: y (the redo, correct)], rejected = [assistant: y1 (the
original, wrong)]. Writes RUN_DIR/export/dpo.jsonl (one JSON object a line, with the row id) and the resolved
config.yaml, then RUN_DIR/export/manifest.json last; a complete export is skipped.
"""

from __future__ import annotations

import json
from typing import Any

from redumix.data.prompts import attempt_messages
from redumix.data.shards import load_shards
from redumix.pipeline.config import Config
from redumix.pipeline.harvest import check_harvest
from redumix.pipeline.lineage import changed_inputs, harvest_id
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import RunDir, atomic_write_json, atomic_write_text, print0, rank, read_json


def dpo_pairs(rows: Any) -> list[dict[str, Any]]:
    """Rows whose redo is correct and whose original is wrong (unknown verdicts never qualify) -> DPO pairs."""
    pairs = []
    for row in rows:
        if row["redo_correct"] is True and row["original_correct"] is False:
            pairs.append({
                "id": row["id"],
                "prompt": attempt_messages(row["prompt"]),
                "chosen": [{"role": "assistant", "content": row["redo"]}],
                "rejected": [{"role": "assistant", "content": row["original"]}],
            })
    return pairs


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
    pairs = dpo_pairs(rows)
    atomic_write_text(out / "config.yaml", config_to_yaml(config))
    atomic_write_text(out / "dpo.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    result = {"rows": len(rows), "pairs": len(pairs), "file": "dpo.jsonl", "inputs": inputs}
    atomic_write_json(manifest, result)
    print0(f"export: {len(pairs)} DPO pairs (redo right, original wrong) of {len(rows)} rows -> {out / 'dpo.jsonl'}")
    return result
