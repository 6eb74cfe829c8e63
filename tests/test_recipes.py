"""Every recipe validates against the config dataclasses; the DeepSpeed configs they name exist and parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redumix.pipeline.config import load_config

RECIPES = sorted(Path(__file__).resolve().parents[1].glob("recipes/*.yaml"))


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"tiny.yaml", "qwen2.5-1.5b-gsm8k.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates(recipe: Path) -> None:
    config = load_config(recipe)
    assert config.name
    if config.train.deepspeed:
        path = recipe.parents[1] / config.train.deepspeed
        assert json.loads(path.read_text())["zero_optimization"]["stage"] in (2, 3)


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json"])
def test_deepspeed_configs_parse(name: str) -> None:
    path = Path(__file__).resolve().parents[1] / "recipes" / name
    assert json.loads(path.read_text())["zero_optimization"]["stage"] == int(name[4])
