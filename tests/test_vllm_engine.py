"""vLLM as the decoding engine, checked against the Hugging Face path in float32 on a CPU: the mixture as paired
requests gives the ids (and stored top-k and tail) of redumix's own decode loop, a sampled redo does not depend on
the batch, and a pair that vLLM splits is detected and retried. Skipped where vLLM is not installed (`make vllm`).

The exactness tests run on two models: a random head_dim-64 Llama (fast, every run) and SmolLM2-135M-Instruct (slow:
a real checkpoint's flatter distributions and a 49k vocabulary, on ChatML prompts; `make smollm2` fetches it). CI
runs both after `make vllm` (.ci/run)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment; `make vllm` adds it")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from redumix.generate.mixture import mixture_loop  # noqa: E402
from redumix.generate.plain import generate_batch  # noqa: E402
from redumix.generate.policy import SamplingPolicy  # noqa: E402
from redumix.generate.state import prefill  # noqa: E402
from redumix.generate.vllm_engine import VllmEngine, VllmSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
MAX_NEW = 12
SEEDS = [11, 22, 33, 44]


@dataclass
class Case:
    """One model under test: its folder, the Hugging Face model, a vLLM engine on it, and four pairs of prompts."""

    folder: Path
    hf: LlamaForCausalLM
    engine: VllmEngine
    x: list[list[int]]
    x2: list[list[int]]  # each longer than its x, as the harvest's x2 always is
    stop: list[int]
    pad: int


def _random_prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(2, 512, (k,), generator=g).tolist() for k in lengths]


def _case(folder: Path, x: list[list[int]], x2: list[list[int]], stop: list[int], pad: int) -> Case:
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = VllmEngine(folder, VllmSettings(max_num_seqs=16, kv_cache_gib=1), "float32", seed=0)
    return Case(folder, hf, engine, x, x2, stop, pad)


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory) -> Case:
    """A random Llama with head_dim 64 (vLLM's CPU attention rejects the embedded model's 24). initializer_range
    0.2 makes its next-token distributions peaked, so float32 rounding between the two engines cannot flip an
    argmax."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    folder = tmp_path_factory.mktemp("llama64")
    LlamaForCausalLM(config).float().eval().save_pretrained(folder)
    return _case(folder, _random_prompts(4, 8, 30, 1), _random_prompts(4, 40, 90, 2), [1], 0)


def _smollm2_case() -> Case:
    """SmolLM2 on the harvest's own prompts: x asks a question, x2 is the redo context after an attempt, a critique
    and a reflection, rendered with the model's ChatML template."""
    from transformers import AutoTokenizer

    from redumix.data.chat import prompt_ids
    from redumix.data.prompts import attempt_messages, redo_messages

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    questions = ["What is 17 + 25?", "Name the capital of France.", "What is 6 times 7?",
                 "Write a word that rhymes with cat."]
    attempts = ["17 + 25 = 32.", "Lyon.", "6 times 7 is 42.", "Dog."]
    x = [prompt_ids(tokenizer, attempt_messages(q)) for q in questions]
    x2 = [prompt_ids(tokenizer, redo_messages(q, a, "Check the answer again.", "I should verify each step."))
          for q, a in zip(questions, attempts, strict=True)]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return _case(SMOLLM2, x, x2, [end], tokenizer.pad_token_id)


@pytest.fixture(scope="module", params=["llama64", pytest.param("smollm2", marks=pytest.mark.slow)])
def case(request) -> Case:
    if request.param == "llama64":
        return request.getfixturevalue("llama_case")
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip(f"{SMOLLM2.relative_to(ROOT)} is absent: `make smollm2` fetches and converts it")
    return _smollm2_case()


