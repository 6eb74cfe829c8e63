"""Loading a causal LM and its tokenizer from a local folder, with errors that say what to do."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_model(
    path: str | Path, dtype: str = "float32", device: str = "auto", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model in eval mode plus its tokenizer (left padding, a pad token). Raises FileNotFoundError if missing."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {path} (expected a Hugging Face folder with config.json): run `redumix base` for the "
            "embedded default, or set model.path to a local checkpoint folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    model.to(pick_device(device)).eval()
    return model, tokenizer


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends an assistant turn: the tokenizer's eos plus the generation config's eos ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(i) for i in eos)
    if not ids:
        raise ValueError(f"{tokenizer.name_or_path}: no eos token; decoding could not tell when an answer ends")
    return sorted(ids)
