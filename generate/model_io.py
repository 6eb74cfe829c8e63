"""Loading a causal LM and its tokenizer from a local folder, with errors that say what to do."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from redumix.common.files import read_json
from redumix.generate.state import use_compiled_decoding

# What to do about a model folder file that does not read.
COPY_AGAIN = "copy the model's files there again, or set model.path to another folder"
Dtype = Literal["float32", "bfloat16", "float16", "auto"]  # `model.dtype`
DTYPES: dict[Dtype, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_device(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """`model.to(device)`. transformers wraps `to` with functools.wraps, which type checkers read as a function that
    still wants its `self`; the call itself is the plain one."""
    move: Any = model.to
    return move(device)


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclass
class ModelConfig:
    """`model`: which model the stages load, and how."""

    path: str = field(
        default="embedded",
        metadata={"help": "'embedded' is the embedded default model built by `redumix embedded` in "
                  "RUN_DIR/embedded; otherwise a local Hugging Face model folder."},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code shipped with the checkpoint."})
    dtype: Dtype = field(
        default="float32",
        metadata={"help": "Weights dtype. 'auto': bfloat16 on a GPU that supports it and on a CPU with bf16 in "
                  "hardware (AVX512-BF16, AMX or Arm's BF16), float32 elsewhere. Mixtures, stored log-probs and "
                  "losses are computed in float32 whatever the weights' dtype."},
    )
    device: str = field(default="auto", metadata={"help": "'auto' picks cuda:LOCAL_RANK when available, else cpu."})
    compile_decoding: bool = field(
        default=False,
        metadata={"help": "Run each one-token decode step through torch.compile (harvest, eval, calibrate). It pays "
                  "where a step is bound by its calls (a small model, a small batch), after a one-off compile per "
                  "process; it changes float rounding only. Timings: docs/measurements.md."},
    )
    static_cache: bool = field(
        default=False,
        metadata={"help": "HfEngine decodes over a static KV cache (generate/static_loop.py): fixed shapes, stop "
                  "checks on the device every few steps, and on CUDA each step replayed from a captured CUDA graph. "
                  "On a CPU it runs eagerly, the same ids in float32 (tests/test_engine.py); the harvest, eval and "
                  "ladder read it."},
    )


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype of `model.dtype` on `device`. 'auto' takes bfloat16 only where the hardware computes it: a CPU
    without bf16 instructions emulates it, which is slower than float32 (train.bf16's help says the same)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic in hardware, as torch's own kernels see it: AVX512-BF16 or AMX on x86
    (torch.cpu's checks, which `get_cpu_capability` does not report), the BF16 feature on Arm."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            return any(line.startswith("Features") and "bf16" in line.split()
                       for line in Path("/proc/cpuinfo").read_text().splitlines())
        except OSError:
            return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def load_model(
    path: str | Path, settings: ModelConfig | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in `path`, ready to decode, plus its tokenizer (left padding, a pad token). Raises
    FileNotFoundError if missing. `path` is the folder the stage resolved (`settings.path` may say 'embedded', and a
    stage also loads its own checkpoints); `settings` says how: dtype, device, trusted code, and with
    `compile_decoding` its one-token decode steps run compiled (`state.use_compiled_decoding`)."""
    path, settings = Path(path), settings or ModelConfig()
    tokenizer = load_tokenizer(path, settings.trust_remote_code)
    tokenizer.padding_side = "left"
    model = load_weights(path, settings)
    to_device(model, pick_device(settings.device)).eval()
    if settings.compile_decoding:
        use_compiled_decoding(model)
    return model, tokenizer


def load_weights(path: str | Path, settings: ModelConfig | None = None) -> PreTrainedModel:
    """The bare model as stored, on the CPU, in `settings.dtype` (for 'auto', that of the device `settings.device`
    picks): no tokenizer, no device, no decoding set-up. What training, merging and scoring start from; the caller
    places it (a trainer moves it itself)."""
    settings = settings or ModelConfig()
    dtype = resolve_dtype(settings.dtype, pick_device(settings.device))
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=settings.trust_remote_code)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, checked for what every stage needs: a chat template and a pad token (the
    eos token stands in when there is none). Errors name the folder and say what to do."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {path} (expected a Hugging Face folder with config.json): run `redumix embedded` for the "
            "embedded default, or set model.path to a local checkpoint folder"
        )
    refuse_shipped_code(path, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # tokenizers and transformers raise many kinds, none of which names the file
        if trust_remote_code:
            raise  # the folder's own code failed: its error is the one to read
        files = ", ".join(f.name for f in sorted(path.glob("tokenizer*"))) or "no tokenizer files"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{path}: the tokenizer does not load ({files}: {first}); copy the model's tokenizer files "
                         "there again, or set model.path to another folder") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{path}: the tokenizer has no chat template, and redumix renders every prompt with it; add one "
            "(chat_template.jinja or 'chat_template' in tokenizer_config.json) or set model.path to a chat model"
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{path}: the tokenizer has neither a pad token nor an eos token, so batches cannot be padded and "
                f"answers cannot end; set 'eos_token' (and 'pad_token') in {path / 'tokenizer_config.json'}"
            )
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id will do
    vocab = read_json(path / "config.json", fix=COPY_AGAIN).get("vocab_size")
    outside: dict[int, list[str]] = {}  # id -> the roles it plays (pad and eos are often one token)
    for role, i in (("pad", tokenizer.pad_token_id), ("eos", tokenizer.eos_token_id)):
        if isinstance(vocab, int) and i is not None and i >= vocab:
            outside.setdefault(i, []).append(role)
    if outside:
        named = " and ".join(
            f"{'/'.join(roles)} token {tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i, roles in outside.items()
        )
        raise ValueError(
            f"{path}: the tokenizer's {named} is outside the model's {vocab}-token vocabulary (transformers fills in "
            "such a default when the tokenizer names no pad or eos token); set 'eos_token' (and 'pad_token') in "
            f"{path / 'tokenizer_config.json'} to tokens the model knows"
        )
    return tokenizer


def refuse_shipped_code(path: Path, trust_remote_code: bool) -> None:
    """A folder whose config points at its own Python code (`auto_map`) loads only when the recipe trusts it.

    Without trust, transformers quietly loads its built-in class instead, which is not the model the folder ships.
    """
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file() and "auto_map" in read_json(file, fix=COPY_AGAIN):
            raise ValueError(
                f"{file}: the model ships its own code (auto_map), and redumix runs no code from a model folder "
                "unless the recipe says so; read that code, then set model.trust_remote_code: true to run it"
            )


def folder_stop_ids(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, trust_remote_code: bool = False
) -> list[int]:
    """`stop_token_ids` of a model folder without loading its weights (for an engine that loads them itself): the
    generation config the model would get, from generation_config.json or else from config.json."""
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        generation = GenerationConfig.from_model_config(config)
    return stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)


def stop_token_ids(model: PreTrainedModel | SimpleNamespace, tokenizer: PreTrainedTokenizerBase) -> list[int]:
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
