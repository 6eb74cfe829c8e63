"""`engine=vllm`: every stage on vLLM, the same rows as the Hugging Face harvest (float rounding apart), a
manifest that names the engine, and `train` reading the shards unchanged; `engine=vllm`: the plain decoders'
records equal Hugging Face's; `NPROC=2` through torchrun (slow), one engine per rank or one engine over both ranks,
gives one process's rows. The refusal of a model vLLM cannot run is checked with or without vLLM installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from redumix.pipeline.config import load_config
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["harvest.n=4", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=8",
         "sampling.temperature=1.0", "redumix.reflection_max_tokens=8", "redumix.topk=8", "vllm.kv_cache_gib=1",
         "vllm.max_num_seqs=8"]


def test_vllm_refuses_the_embedded_model_naming_the_key(tmp_path):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [*SMALL, "engine=vllm"])
    with pytest.raises(ValueError, match=r"engine=vllm") as error:
        run_harvest(config, RunDir(tmp_path))
    # without vLLM: how to install it; with it: the embedded model's head_dim 24, which its CPU kernel lacks
    assert "make vllm" in str(error.value) or "head_dim 24" in str(error.value)
    assert not (tmp_path / "harvest" / "manifest.json").exists()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random head_dim-64 Llama over the embedded model's tokenizer and chat template."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment; `make vllm` adds it")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=768, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    folder = tmp_path_factory.mktemp("llama64-chat")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "models" / "tiny-base" / name, folder / name)
    return folder


def _harvest(run_dir: Path, model_dir: Path, *extra: str) -> tuple[list[dict], dict]:
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={model_dir}", *SMALL, *extra])
    run_harvest(config, RunDir(run_dir))
    return _rows(run_dir)


def _rows(run_dir: Path) -> tuple[list[dict], dict]:
    """A finished harvest's rows (their timing and engine details dropped) and its manifest."""
    from redumix.data.shards import iter_rows, shard_paths

    rows = []
    for row in iter_rows(shard_paths(run_dir / "harvest")):
        meta = json.loads(row["meta"])
        meta.pop("seconds")
        meta.pop("engine", None)
        rows.append({**row, "meta": meta})
    return rows, json.loads((run_dir / "harvest" / "manifest.json").read_text())


def test_vllm_harvest_equals_the_hf_harvest_and_trains(tmp_path, model_dir):
    from tests.conftest import rows_differ

    hf_rows, hf_manifest = _harvest(tmp_path / "hf", model_dir)
    vllm_rows, manifest = _harvest(tmp_path / "vllm", model_dir, "engine=vllm")
    assert rows_differ(vllm_rows, hf_rows) == []
    assert len(vllm_rows) == 4 and all(len(r["redo_token_ids"]) > 0 for r in vllm_rows)
    assert hf_manifest["engine"] == "hf" and hf_manifest["vllm_version"] is None
    assert manifest["engine"] == "vllm" and manifest["retried_pairs"] == 0
    assert manifest["vllm_version"] == "0.32.0"

    from redumix.pipeline.train import run_train

    run = RunDir(tmp_path / "vllm")
    settings = [f"model.path={model_dir}", "train.batch_size=2", "train.max_steps=2", "train.adapter=full",
                "train.heldout_fraction=0.25", "train.logging_steps=1", "train.warmup_ratio=0.0"]
    result = run_train(load_config(ROOT / "recipes" / "tiny.yaml", settings), run)
    assert result["steps"] == 2
    assert (run.train / "merged" / "config.json").is_file()


def test_eval_engine_vllm_decodes_the_plain_decoders_as_hf_does(tmp_path, model_dir, capsys):
    from redumix.pipeline.eval import run_eval
    from redumix.pipeline.records import read_records, records_path

    settings = [f"model.path={model_dir}", "eval.n=4", "eval.n_other=4", "eval.batch_size=4",
                "eval.checkpoints=[base]", "eval.decoders=[greedy, sample, vote@2]", "sampling.max_new_tokens=8",
                "vllm.kv_cache_gib=1", "vllm.max_num_seqs=8"]
    records = {}
    for engine in ("hf", "vllm"):
        run_eval(load_config(ROOT / "recipes" / "tiny.yaml", [*settings, f"engine={engine}"]),
                 RunDir(tmp_path / engine))
        records[engine] = {
            name: [{k: v for k, v in r.items() if k != "seconds"}
                   for r in read_records(records_path(tmp_path / engine / "eval" / "generations", "base", name))]
            for name in ("greedy", "sample", "vote@2")
        }
    assert "vote@2 needs the cache token by token, so it runs on the 'hf' engine" in capsys.readouterr().out
    for name in ("greedy", "sample", "vote@2"):
        vllm, hf = records["vllm"][name], records["hf"][name]
        assert len(vllm) == 4
        # The engine that decoded a record is part of its identity, so one engine's records never resume as the
        # other's (vote@2 ran on Hugging Face in both); the rest of each record is the same.
        suffix = "" if name == "vote@2" else ":vllm"
        assert [r["model"] for r in vllm] == [r["model"] + suffix for r in hf], name
        assert [r | {"model": None} for r in vllm] == [r | {"model": None} for r in hf], name
    assert [r["output"] for r in records["vllm"]["sample"]] != [r["output"] for r in records["vllm"]["greedy"]]


