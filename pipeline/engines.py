"""The one place a stage gets its engine (generate/engine.py): the recipe's `engine` key, 'hf' or 'vllm'.

Every stage that decodes (harvest, eval, ladder, RFT's samples, the drift's off-task answers) calls `check_engine`
before it claims a folder, so a model the engine cannot run is refused with nothing written, then `open_engine`
when it has work. Nothing else in redumix asks which engine it runs on.
"""

from __future__ import annotations

from pathlib import Path

from redumix.common.ranks import rank, world_size
from redumix.generate.engine import Engine
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import load_model, pick_device
from redumix.generate.vllm_engine import VllmEngine, check_engine_model, check_engine_ranks
from redumix.pipeline.config import Config
from redumix.pipeline.run import RunDir, model_path

HF = "hf"  # the engine every decoder runs on; `needs_hf_engine` decoders run on it whatever the recipe names


def check_engine(config: Config, run: RunDir) -> tuple[int, int]:
    """Refuse what the recipe's engine cannot run (vLLM not installed, a head size its CPU kernel lacks, a world
    its tensor-parallel groups do not divide), naming the key. Returns (this rank's work group, the number of
    groups): each rank alone, or the ranks of one tensor-parallel vLLM engine, which decode the same work."""
    if config.engine == HF:
        return rank(), world_size()
    on_cpu = pick_device(config.model.device).type == "cpu"
    check_engine_model(model_path(config.model.path, run), "engine", on_cpu)
    return check_engine_ranks(config.vllm, "engine")


def builds_collectively(config: Config) -> bool:
    """Under torchrun vLLM's engine build is a collective over the ranks (the external launcher all-reduces the
    memory it finds), so every rank builds its engine, work or not, or the others wait for it."""
    return config.engine != HF and world_size() > 1


def open_engine(config: Config, path: Path, name: str | None = None) -> Engine:
    """The engine `name` (by default the recipe's) over the checkpoint at `path`. Call `close()` after it."""
    if (name or config.engine) == HF:
        model, tokenizer = load_model(path, config.model)
        return HfEngine(model, tokenizer, static_cache=config.model.static_cache)
    return VllmEngine(path, config.vllm, config.model.dtype, config.seed, str(pick_device(config.model.device)),
                      config.model.trust_remote_code, key="engine")


def batch_size(config: Config, hf_batch: int) -> int:
    """Prompts a stage hands the engine at once: `hf_batch` for redumix's loop; as many as vLLM runs at once."""
    return hf_batch if config.engine == HF else config.vllm.max_num_seqs
