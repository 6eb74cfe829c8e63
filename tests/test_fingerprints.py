"""Fingerprints hash a canonical record of what changes the outputs, and old run folders resume through the one
migration (common/fingerprints.py; docs/robustness.md, "Fingerprints and old run folders").

The markers of version 0 are written here as redumix wrote them before records had a version (`v0_settings`,
frozen, and pinned by the hashes the bundled recipes had then), so the tests resume real old folders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from redumix.common.fingerprints import RECORD_VERSION, build_record_v0, harvest_record_v0, v0_hash
from redumix.data.shards import encode_shard, read_shard, shard_paths
from redumix.data.tasks import make_task
from redumix.embedded.build import build_config_text, build_record, built_with, stored_build_record
from redumix.pipeline.config import load_config
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.harvest_folder import harvest_fingerprint, harvest_record, read_marker
from redumix.pipeline.records import read_records, records_for, records_path
from redumix.pipeline.run import RunDir

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["harvest.n=8", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=6",
         "sampling.temperature=1.0", "redumix.reflection_max_tokens=6", "redumix.topk=8"]

# --- version 0, as it was written ----------------------------------------------------------------------------------

_EMBEDDED_V0 = ("steps", "batch_rows", "seq_len", "vocab_size", "hidden_size", "layers", "heads", "intermediate_size",
                "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "bf16", "threads", "checkpoint_steps")
_CORPUS_V0 = ("mix_solution", "mix_reflection", "mix_critique", "mix_refine", "mix_longhand", "slip_rate",
              "wrong_attempt_rate", "noisy_feedback_rate", "check_span_rate")
_TAIL_V0 = ("eval_n", "eval_reflection", "eval_batch_size", "shipped")
_ARITH_V0 = ("steps_min", "steps_max", "start_max", "operand_max", "factor_max", "mul_value_max")


def _pick(section, names) -> dict:
    return {name: getattr(section, name) for name in names}


def v0_task(config) -> dict:
    flat = {"name": config.task.name, "path": config.task.gsm8k.path, "prompt_suffix": config.task.prompt_suffix,
            **_pick(config.task.arith, _ARITH_V0)}
    if config.task.name not in ("arith", "gsm8k"):
        flat[config.task.name] = dataclasses.asdict(getattr(config.task, config.task.name))
    return flat


def v0_base(config) -> dict:
    e = config.embedded
    return {**_pick(e, _EMBEDDED_V0[:13]), **_pick(e, _EMBEDDED_V0[13:]), **_pick(e.corpus, _CORPUS_V0),
            **_pick(e, _TAIL_V0)}


def v0_settings(config, task) -> dict:
    """pipeline/harvest_folder.py's `harvest_settings` as it was until record version 1."""
    embedded = config.model.path == "embedded"
    model = _pick(config.model, ("path", "trust_remote_code", "dtype", "device"))
    redumix = _pick(config.redumix, ("lam", "topk", "feedback", "feedback_file", "reflection_max_tokens",
                                     "critique_max_tokens"))
    redumix.update({k: v for k, v in [("instruction", config.redumix.instruction),
                                      ("redo_temperature", config.redumix.redo_temperature)]
                    if v not in ("redo", None)})
    model["path"] = "base" if embedded else model["path"]  # the embedded model's name then
    return {"task_name": task.name, "seed": config.seed, "model": model,
            "base": v0_base(config) if embedded else None, "task": v0_task(config),
            "sampling": _pick(config.sampling, ("temperature", "top_p", "top_k", "max_new_tokens")),
            "redumix": redumix,
            "harvest": {"n": config.harvest.n, "split": config.harvest.split, "shard_rows": config.harvest.shard_rows,
                        **({"skip": config.harvest.skip} if config.harvest.skip else {})}}


