"""Fingerprints hash a canonical record of what changes the outputs, and old run folders resume through the one
migration (common/fingerprints.py; docs/robustness.md, "Fingerprints and old run folders").

The markers of version 0 are written here as redumix wrote them before records had a version (`v0_settings`,
frozen, and pinned by the hashes the bundled recipes had then), so the tests resume real old folders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
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


_ADDED_SINCE_V0 = {"constraints": ("holdout_requests",)}  # a task's keys that version 0 files never held


def v0_section(config, name: str) -> dict:
    """`asdict` of a task's section as version 0 wrote it: without the keys added since."""
    section = dataclasses.asdict(getattr(config.task, name))
    return {key: value for key, value in section.items() if key not in _ADDED_SINCE_V0.get(name, ())}


def v0_task(config) -> dict:
    flat = {"name": config.task.name, "path": config.task.gsm8k.path, "prompt_suffix": config.task.prompt_suffix,
            **_pick(config.task.arith, _ARITH_V0)}
    if config.task.name not in ("arith", "gsm8k"):
        flat[config.task.name] = v0_section(config, config.task.name)
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
        if config.harvest.attempts != 1:  # harvest.attempts came after version 0, which has no way to say it
            assert harvest_record(config, task)["harvest"]["attempts"] == config.harvest.attempts
            continue
        settings = v0_settings(config, task)
        assert harvest_record_v0(settings) == harvest_record(config, task), path.stem
        if path.stem in old:
            assert v0_hash(settings) == old[path.stem], path.stem
            assert harvest_fingerprint(config, task) == new[path.stem], path.stem