def test_the_bases_off_task_answers_on_vllm_are_the_hf_answers(model_dir):
    """The evidence stage's off-task drift reads the base's greedy answers to the general set's questions; with
    engine=vllm they are decoded there, the same ids as on Hugging Face."""
    from redumix.pipeline.studies.drift import greedy_answers

    questions = ["What is 2 + 3?", "Name a colour.", "Count to four.", "Why is the sky blue?", "Say hello."]
    answers = {engine: greedy_answers(load_config(ROOT / "recipes" / "tiny.yaml", [
        f"engine={engine}", "sampling.max_new_tokens=8", "vllm.kv_cache_gib=1", "vllm.max_num_seqs=8"]),
        model_dir, questions) for engine in ("hf", "vllm")}
    assert len(answers["vllm"]) == 5 and all(answers["vllm"])
    assert answers["vllm"] == answers["hf"]


def _torchrun_harvest(run_dir: Path, model_dir: Path, *extra: str) -> None:
    """`make harvest NPROC=2`'s command: two ranks through torchrun, each with its own in-process engine."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
               "-m", "redumix.pipeline.cli", "harvest", "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(run_dir), f"model.path={model_dir}", *SMALL, "engine=vllm", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.slow
def test_two_ranks_harvest_disjoint_shards_whose_union_is_one_process_run(tmp_path, model_dir):
    """Three shards on two ranks (rank 0 owns shards 0 and 2, rank 1 shard 1), each rank with its own engine; then a
    resume where only rank 1 has work left, which rank 0 must not leave waiting in the engines' collective build;
    then one engine across both ranks (vllm.tensor_parallel_size=2), whose first rank writes."""
    from tests.conftest import rows_differ

    extra = ["harvest.n=6"]
    one, _ = _harvest(tmp_path / "one", model_dir, "engine=vllm", *extra)
    _torchrun_harvest(tmp_path / "two", model_dir, *extra)
    two, manifest = _rows(tmp_path / "two")
    assert len(one) == 6 and rows_differ(two, one) == []
    assert manifest["engine"] == "vllm" and manifest["retried_pairs"] == 0

    (tmp_path / "two" / "harvest" / manifest_shard(manifest, 1)).unlink()
    _torchrun_harvest(tmp_path / "two", model_dir, *extra)
    assert rows_differ(_rows(tmp_path / "two")[0], one) == []

    _torchrun_harvest(tmp_path / "tp", model_dir, *extra, "vllm.tensor_parallel_size=2")
    assert rows_differ(_rows(tmp_path / "tp")[0], one) == []


def manifest_shard(manifest: dict, k: int) -> str:
    from redumix.data.shards import shard_name

    assert shard_name(k) in manifest["shard_files"]
    return shard_name(k)


def test_tensor_parallel_in_one_process_is_refused_naming_nproc(tmp_path, model_dir):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={model_dir}", *SMALL, "engine=vllm",
                                                          "vllm.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match=r"vllm.tensor_parallel_size=2 needs 2 ranks: run it with NPROC=2"):
        run_harvest(config, RunDir(tmp_path))
    assert not (tmp_path / "harvest" / "manifest.json").exists()


@pytest.mark.slow
def test_two_ranks_eval_on_vllm_gives_one_process_records(tmp_path, model_dir):
    """`make eval NPROC=2 ARGS=engine=vllm`: each rank builds an engine per checkpoint (two in turn here, the
    tuned one a copy of the base) and decodes its share of the examples; rank 0 gathers the records of one process."""
    from redumix.pipeline.eval import run_eval

    settings = [f"model.path={model_dir}", "eval.n=5", "eval.n_other=5", "eval.batch_size=4",
                "eval.checkpoints=[base, tuned]", "eval.decoders=[greedy, sample]", "eval.tuned_decoders=[]",
                "sampling.max_new_tokens=8", "vllm.kv_cache_gib=1", "vllm.max_num_seqs=8", "engine=vllm"]
    for name in ("one", "two"):
        shutil.copytree(model_dir, tmp_path / name / "train" / "merged")
    run_eval(load_config(ROOT / "recipes" / "tiny.yaml", settings), RunDir(tmp_path / "one"))
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
               "-m", "redumix.pipeline.cli", "eval", "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(tmp_path / "two"), *settings]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    files = sorted(p.name for p in (tmp_path / "two" / "eval" / "generations").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one" / "eval" / "generations").iterdir())
    assert len(files) == 4 and not [name for name in files if ".rank" in name]
    for name in files:
        one, two = ([{k: v for k, v in json.loads(line).items() if k != "seconds"}
                     for line in (tmp_path / run / "eval" / "generations" / name).read_text().splitlines()]
                    for run in ("one", "two"))
        assert len(two) == 5 and two == one, name


def test_ranks_that_tensor_parallel_engines_do_not_divide_are_refused(monkeypatch):
    from redumix.generate.vllm_engine import VllmSettings, check_engine_ranks

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert check_engine_ranks(VllmSettings(tensor_parallel_size=2), "harvest.engine") == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"NPROC=3 is not a multiple of vllm.tensor_parallel_size=2"):
        check_engine_ranks(VllmSettings(tensor_parallel_size=2), "harvest.engine")


def test_eval_refuses_a_tensor_parallel_engine(tmp_path, model_dir):
    from redumix.pipeline.eval import run_eval

    settings = [f"model.path={model_dir}", "eval.n=2", "eval.checkpoints=[base]", "eval.decoders=[greedy]",
                "engine=vllm", "vllm.tensor_parallel_size=2"]
    with pytest.raises(ValueError, match=r"engine=vllm with vllm.tensor_parallel_size=2 needs 2 ranks"):
        run_eval(load_config(ROOT / "recipes" / "tiny.yaml", settings), RunDir(tmp_path))


def test_vllm_harvest_decodes_the_recipes_redo_levers_as_hf_does(tmp_path, model_dir):
    """The protocol a recipe freezes (a greedy attempt, the `answer` redo turn, the redo drawn at its own
    temperature) gives the same rows on either engine."""
    from tests.conftest import rows_differ

    levers = ["sampling.temperature=0.0", "redumix.instruction=answer", "redumix.redo_temperature=1.0"]
    hf_rows, _ = _harvest(tmp_path / "hf", model_dir, *levers)
    vllm_rows, _ = _harvest(tmp_path / "vllm", model_dir, "engine=vllm", *levers)
    assert rows_differ(vllm_rows, hf_rows) == []
    greedy_rows, _ = _harvest(tmp_path / "greedy", model_dir, *levers[:2])
    assert [r["original"] for r in greedy_rows] == [r["original"] for r in hf_rows]
    assert any(g["redo"] != r["redo"] for g, r in zip(greedy_rows, hf_rows, strict=True))


def test_the_rft_arms_samples_on_vllm_are_the_hf_samples(tmp_path, model_dir):
    """`evidence.rft_samples` draws on `engine`; either engine gives the same graded samples."""
    from redumix.data.tasks import make_task
    from redumix.pipeline.studies.rft import draw_samples

    settings = [f"model.path={model_dir}", *SMALL, "sampling.temperature=0.0", "redumix.redo_temperature=1.0",
                "evidence.rft_samples=2"]
    samples = {}
    for engine in ("hf", "vllm"):
        config = load_config(ROOT / "recipes" / "tiny.yaml", [*settings, f"engine={engine}"])
        rows = [{"id": e.id, "prompt": e.prompt} for e in make_task(config.task, config.seed).examples("train", 4)]
        samples[engine] = draw_samples(config, model_dir, rows, tmp_path / engine)
    assert samples["vllm"] == samples["hf"]
    assert len(samples["hf"]) == 4 and all(set(s) == {"resample", "resample2"} for s in samples["hf"].values())
    assert any(s["resample"]["text"] != s["resample2"]["text"] for s in samples["hf"].values())


def test_the_ladder_on_vllm_writes_the_hf_ladders_records(tmp_path, model_dir):
    """`engine=vllm`: the same records as the Hugging Face ladder: the attempt, feedback and reflection, the
    redo at each λ from the same two contexts, the self-critique arm and two resamples."""
    from redumix.pipeline.studies.ladder import run_ladder

    settings = [f"model.path={model_dir}", "sampling.max_new_tokens=8", "sampling.temperature=0.0",
                "redumix.redo_temperature=1.0", "redumix.reflection_max_tokens=8", "redumix.critique_max_tokens=8",
                "vllm.kv_cache_gib=1", "vllm.max_num_seqs=8", "ladder.n=4", "ladder.batch_size=2",
                "ladder.lams=[0.5,0.0]", "ladder.resamples=2"]
    records = {}
    for engine in ("hf", "vllm"):
        config = load_config(ROOT / "recipes" / "tiny.yaml", [*settings, f"engine={engine}"])
        run_ladder(config, RunDir(tmp_path / engine))
        lines = (tmp_path / engine / "ladder" / "records.jsonl").read_text().splitlines()
        records[engine] = [json.loads(line) for line in lines]
    assert records["vllm"] == records["hf"]
    arms = [r["arms"] for r in records["hf"]]
    assert len(arms) == 4 and all(set(a) == {"resample", "resample2", "verifier@0.5", "verifier@0", "self@0.5"}
                                  for a in arms)
    assert any(a["verifier@0.5"]["text"] != a["verifier@0"]["text"] for a in arms)
    assert any(a["resample"]["text"] != a["resample2"]["text"] for a in arms)