def v0_build_config(config) -> str:
    """embedded/build.py's `build_settings` as it was until record version 1."""
    base = {k: v for k, v in v0_base(config).items() if k not in ("threads", "checkpoint_steps", "eval_batch_size",
                                                                  "shipped")}
    base = {**{k: base[k] for k in _EMBEDDED_V0[:13]}, **{k: base[k] for k in _CORPUS_V0},
            **{k: base[k] for k in ("eval_n", "eval_reflection")}}
    return yaml.safe_dump({"seed": config.seed, "base": base, "task": v0_task(config)}, sort_keys=False)


# --- records --------------------------------------------------------------------------------------------------------


def test_the_bundled_recipes_translate_from_version_0_to_their_record():
    """Every bundled recipe's version 0 settings (pinned where their hash was pinned before) read into exactly the
    record the code builds now; the version 1 fingerprints are pinned in turn, so that a refactor that moves a key
    moves no fingerprint."""
    old = {"tiny": "75a697811176a160", "smollm2-135m-constraints": "ca9b63980cc664c1"}
    new = {"tiny": "a21b0f1bd6792b36", "smollm2-135m-constraints": "27487c73ab031bff"}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        config = load_config(path)
        task = make_task(config.task, config.seed)
        settings = v0_settings(config, task)
        assert harvest_record_v0(settings) == harvest_record(config, task), path.stem
        if path.stem in old:
            assert v0_hash(settings) == old[path.stem], path.stem
            assert harvest_fingerprint(config, task) == new[path.stem], path.stem


def test_every_setting_of_the_harvest_sections_is_in_the_record_or_named_as_not_deciding_the_rows():
    """A new setting has to be placed: either it changes the record (and the rows' fingerprint), or it is one of
    these, which change speed or float rounding only."""
    not_deciding = {"model": {"trust_remote_code", "device", "compile_decoding"}, "harvest": {"batch_size", "engine"},
                    "embedded": {"threads", "checkpoint_steps", "eval_batch_size", "shipped"}}
    config = load_config("tiny", ["redumix.feedback=human", "redumix.feedback_file=f.jsonl"])
    task = make_task(config.task, config.seed)
    record = harvest_record(config, task)
    for section in ("model", "embedded", "sampling", "redumix", "harvest"):
        holders = [(section, getattr(config, section))]
        if section == "embedded":
            holders.append(("embedded.corpus", config.embedded.corpus))
        for label, holder in holders:
            for field in dataclasses.fields(holder):
                if field.name == "corpus" or (label == "model" and field.name == "path"):
                    continue  # the corpus is its own holder; the path is checked below
                original = getattr(holder, field.name)
                setattr(holder, field.name, "<changed>")
                differs = harvest_record(config, task) != record
                setattr(holder, field.name, original)
                assert differs == (field.name not in not_deciding.get(label, set())), f"{label}.{field.name}"
    elsewhere = load_config("tiny", ["model.path=/models/x"])
    assert harvest_record(elsewhere, task)["embedded"] is None
    assert record["embedded"] == build_record(config.embedded, config.task, config.seed)


def test_a_version_0_build_config_matches_its_settings_and_the_shipped_one_was_migrated(tmp_path):
    config = load_config("tiny")
    text = v0_build_config(config)
    # The shipped build's file before its migration to version 1, byte for byte.
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "ec1f5aa69af7c31cf2a3572953360d7ebfbe42a3e225ca87897dc0b491d689f0")
    (tmp_path / "build_config.yaml").write_text(text)
    assert build_record_v0(yaml.safe_load(text)) == build_record(config.embedded, config.task, config.seed)
    assert built_with(tmp_path, config.embedded, config.task, config.seed)
    assert not built_with(tmp_path, config.embedded, config.task, 1)
    shipped = ROOT / "models" / "tiny-base" / "build_config.yaml"
    assert shipped.read_text() == build_config_text(config.embedded, config.task, config.seed)
    assert yaml.safe_load(shipped.read_text())["version"] == RECORD_VERSION
    (tmp_path / "build_config.yaml").write_text("seed: 0\nbase: 3\n")  # neither version
    assert stored_build_record(tmp_path) is None