def test_every_setting_of_the_harvest_sections_is_in_the_record_or_named_as_not_deciding_the_rows():
    """A new setting has to be placed: either it changes the record (and the rows' fingerprint), or it is one of
    these, which change speed or float rounding only."""
    not_deciding = {"model": {"trust_remote_code", "device", "compile_decoding", "static_cache"},
                    "harvest": {"batch_size", "engine"},
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


# --- old ladder and rft folders -------------------------------------------------------------------------------------

LADDER_FORMS = ("2026-11-26", "39ac477", "f6d9632")  # before the ladder had an engine; ladder.engine; `engine`


def v0_task_asdict(config, with_code: bool) -> dict:
    """`asdict(config.task)` as it was: name, prompt_suffix and every task's section of the time (code's from
    f6d9632 on)."""
    task = {"name": config.task.name, "prompt_suffix": config.task.prompt_suffix,
            **{name: v0_section(config, name) for name in ("arith", "gsm8k", "constraints")}}
    return task | ({"code": v0_section(config, "code")} if with_code else {})


def v0_model_asdict(config) -> dict:
    return _pick(config.model, ("path", "trust_remote_code", "dtype", "device", "compile_decoding"))


def v0_ladder_settings(config, form: str = "39ac477") -> dict:
    """pipeline/ladder.py's `_settings` as it was until record version 1: `asdict` of the sections, the redumix
    section less the redo's keys, and the ladder's levers with the redo's effective temperature and instruction;
    `ladder.engine` among the levers at 39ac477, the top-level `engine` from f6d9632, neither before."""
    from redumix.generate.redumix import redo_policy

    levers = {"lams": list(config.ladder.lams), "self_critique": config.ladder.self_critique,
              **({"engine": config.engine} if form == "39ac477" else {}),
              "redo_temperature": redo_policy(config.redumix, config.sampling).temperature,
              "instruction": config.redumix.instruction}
    redumix = _pick(config.redumix, ("lam", "topk", "feedback", "feedback_file", "reflection_max_tokens",
                                     "critique_max_tokens"))
    settings = {"seed": config.seed, "model": v0_model_asdict(config),
                "task": v0_task_asdict(config, with_code=form == "f6d9632"),
                "sampling": dataclasses.asdict(config.sampling), "redumix": redumix, "ladder": levers}
    return settings | ({"engine": config.engine} if form == "f6d9632" else {})


def v0_rft_settings(config) -> dict:
    """pipeline/rft.py's `_settings` as it was until record version 1 (at 39ac477)."""
    from redumix.pipeline.studies.rft import rft_policy

    return {"seed": config.seed, "model": v0_model_asdict(config), "task": v0_task_asdict(config, with_code=False),
            "policy": dataclasses.asdict(rft_policy(config))}


def _changed(value):
    """Another value of the same type, one the config's checks would accept."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return (value + 0.3) / 2
    if isinstance(value, list):
        return [*value, 0.25]
    return 0.35 if value is None else f"{value}-changed"


def _deciding(record_of, config, holders) -> dict[str, bool]:
    """Per `label.field` of the holders: whether changing it alone changes the record."""
    record, found = record_of(config), {}
    for label, holder in holders:
        for field in dataclasses.fields(holder):
            original = getattr(holder, field.name)
            setattr(holder, field.name, _changed(original))
            found[f"{label}.{field.name}"] = record_of(config) != record
            setattr(holder, field.name, original)
    return found


def test_the_bundled_recipes_ladder_and_rft_settings_translate_from_version_0():
    from redumix.common.fingerprints import ladder_record_v0, rft_record_v0
    from redumix.pipeline.studies.ladder import ladder_record
    from redumix.pipeline.studies.rft import rft_record

    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        config = load_config(path)
        with_code = config.task.name == "code"  # a code ladder was written with the code section alone
        for form in LADDER_FORMS[2:] if with_code else LADDER_FORMS:
            assert ladder_record_v0(v0_ladder_settings(config, form)) == ladder_record(config), (path.stem, form)
        if not with_code:
            assert rft_record_v0(v0_rft_settings(config)) == rft_record(config), path.stem


def test_every_setting_the_ladder_and_rft_read_is_in_their_record_or_named_as_not_deciding_them():
    from redumix.pipeline.studies.ladder import ladder_record
    from redumix.pipeline.studies.rft import rft_record

    config = load_config("tiny", ["ladder.self_critique=true"])
    holders = [(name, getattr(config, name)) for name in ("model", "sampling", "redumix", "ladder")]
    speed = {"model.trust_remote_code", "model.device", "model.compile_decoding", "model.static_cache"}
    ladder = _deciding(ladder_record, config, holders)
    assert {key for key, moves in ladder.items() if not moves} == speed | {
        "redumix.topk", "redumix.feedback", "redumix.feedback_file", "ladder.n", "ladder.skip", "ladder.batch_size",
        "ladder.resamples", "ladder.records"}
    config.ladder.self_critique = False  # then λ and the critique's length decide no record
    assert not any(_deciding(ladder_record, config, holders)[key] for key in ("redumix.lam",
                                                                              "redumix.critique_max_tokens"))
    for key, value in (("engine", "vllm"), ("seed", 7)):
        assert ladder_record(dataclasses.replace(config, **{key: value})) != ladder_record(config), key
    assert ladder_record(load_config("tiny", ["task.gsm8k.path=/x"])) == ladder_record(load_config("tiny"))

    rft = _deciding(rft_record, config, [*holders[:3], ("evidence", config.evidence)])
    assert {key for key, moves in rft.items() if moves} == {
        "model.path", "model.dtype", "sampling.temperature", "sampling.top_p", "sampling.top_k",
        "sampling.max_new_tokens", "redumix.redo_temperature", "evidence.rft_temperature"}
    config.evidence.rft_temperature = 1.0  # then the samples' temperature is its
    assert not _deciding(rft_record, config, holders[1:3])["redumix.redo_temperature"]


def _graded(text: str, correct: bool) -> dict:
    return {"text": text, "answer": text, "correct": correct, "tokens": 3}


@pytest.mark.parametrize("form", LADDER_FORMS)
def test_an_old_ladder_folder_resumes_without_decoding_and_its_settings_are_rewritten(tmp_path, monkeypatch, capsys,
                                                                                     form):
    import redumix.pipeline.studies.ladder as ladder
    from redumix.common.fingerprints import fingerprint
    from redumix.pipeline.studies.ladder import arm_names, ladder_record, run_ladder

    small = ["ladder.n=4", "ladder.batch_size=2"]
    config = load_config("tiny", small)
    examples = make_task(config.task, config.seed).examples("train", 4)
    out = tmp_path / "ladder"
    out.mkdir()
    records = [{"id": e.id, "attempt": _graded("1", k % 2 == 0), "feedback": "f", "reflection": "c",
                "critique": "r", "self_reflection": "c",
                "arms": {name: _graded(str(k), k > 1) for name in arm_names(config)}}
               for k, e in enumerate(examples)]
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    old = json.dumps(v0_ladder_settings(config, form), indent=2)
    (out / "settings.json").write_text(old)

    def no_engine(*args, **kwargs):
        raise AssertionError("the old ladder folder was decoded again")

    monkeypatch.setattr(ladder, "check_engine", no_engine)
    monkeypatch.setattr(ladder, "open_engine", no_engine)
    for changed, said in ((["ladder.lams=[0.0]"], "ladder.lams: [0.5, 0.0] -> [0.0]"),
                          (["redumix.redo_temperature=0.7"], "redumix.redo_temperature: 0.0 -> 0.7"),
                          (["engine=vllm"], 'engine: "hf" -> "vllm"')):
        with pytest.raises(ValueError, match=re.escape(said)):
            run_ladder(load_config("tiny", [*small, *changed]), RunDir(tmp_path))
        assert (out / "settings.json").read_text() == old  # a refusal writes nothing
    assert not (out / "summary.json").exists()

    capsys.readouterr()
    run_ladder(config, RunDir(tmp_path))
    said = capsys.readouterr().out
    assert "rewritten in record version 1" in said and "resuming, 4 of 4 problems" in said
    record = ladder_record(config)
    assert json.loads((out / "settings.json").read_text()) == {"version": RECORD_VERSION,
                                                                "fingerprint": fingerprint(record), "record": record}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 4 and summary["attempt_correct"] == 2 and summary["settings"] == record
    migrated = (out / "settings.json").read_bytes()
    run_ladder(config, RunDir(tmp_path))
    assert (out / "settings.json").read_bytes() == migrated
    with pytest.raises(ValueError, match=re.escape("ladder.self_critique: true -> false")):
        run_ladder(load_config("tiny", [*small, "ladder.self_critique=false"]), RunDir(tmp_path))


def test_old_rft_samples_are_taken_in_without_decoding_and_their_settings_rewritten(tmp_path, monkeypatch, capsys):
    import redumix.pipeline.studies.rft as rft
    from redumix.common.fingerprints import fingerprint
    from redumix.pipeline.studies.rft import draw_samples, rft_record

    overrides = ["harvest.n=3", "evidence.rft_samples=2", "redumix.redo_temperature=1.0"]
    config = load_config("tiny", overrides)
    examples = make_task(config.task, config.seed).examples("train", 3)
    rows = [{"id": e.id, "prompt": e.prompt} for e in examples]
    samples = {e.id: {"resample": _graded("1", True), "resample2": _graded("2", False)} for e in examples}
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"id": i, "samples": s}) + "\n"
                                                    for i, s in samples.items()))
    old = json.dumps(v0_rft_settings(config))
    (tmp_path / "settings.json").write_text(old)

    def no_engine(*args, **kwargs):
        raise AssertionError("the old samples were drawn again")

    monkeypatch.setattr(rft, "open_engine", no_engine)
    with pytest.raises(ValueError, match=re.escape("policy.temperature: 1.0 -> 0.7")):
        draw_samples(load_config("tiny", [*overrides, "evidence.rft_temperature=0.7"]), tmp_path, rows, tmp_path)
    assert (tmp_path / "settings.json").read_text() == old
    capsys.readouterr()
    assert draw_samples(config, tmp_path, rows, tmp_path) == samples
    assert "rewritten in record version 1" in capsys.readouterr().out
    record = rft_record(config)
    assert json.loads((tmp_path / "settings.json").read_text()) == {
        "version": RECORD_VERSION, "fingerprint": fingerprint(record), "record": record}
    with pytest.raises(ValueError, match=re.escape('model.dtype: "float32" -> "bfloat16"')):
        draw_samples(load_config("tiny", [*overrides, "model.dtype=bfloat16"]), tmp_path, rows, tmp_path)


def test_a_settings_file_in_no_known_form_is_refused(tmp_path):
    from redumix.common.fingerprints import ladder_record_v0
    from redumix.pipeline.harvest_folder import claim_settings
    from redumix.pipeline.studies.ladder import ladder_record

    path = tmp_path / "settings.json"
    for text in ('{"seed": 0}', '{"version": 2, "record": {}}'):
        path.write_text(text)
        with pytest.raises(ValueError, match=r"cannot read; delete it"):
            claim_settings(path, ladder_record(load_config("tiny")), "ladder records", "delete it", ladder_record_v0)
        assert path.read_text() == text


def test_a_model_saved_again_by_another_transformers_release_is_the_same_model(tmp_path, tiny_model_dir):
    from redumix.pipeline.lineage import model_id

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1"  # what `make vllm`'s older pin writes, say
    (copy / "config.json").write_text(json.dumps(config, indent=3))
    assert model_id(copy) == model_id(tiny_model_dir)
    config["rms_norm_eps"] = 0.5  # a setting of the model is the model
    (copy / "config.json").write_text(json.dumps(config))
    assert model_id(copy) != model_id(tiny_model_dir)
