"""What a stage checks before it claims any folder: model.path is a local folder, the model loads, the device
exists, the prompts fit.

A stage that fails one of these checks has written nothing, so the rerun with the input fixed is not refused as "a
different config". Each error names the file (or the key) and says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.task import Example
from redumix.generate.model_io import ModelConfig, load_tokenizer
from redumix.pipeline.config import find_extended, find_recipe
from redumix.pipeline.resolve import ConfigError, read_recipe
from redumix.pipeline.run import EMBEDDED


def check_inputs(model: ModelConfig, path: Path, examples: Sequence[Example], max_new_tokens: int) -> None:
    """Everything a decoding stage needs from its inputs, checked before it writes anything."""
    check_device(model.device)
    tokenizer = load_tokenizer(path, model.trust_remote_code)  # the folder, its chat template, a pad token
    window = check_model_files(path, model.trust_remote_code)
    check_prompts_fit(tokenizer, window, examples, max_new_tokens)


# `Qwen/Qwen2.5-1.5B-Instruct`: an organisation and a repository, which a user of the Hub writes for a model.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_folder(setting: str, where: str) -> None:
    """`model.path` (set in `where`: a recipe file, the command line or --model) is a folder on this machine, or
    'embedded'. A Hugging Face Hub id is told how to download the model, since redumix downloads nothing."""
    if setting in (EMBEDDED, "base") or Path(setting).is_dir():  # 'base' gets run.model_path's own error
        return
    said = f"{where}: 'model.path' = {setting!r}"
    if HUB_ID.fullmatch(setting) and not Path(setting.split("/")[0]).exists():
        local = f"models/{setting.split('/')[1].lower()}"
        raise ConfigError(
            f"{said} is not a folder here; if it is a Hugging Face Hub id: redumix reads models from local folders "
            f"only (nothing is downloaded at run time), so download it once with `hf download {setting} --local-dir "
            f"{local}` (`huggingface-cli download` before huggingface_hub 1.0), then set model.path: {local}")
    raise ConfigError(f"{said}: no such folder; set model.path to a local Hugging Face model folder (one with "
                      "config.json), or to 'embedded' for the embedded default model")


def where_set(recipe: str | Path | None, overrides: list[str], key: str) -> str:
    """Where `key` got its value: the command line, the recipe file (or one it extends) that sets it, or defaults."""
    if any(item.partition("=")[0].strip() == key for item in overrides):
        return "command line"
    origin: dict[str, str] = {}
    if recipe is not None:
        read_recipe(find_recipe(recipe), origin, find_extended)
    return origin.get(key, "defaults")


def check_device(device: str) -> None:
    """`model.device` names a device torch knows and this machine has."""
    if device == "auto":
        return
    try:
        wanted = torch.device(device)
    except RuntimeError:
        known = "use auto, cpu, cuda or cuda:N"
        raise ValueError(f"model.device={device!r} is not a device torch knows; {known}") from None
    if wanted.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"model.device={device!r}, but this machine has no CUDA GPU that torch can use; "
                             "set model.device=auto (a GPU when there is one, else the CPU) or cpu")
        if wanted.index is not None and wanted.index >= count:
            raise ValueError(f"model.device={device!r}, but this machine has {count} CUDA GPU(s) (cuda:0 to "
                             f"cuda:{count - 1}); pick one of them or set model.device=auto")


def check_model_files(path: Path, trust_remote_code: bool) -> int | None:
    """The folder's config.json names an architecture transformers knows and every weights file reads; returns the
    model's window (positions), or None when the config gives none."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{path / 'config.json'}: transformers cannot load this model config ({_first_line(exc)}); "
                         "set model.path to a folder saved by save_pretrained, with a model_type it knows") from None
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not list(path.glob("*.bin")):
        raise ValueError(f"{path}: no weights (*.safetensors); set model.path to a folder saved by save_pretrained")
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own SafetensorError, not an OSError
            raise ValueError(f"{file}: not a readable safetensors file ({_first_line(exc)}); copy the model's "
                             "weights there again, or set model.path to another folder") from None
    window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(window) if window else None


def check_prompts_fit(tokenizer, window: int | None, examples: Sequence[Example], max_new_tokens: int) -> None:
    """Every example's prompt, rendered, leaves room in the model's window for `max_new_tokens` of answer.

    A prompt past the window would be decoded anyway, slowly and with memory growing with its length, into an answer
    that means nothing; it is refused instead, naming the examples.
    """
    if window is None:
        return
    too_long = []
    for example in examples:
        length = len(prompt_ids(tokenizer, attempt_messages(example.prompt)))
        if length + max_new_tokens > window:
            too_long.append((example.id, length))
    if too_long:
        named = ", ".join(f"{i} ({n:,} tokens)" for i, n in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        raise ValueError(
            f"{len(too_long)} prompt(s) do not fit the model's window of {window} positions with "
            f"sampling.max_new_tokens={max_new_tokens} to answer in: {named}{more}; remove or shorten those examples, "
            "lower sampling.max_new_tokens, or use a model with a longer window"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
