"""`make bench` (bench/run.py) keeps what it measured: each module's keys are on disk as soon as it finishes, and a
missing input is found before the first module runs, not after it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from bench import bench_real
from bench.run import main, missing_inputs
from redumix.common.files import read_json


def module(name: str, keys: dict, ran: list[str], inputs: list[tuple[Path, str]] = ()) -> ModuleType:
    fake = ModuleType(f"bench.{name}")

    def run() -> dict:
        ran.append(name)
        if keys is None:
            raise RuntimeError(f"{name} broke")
        return keys

    fake.run = run
    if inputs:
        fake.inputs = lambda: inputs
    return fake


def test_each_module_s_keys_are_written_as_it_finishes(tmp_path: Path) -> None:
    path, ran = tmp_path / "results.json", []

    first = module("first", {"a": 1.5}, ran)
    second = module("second", {"b": 2}, ran)
    broken = module("broken", None, ran)
    with pytest.raises(RuntimeError, match="broken broke"):
        main([first, second, broken], path)
    assert ran == ["first", "second", "broken"]
    found = read_json(path)
    assert {k: found[k] for k in ("a", "b")} == {"a": 1.5, "b": 2} and found["modules"] == "first, second"
    assert list(found)[-2:] == ["machine", "modules"]


def test_a_missing_input_stops_the_bench_before_its_first_module(tmp_path: Path) -> None:
    path, ran = tmp_path / "results.json", []
    there = tmp_path / "there.jsonl"
    there.write_text("{}\n")
    gone = tmp_path / "shared" / "data" / "gsm8k" / "train.jsonl"
    modules = [module("first", {"a": 1}, ran), module("real", {"b": 2}, ran, [(there, "x"), (gone, "get GSM8K")])]
    with pytest.raises(SystemExit, match=f"nothing was run: bench.real reads {gone}, which is not there"):
        main(modules, path)
    assert ran == [] and not path.exists()


def test_the_real_model_module_names_its_model_and_gsm8k(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a fresh clone with nothing beside it: ../shared/data/gsm8k is not there
    named = [str(path) for path, _ in bench_real.inputs()]
    assert named[0].endswith("models/qwen2.5-coder-0.5b-instruct/config.json")
    assert named[1] == "../shared/data/gsm8k/train.jsonl"
    assert "../shared/data/gsm8k/train.jsonl, which is not there" in " ".join(missing_inputs([bench_real]))