def _hf_mix(case: Case, lam: float, policy: SamplingPolicy):
    """redumix's own Hugging Face redo of the case's four pairs: (generation, top-k ids, log-probs, tail) each."""
    with torch.no_grad():
        return mixture_loop(case.hf, prefill(case.hf, case.x, case.pad), prefill(case.hf, case.x2, case.pad), lam, 5,
                            policy, torch.tensor(SEEDS), case.stop, MAX_NEW)


def _greedy(case: Case, prompts: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [g.token_ids for g in generate_batch(case.hf, prompts, SamplingPolicy(), [0] * len(prompts), case.stop,
                                                    case.pad, MAX_NEW)]


def test_lambda_one_is_greedy_x_and_zero_is_greedy_x2(case):
    greedy = SamplingPolicy(max_new_tokens=MAX_NEW)
    at_one = case.engine.mix(case.x, case.x2, SEEDS, 1.0, 5, greedy, case.stop, MAX_NEW)
    at_zero = case.engine.mix(case.x, case.x2, SEEDS, 0.0, 5, greedy, case.stop, MAX_NEW)
    assert [r.generation.token_ids for r in at_one] == _greedy(case, case.x)
    assert [r.generation.token_ids for r in at_zero] == _greedy(case, case.x2)
    plain = case.engine.generate(case.x, SEEDS, greedy, case.stop, MAX_NEW)
    assert [g.token_ids for g in plain] == _greedy(case, case.x)


def test_lambda_half_matches_the_hf_mixture_loop_with_its_stored_targets(case):
    greedy = SamplingPolicy(max_new_tokens=MAX_NEW)
    ours = case.engine.mix(case.x, case.x2, SEEDS, 0.5, 5, greedy, case.stop, MAX_NEW)
    theirs = _hf_mix(case, 0.5, greedy)
    for r, (gen, ids, lps, tail) in zip(ours, theirs, strict=True):
        assert r.generation.token_ids == gen.token_ids
        assert r.topk_ids == ids
        assert torch.allclose(torch.tensor(r.topk_logprobs), torch.tensor(lps), atol=1e-4)
        assert torch.allclose(torch.tensor(r.tail_logprobs), torch.tensor(tail), atol=1e-4)
        assert r.retries == 0


@pytest.mark.parametrize("lam", [0.0, 1.0])
def test_at_lambda_zero_or_one_one_request_gives_the_pairs_draws_and_targets_at_half_the_decoding(case, lam):
    """p_mix is then one context's distribution: vLLM decodes that context alone, and every token, stored top-k and
    tail is the Hugging Face mixture loop's (whose own one-context path tests/test_redumix.py checks by hand)."""
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=MAX_NEW)
    ours = case.engine.mix(case.x, case.x2, SEEDS, lam, 5, policy, case.stop, MAX_NEW)
    theirs = _hf_mix(case, lam, policy)
    for r, (gen, ids, lps, tail) in zip(ours, theirs, strict=True):
        assert r.generation.token_ids == gen.token_ids and r.topk_ids == ids
        assert torch.allclose(torch.tensor(r.topk_logprobs), torch.tensor(lps), atol=1e-4)
        assert torch.allclose(torch.tensor(r.tail_logprobs), torch.tensor(tail), atol=1e-4)
        assert r.generation.usage.fpe == r.generation.cached  # one context read a token, not two
    half = case.engine.mix(case.x, case.x2, SEEDS, 0.5, 5, policy, case.stop, MAX_NEW)
    assert all(r.generation.usage.fpe == 2 * r.generation.cached for r in half)


def test_sampled_redo_is_the_same_whatever_else_is_in_the_batch(case):
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=MAX_NEW)
    alone = case.engine.mix(case.x[:1], case.x2[:1], SEEDS[:1], 0.5, 5, policy, case.stop, MAX_NEW)[0]
    crowd = case.engine.mix(case.x[::-1], case.x2[::-1], SEEDS[::-1], 0.5, 5, policy, case.stop, MAX_NEW)[-1]
    assert alone.generation.token_ids == crowd.generation.token_ids
    # and it is the Hugging Face harvest's draw: the same noise of (seed, output index)
    assert alone.generation.token_ids == _hf_mix(case, 0.5, policy)[0][0].token_ids
    sampled = case.engine.generate(case.x, SEEDS, policy, case.stop, MAX_NEW)
    with torch.no_grad():
        hf = generate_batch(case.hf, case.x, policy, SEEDS, case.stop, case.pad, MAX_NEW)
    assert [g.token_ids for g in sampled] == [g.token_ids for g in hf]


