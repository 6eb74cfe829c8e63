"""vLLM as the decoding engine: plain requests and ReDuMix pairs on an in-process `vllm.LLM`.

The mixture is two requests per example, x and x2, that `vllm_pairs.PairMixer` (a V1 logits processor) decodes in
step from p_mix. vLLM never promises to decode both members of a pair in one step (chunked prefill, admission
limits, preemption), so this module sizes its waves to make a split rare and retries every split pair:
- a wave holds at most `max_num_seqs // 2` pairs, whose prompts together fit one step's token budget
  (`max_num_batched_tokens`), so every prompt of a wave is prefilled in its first step;
- a split pair (the ledger says so, or its two outputs differ, or a token has no recorded draw) is never returned:
  it goes into the next wave, up to `max_retries` more times. The prefix cache holds its prompts by then, so a retry
  needs only their last blocks in a step. `retried_pairs` counts them; the harvest's manifest records the count.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the processor and this module share the ledger.
Several processes (`NPROC=N`, torchrun) take vLLM's external launcher, as TRL's colocate mode does: each rank builds
its own engine, in its own process, on its own device, so each rank's ledger is its own. Tensor parallelism works
the same way, with `vllm.tensor_parallel_size` ranks per engine: every rank of a group runs the same requests (vLLM's
scheduling is deterministic, the external launcher's premise) and samples in its own process, so the processor sees
the whole gathered logits on each. In one process vLLM would start its own workers for it, and sample there, out of
the ledger's reach, so that is refused (`check_engine_ranks`).
"""

from __future__ import annotations

import gc
import importlib
import itertools
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from redumix.common.ranks import rank, world_size
from redumix.generate.engine import MixedRedo
from redumix.generate.loop import Generation, generation_from
from redumix.generate.model_io import folder_stop_ids, load_tokenizer
from redumix.generate.policy import SamplingPolicy