def test_a_version_0_partial_build_resumes_and_its_file_is_rewritten(tmp_path, monkeypatch, capsys):
    from redumix.embedded import pretrain
    from redumix.pipeline.embedded_stage import embedded_is_complete, run_embedded
    from tests.test_embedded import RESUMABLE

    config = load_config("recipes/tiny.yaml", RESUMABLE)
    run = RunDir(tmp_path)
    real_lr_at = pretrain.lr_at

    def crash_at_step_5(step, settings):
        if step == 5:
            raise KeyboardInterrupt("killed")
        return real_lr_at(step, settings)

    monkeypatch.setattr(pretrain, "lr_at", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        run_embedded(config, run)
    monkeypatch.setattr(pretrain, "lr_at", real_lr_at)
    partial = run.root / ".embedded.partial"
    (partial / "build_config.yaml").write_text(v0_build_config(config))  # as the older redumix left it
    capsys.readouterr()
    run_embedded(config, run)
    assert "resuming from step 4" in capsys.readouterr().out and embedded_is_complete(run)
    assert (run.embedded / "build_config.yaml").read_text() == build_config_text(config.embedded, config.task,
                                                                                 config.seed)


# --- an old harvest folder resumes ----------------------------------------------------------------------------------


def harvest(run_dir: Path, model_dir: Path, *extra: str) -> list[dict]:
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={model_dir}", *SMALL, *extra])
    run_harvest(config, RunDir(run_dir))
    return [row for path in shard_paths(run_dir / "harvest") for row in read_shard(path).to_pylist()]


def same_rows(rows: list[dict]) -> list[dict]:
    """Rows without their timing and their fingerprint (an old folder's first rows keep their version 0 one)."""
    out = []
    for row in rows:
        meta = json.loads(row["meta"])
        meta.pop("seconds"), meta.pop("fingerprint")
        out.append({**row, "meta": meta})
    return out


def make_version_0(folder: Path, model_dir: Path) -> str:
    """Turn a harvest written now into the one redumix wrote before record version 1: fingerprint.json, every row's
    `meta.fingerprint` and the manifest's fingerprint and checksums in version 0. Returns that fingerprint."""
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={model_dir}", *SMALL])
    settings = v0_settings(config, make_task(config.task, config.seed))
    old = v0_hash(settings)
    out = folder / "harvest"
    for path in shard_paths(out):
        rows = read_shard(path).to_pylist()
        for row in rows:
            row["meta"] = {**json.loads(row["meta"]), "fingerprint": old}
        path.write_bytes(encode_shard(rows))
    (out / "fingerprint.json").write_text(json.dumps({"fingerprint": old, "settings": settings}, indent=2))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["fingerprint"] = old
    manifest["shard_files"] = {p.name: {"rows": 2, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                               for p in shard_paths(out)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return old


def test_an_unfinished_version_0_harvest_resumes_keeping_its_shards(tmp_path, tiny_model_dir, capsys):
    expected = same_rows(harvest(tmp_path / "whole", tiny_model_dir))
    shutil.copytree(tmp_path / "whole", tmp_path / "old")
    out = tmp_path / "old" / "harvest"
    old = make_version_0(tmp_path / "old", tiny_model_dir)
    (out / "manifest.json").unlink()  # as if the old run had died before it finished
    (out / "shard-00002.arrow").unlink()
    kept = {p.name: p.read_bytes() for p in shard_paths(out)}
    capsys.readouterr()
    assert same_rows(harvest(tmp_path / "old", tiny_model_dir)) == expected
    said = capsys.readouterr().out
    assert "rewritten in record version 1" in said and "resuming, 3 of 4 shards" in said
    assert all((out / name).read_bytes() == data for name, data in kept.items())  # taken in, not redone
    marker = json.loads((out / "fingerprint.json").read_text())
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL])
    assert marker["version"] == RECORD_VERSION and marker["migrated_from"] == [old]
    assert marker["record"] == harvest_record(config, make_task(config.task, config.seed))
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == marker["fingerprint"]


def test_a_finished_version_0_harvest_stays_complete_and_another_config_is_refused_untouched(tmp_path,
                                                                                             tiny_model_dir, capsys):
    harvest(tmp_path, tiny_model_dir)
    out = tmp_path / "harvest"
    make_version_0(tmp_path, tiny_model_dir)
    marker, manifest = (out / "fingerprint.json").read_bytes(), (out / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match=r"different config \(what differs: redumix\.lam: 0\.5 -> 0\.7\)"):
        harvest(tmp_path, tiny_model_dir, "redumix.lam=0.7")
    assert (out / "fingerprint.json").read_bytes() == marker  # a refusal migrates nothing
    capsys.readouterr()
    harvest(tmp_path, tiny_model_dir)
    assert "complete" in capsys.readouterr().out
    assert (out / "manifest.json").read_bytes() == manifest  # so train's and export's lineage of it holds
    assert read_marker(out).old is False and json.loads((out / "fingerprint.json").read_text())["version"] == 1
    migrated = (out / "fingerprint.json").read_bytes()
    harvest(tmp_path, tiny_model_dir)
    assert (out / "fingerprint.json").read_bytes() == migrated


# --- old eval records -----------------------------------------------------------------------------------------------


def test_eval_records_written_with_the_task_fingerprint_are_resumed_not_redone(tmp_path, tiny_model_dir):
    overrides = [f"model.path={tiny_model_dir}", "sampling.max_new_tokens=6", "eval.n=4", "eval.n_other=2",
                 "eval.batch_size=2", "eval.decoders=[greedy]", "eval.checkpoints=[base]"]
    config = load_config(ROOT / "recipes" / "tiny.yaml", overrides)
    run = RunDir(tmp_path)
    run_eval(config, run)
    path = records_path(run.eval / "generations", "base", "greedy")
    records = read_records(path)
    identity = records[0]["model"]
    old = [{**r, "model": identity + ":0123456789ab"} for r in records]  # WEIGHTS:DECODER:TASK, as before
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    before = path.read_bytes()
    report = json.loads((run.eval / "report.json").read_text())
    (run.eval / "report.json").unlink()
    run_eval(config, run)
    assert path.read_bytes() == before  # nothing decoded again
    assert json.loads((run.eval / "report.json").read_text())["rows"] == report["rows"]

    # A record whose problem is not the example's (another task's settings) is redone; the file is then written in
    # the current form.
    old[1]["prompt"] = "another problem"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    (run.eval / "report.json").unlink()
    run_eval(config, run)
    again = read_records(path)
    assert [r["model"] for r in again] == [identity] * 4 and again[1]["prompt"] == records[1]["prompt"]
    assert [r["seconds"] for r in again[:1] + again[2:]] == [r["seconds"] for r in records[:1] + records[2:]]


def test_records_for_reads_both_forms_of_an_identity(tmp_path):
    from redumix.data.task import Example

    example = Example(id="a", task="arith", prompt="p", reference="1")
    path = tmp_path / "r.jsonl"
    lines = [{"id": "a", "model": "w:d:0123456789ab:vllm", "prompt": "p", "reference": "1"}]
    path.write_text(json.dumps(lines[0]) + "\n")
    assert records_for(path, "w:d:vllm", [example])["a"]["model"] == "w:d:vllm"
    assert records_for(path, "w:d", [example]) == {}  # the other engine's
    path.write_text(json.dumps({**lines[0], "model": "w:d:vllm", "reference": "2"}) + "\n")
    assert records_for(path, "w:d:vllm", [example]) == {}  # another problem's answer