def test_a_forced_split_is_detected_and_retried_to_the_unforced_rows(llama_case):
    """A 64-token step budget chunks x2's prefill, so x draws before x2 is ready: every pair splits at first."""
    case = llama_case
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=MAX_NEW)
    unforced = case.engine.mix(case.x, case.x2, SEEDS, 0.5, 5, policy, case.stop, MAX_NEW)
    tight = VllmEngine(case.folder, VllmSettings(max_num_seqs=16, max_num_batched_tokens=64, kv_cache_gib=1),
                       "float32", seed=0)
    forced = tight.mix(case.x, case.x2, SEEDS, 0.5, 5, policy, case.stop, MAX_NEW)
    assert tight.retried_pairs >= 1
    assert any(r.retries for r in forced)
    for a, b in zip(forced, unforced, strict=True):
        assert a.generation.token_ids == b.generation.token_ids
        assert a.topk_ids == b.topk_ids
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-4)


def test_the_gpu_check_row_passes_on_this_machine():
    """`make gpu-check`'s vLLM row, at smoke sizes: the code a GPU session runs, run here first."""
    from bench.gpu_check import SMOKE, check_vllm_engine

    [row] = check_vllm_engine("cpu", SMOKE)
    assert row.ok is True, row.result


def test_model_runner_v2_is_refused_naming_the_variable(llama_case, monkeypatch):
    """The pair mixer fills the V1 runner's processor interface; a user's VLLM_USE_V2_MODEL_RUNNER=1 is refused."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="unset VLLM_USE_V2_MODEL_RUNNER, or set it to 0"):
        VllmEngine(llama_case.folder, VllmSettings(max_num_seqs=16, kv_cache_gib=1), "float32", seed=0)


def test_auto_dtype_is_the_hugging_face_paths_and_the_threads_stay(llama_case, monkeypatch):
    """`model.dtype: auto` is bf16 where the CPU computes it, float32 elsewhere, on either engine; vLLM's own 'auto'
    would take the checkpoint's float32 and decode one recipe in another dtype than the Hugging Face harvest. The
    engine keeps the process's torch threads (vLLM would drop to one) and leaves OMP_NUM_THREADS as it found it."""
    from redumix.generate.model_io import resolve_dtype

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    engine = VllmEngine(llama_case.folder, VllmSettings(max_num_seqs=16, kv_cache_gib=1), "auto", seed=0)
    assert engine.llm.llm_engine.model_config.dtype == resolve_dtype("auto", torch.device("cpu"))
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS" not in os.environ


def test_an_engine_keeps_no_caller_alive_and_close_lets_its_weights_go(llama_case):
    """evidence evaluates, then trains, in one process: neither the first eval's model nor a finished engine may
    stay in memory while the trainer runs. A fresh interpreter, so that this is vLLM's first import there."""
    script = f"""
import gc, weakref
from redumix.generate.vllm_engine import VllmEngine, VllmSettings

class Held:  # stands for the caller's Hugging Face model
    pass

def open_engine():
    held = Held()
    engine = VllmEngine({str(llama_case.folder)!r}, VllmSettings(max_num_seqs=16, kv_cache_gib=1), "float32", 0)
    runner = engine.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return engine, weakref.ref(held), weakref.ref(runner.model)

engine, held, weights = open_engine()
gc.collect()
assert held() is None, "the caller's locals outlived it"
assert weights() is not None
engine.close()
assert weights() is None, "the closed engine's weights are still held"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