# The CPU attention kernel's head sizes (vLLM 0.32's CPUAttentionBackend.get_supported_head_sizes); asked of vLLM
# itself when it is installed, and kept here so that a refusal can be explained before vLLM is imported.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class VllmSettings:
    """`vllm`: the engine that `engine=vllm` decodes with (docs/multiprocess-and-gpus.md)."""

    max_num_seqs: int = field(
        default=64, metadata={"help": "Requests vLLM runs at once; a wave of ReDuMix pairs holds half as many pairs."}
    )
    max_num_batched_tokens: int = field(
        default=16384,
        metadata={"help": "Tokens vLLM processes per step. A wave's prompts fit in one step, so pairs stay in step; "
                  "smaller values split pairs, which are detected and retried."},
    )
    kv_cache_gib: int = field(
        default=4,
        metadata={"help": "KV cache size on a CPU (VLLM_CPU_KVCACHE_SPACE); room for a wave keeps vLLM from "
                  "preempting (and splitting) pairs."},
    )
    gpu_memory_utilization: float = field(default=0.85, metadata={"help": "Share of GPU memory vLLM takes."})
    enforce_eager: bool = field(
        default=True,
        metadata={"help": "Skip torch.compile and CUDA graphs: on 2 CPU cores compiling cost ~60 s per engine for "
                  "no gain at these sizes; set false on a GPU."},
    )
    max_retries: int = field(default=4, metadata={"help": "Times a split pair is retried before the harvest stops."})
    tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Ranks (GPUs) one engine spans, for a model that does not fit one. Needs NPROC a multiple "
                  "of it (torchrun): the ranks of a group decode the same shards and the group's first writes them."},
    )

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("max_num_seqs", "max_num_batched_tokens")
                    if getattr(self, name) < 1]
        if self.max_num_seqs < 2:
            problems.append("max_num_seqs must be >= 2 (a pair is two requests)")
        if self.kv_cache_gib < 1 or not 0 < self.gpu_memory_utilization <= 1:
            problems.append("kv_cache_gib must be >= 1 and gpu_memory_utilization in (0, 1]")
        if self.max_retries < 0:
            problems.append(f"max_retries must be >= 0, got {self.max_retries}")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if problems:
            raise ValueError("; ".join(problems))


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when it is not installed (`make vllm` adds it)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def check_engine_model(path: str | Path, key: str, on_cpu: bool) -> None:
    """Refuse what vLLM cannot run, before anything loads: no vLLM installed, or (on a CPU) a head size its attention
    kernel lacks. The embedded default (head_dim 24) is such a model; SmolLM2 and Qwen2.5 (64, 128) are not."""
    if vllm_version() is None:
        raise ValueError(f"{key}=vllm needs vLLM, which is not installed: run `make vllm` (or set {key}=hf)")
    if not (Path(path) / "config.json").is_file():
        return  # the preflight check names the missing folder and says what to do
    config = json.loads((Path(path) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if on_cpu and head not in CPU_HEAD_SIZES:
        raise ValueError(
            f"{key}=vllm: {path} has head_dim {head}, and vLLM's CPU attention takes only head_dim in "
            f"{list(CPU_HEAD_SIZES)} (the embedded default's is 24); set {key}=hf, or point model.path at a model "
            "such as SmolLM2-135M or Qwen2.5 (head_dim 64 or 128)"
        )


def check_engine_ranks(settings: VllmSettings, key: str) -> tuple[int, int]:
    """(this rank's engine group, the number of groups): the ranks of a group share one tensor-parallel engine and
    decode the same work. Refuses a world that the groups do not divide, and tensor parallelism in one process."""
    tp, world = settings.tensor_parallel_size, world_size()
    if tp > 1 and world == 1:
        raise ValueError(
            f"{key}=vllm with vllm.tensor_parallel_size={tp} needs {tp} ranks: run it with NPROC={tp} (torchrun), "
            "one rank per device. In one process vLLM would sample in worker processes of its own, where the pair "
            "mixer's ledger is out of reach"
        )
    if world % tp:
        raise ValueError(f"{key}=vllm: NPROC={world} is not a multiple of vllm.tensor_parallel_size={tp}; each "
                         "engine spans that many ranks")
    return rank() // tp, world // tp


def _vllm_classes() -> tuple[type, type]:
    """vLLM's LLM and the pair mixer, imported on a thread of their own. Importing vLLM keeps the importing stack
    alive for good (vllm.multimodal.media.audio keeps an ImportError with its traceback), and with it the locals
    of every caller: the first eval's Hugging Face model and engine would stay in memory while evidence trains.
    A new thread's stack holds nothing of ours (tests/test_vllm_engine.py). Under torchrun the import stays on the
    main thread: a rank that imported vLLM on another decoded nothing with its second engine
    (tests/test_vllm_harvest.py)."""
    names = ["vllm.entrypoints.llm", "redumix.generate.vllm_pairs"]
    found: list = []
    if world_size() == 1:
        worker = threading.Thread(target=lambda: found.extend(map(importlib.import_module, names)))
        worker.start()
        worker.join()
    if len(found) < len(names):  # under torchrun, or the import failed on the thread: raise its error here
        found = list(map(importlib.import_module, names))
    return found[0].LLM, found[1].PairMixer


class VllmEngine:
    """An in-process `vllm.LLM` over a local Hugging Face folder, with the pair mixer loaded: the engine protocol
    (engine.py) with each context kept as its token ids, re-sent whole with every request."""

    name = "vllm"

    def __init__(self, path: str | Path, settings: VllmSettings, dtype: str, seed: int, device: str = "cpu",
                 trust_remote_code: bool = False, key: str = "engine") -> None:
        self.path, self.trust_remote_code = Path(path), trust_remote_code
        on_cpu = not device.startswith("cuda")
        check_engine_model(path, key, on_cpu)
        # `model.dtype: auto` as the Hugging Face path reads it (bf16 where the hardware computes it), not vLLM's
        # own 'auto' (the checkpoint's dtype), so that one recipe decodes in one dtype on either engine.
        import torch

        from redumix.generate.model_io import DTYPES, resolve_dtype

        dtype = {v: k for k, v in DTYPES.items()}[resolve_dtype(dtype, torch.device(device))]
        # The pair mixer's ledger is shared with this process, so the engine core must run in it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The pair mixer fills the V1 model runner's logits-processor interface. On a GPU vLLM defaults to Model
        # Runner V2, whose interface is another and refuses the class; the CPU has the V1 runner only.
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").lower() not in ("0", "false"):
            raise ValueError(f"{key}=vllm needs vLLM's V1 model runner (the pair mixer is written for its logits "
                             "processors): unset VLLM_USE_V2_MODEL_RUNNER, or set it to 0")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
        LLM, PairMixer = _vllm_classes()  # noqa: N806
        self.settings = settings
        self.retried_pairs = 0
        self._serial = itertools.count()
        # A 32-token block (the CPU kernel's multiple) lets a retried pair find all but its prompts' last blocks in
        # the prefix cache; async scheduling is off so that a request's output list is current when the processor
        # reads its length (the index of the next draw).
        extra: dict = {"block_size": 32} if on_cpu else {}
        check_engine_ranks(settings, key)
        if world_size() > 1:
            # Under torchrun each rank builds its own engine, as TRL's colocate mode does: the external launcher
            # joins the process group the rank already holds, takes the device from LOCAL_RANK, and keeps the engine
            # core (so the pair mixer and its ledger) in this process. Building it is a collective over the ranks.
            extra.update(distributed_executor_backend="external_launcher",
                         tensor_parallel_size=settings.tensor_parallel_size)
        # Unless OMP_NUM_THREADS is set, vLLM drops torch to one thread "for serving" while it builds, leaving a
        # front end a core of its own; in this process the engine is the only work, so it keeps the threads the
        # process has (torchrun sets the variable per rank itself). Set for the build only, so that no process this
        # one starts later inherits it. Measured: docs/real-models.md, "The harvest's engine on a CPU".
        threads = on_cpu and "OMP_NUM_THREADS" not in os.environ
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        try:
            self.llm = LLM(
                model=str(path), dtype=dtype, seed=seed, skip_tokenizer_init=True,
                trust_remote_code=trust_remote_code, logits_processors=[PairMixer], enable_prefix_caching=True,
                async_scheduling=False, max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens, enforce_eager=settings.enforce_eager,
                gpu_memory_utilization=settings.gpu_memory_utilization, **extra,
            )
        finally:
            if threads:
                del os.environ["OMP_NUM_THREADS"]

    def close(self) -> None:
        """Drop the engine and collect it, so that its weights and KV cache go before the next stage of this process
        (evidence trains after it evaluates), not whenever the collector next runs. Under torchrun the engine stays:
        a rank whose first engine was freed decoded nothing with its next one (tests/test_vllm_harvest.py)."""
        if world_size() > 1:
            return
        del self.llm
        gc.collect()

    # --- the engine protocol -------------------------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.path, self.trust_remote_code)

    @cached_property
    def stop_ids(self) -> list[int]:
        return folder_stop_ids(self.path, self.tokenizer, self.trust_remote_code)

    @cached_property
    def window(self) -> int | None:
        return json.loads((self.path / "config.json").read_text()).get("max_position_embeddings")

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
               policy: SamplingPolicy) -> list[Generation]:
        gens = self.generate(prompts, seeds, policy, self.stop_ids, policy.max_new_tokens)
        for gen, prompt in zip(gens, prompts, strict=True):  # the prompt counts, as HfEngine.sample counts it
            gen.usage.prefill_tokens = len(prompt)
            gen.usage.fpe += len(prompt)
        return gens

    def open(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return [list(p) for p in prompts]

    def extend(self, contexts: list[list[int]], segments: Sequence[Sequence[int]]) -> list[list[int]]:
        return [ids + list(seg) for ids, seg in zip(contexts, segments, strict=True)]

    def continue_turn(self, contexts: list[list[int]], seeds: Sequence[int], policy: SamplingPolicy, max_tokens: int,
                      keep: bool) -> tuple[list[Generation], list[list[int]] | None]:
        gens = self.generate(contexts, seeds, policy, self.stop_ids, max_tokens)
        grown = [ids + g.token_ids[: g.cached] for ids, g in zip(contexts, gens, strict=True)] if keep else None
        return gens, grown

    def fork(self, contexts: list[list[int]], rows: Sequence[int] | None = None) -> list[list[int]]:
        return [list(contexts[i]) for i in (range(len(contexts)) if rows is None else rows)]

    def reopen(self, contexts: list[list[int]], rows: Sequence[int], prompts: Sequence[Sequence[int]]
               ) -> list[list[int]]:
        fresh = dict(zip(rows, prompts, strict=True))
        return [list(fresh[i]) if i in fresh else ids for i, ids in enumerate(contexts)]

    def lengths(self, contexts: list[list[int]]) -> list[int]:
        return [len(ids) for ids in contexts]

    def mix_redo(self, x: list[list[int]], x2: list[list[int]], seeds: Sequence[int], lam: float, topk: int,
                 policy: SamplingPolicy) -> list[MixedRedo]:
        return self.mix(x, x2, seeds, lam, topk, policy, self.stop_ids, policy.max_new_tokens)

    # --- plain requests: the harvest's attempt, critique and reflection; eval's single-context decoders ----------

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], policy: SamplingPolicy,
                 stop_ids: Sequence[int], max_tokens: int) -> list[Generation]:
        """Plain decoding of token-id prompts. Sampled rows draw with redumix's noise of (seed, output index), so a
        row is the same whatever else is in the batch; greedy rows are vLLM's own argmax."""
        params = [self._params(policy, stop_ids, max_tokens, None if policy.greedy else
                               {"key": f"solo-{next(self._serial)}", "role": "solo", "seed": int(s)})
                  for s in seeds]
        outputs = self._run([list(p) for p in prompts], params)
        return [generation_from(list(o.outputs[0].token_ids), stop_ids, 1) for o in outputs]

    # --- ReDuMix pairs --------------------------------------------------------------------------------------------

    def mix(self, x_ids: Sequence[Sequence[int]], x2_ids: Sequence[Sequence[int]], seeds: Sequence[int], lam: float,
            topk: int, policy: SamplingPolicy, stop_ids: Sequence[int], max_tokens: int) -> list[MixedRedo]:
        """Decode every example from p_mix of its two contexts, as a pair of requests; split pairs are retried. At
        λ = 0 or 1, p_mix is one context's distribution exactly: that context alone is one request (vllm_pairs.py)."""
        done: dict[int, MixedRedo] = {}
        todo = list(range(len(x_ids)))
        retries = dict.fromkeys(todo, 0)
        roles = ([("single", x2_ids if lam == 0 else x_ids)] if lam in (0, 1)
                 else [("x2", x2_ids), ("x", x_ids)])  # x2, the longer, first: vLLM chunks the last admitted
        for _ in range(self.settings.max_retries + 1):
            for wave in self._waves(todo, roles):
                done.update(self._mix_wave(wave, roles, seeds, lam, topk, policy, stop_ids, max_tokens, retries))
            todo = [i for i in todo if i not in done]
            if not todo:
                return [done[i] for i in range(len(x_ids))]
            self.retried_pairs += len(todo)
            for i in todo:
                retries[i] += 1
        raise RuntimeError(
            f"vLLM split {len(todo)} ReDuMix pairs {self.settings.max_retries + 1} times in a row (the two requests "
            "of a pair were not decoded in one step); raise vllm.max_num_batched_tokens and vllm.kv_cache_gib, or "
            "lower vllm.max_num_seqs"
        )

    def _waves(self, todo: list[int], roles: list) -> list[list[int]]:
        """Pairs packed so that a wave's requests fit max_num_seqs and its prompts one step's budget (so that both
        members prefill in one step); single requests cannot split, so max_num_seqs alone bounds their waves."""
        waves: list[list[int]] = []
        tokens = 0
        budget = self.settings.max_num_batched_tokens if len(roles) == 2 else float("inf")
        for i in todo:
            need = sum(len(contexts[i]) for _, contexts in roles)
            full = waves and (len(waves[-1]) >= self.settings.max_num_seqs // len(roles) or tokens + need > budget)
            if not waves or full:
                waves.append([])
                tokens = 0
            waves[-1].append(i)
            tokens += need
        return waves

    def _mix_wave(self, wave, roles, seeds, lam, topk, policy, stop_ids, max_tokens, retries
                  ) -> dict[int, MixedRedo]:
        from redumix.generate.vllm_pairs import LEDGER, PairLog

        keys = {i: f"pair-{next(self._serial)}" for i in wave}
        prompts, params = [], []
        for i in wave:
            LEDGER[keys[i]] = PairLog()
            spec = {"key": keys[i], "seed": int(seeds[i]), "lam": float(lam), "topk": int(topk)}
            for role, contexts in roles:  # vLLM admits requests in order, so a tight budget chunks x2, not x
                prompts.append(list(contexts[i]))
                params.append(self._params(policy, stop_ids, max_tokens, {**spec, "role": role}))
        outputs = self._run(prompts, params)
        done = {}
        width = len(roles)
        for j, i in enumerate(wave):
            log = LEDGER.pop(keys[i])
            *others, out = (list(o.outputs[0].token_ids) for o in outputs[width * j: width * (j + 1)])
            drawn = [log.draws.get(t) for t in range(len(out))]
            stray = any(d is None or d[0] != tok for d, tok in zip(drawn, out, strict=True))  # undrawn tokens
            if log.split or any(other != out for other in others) or stray:
                continue  # a split pair: retried by `mix`, never returned
            done[i] = MixedRedo(generation_from(out, stop_ids, width), [d[1] for d in drawn],
                                [d[2] for d in drawn], [d[3] for d in drawn], retries[i])
        return done

    def _params(self, policy: SamplingPolicy, stop_ids: Sequence[int], max_tokens: int, spec: dict | None):
        from vllm import SamplingParams

        from redumix.generate.vllm_pairs import TAG

        extra = None
        if spec is not None:
            extra = {TAG: {**spec, "temperature": policy.temperature, "top_p": policy.top_p, "top_k": policy.top_k,
                           "stop": int(stop_ids[0])}}
        # temperature 0: vLLM takes the argmax of the row, which the processor has reduced to the drawn token.
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=list(stop_ids),
                              detokenize=False, extra_args=extra)

    def _run(self, prompts: list[list[int]], params: list) -> list:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
