"""vLLM as the decoding engine, checked against the Hugging Face path in float32 on a CPU: the mixture as paired
requests gives the ids (and stored top-k and tail) of redumix's own decode loop, a sampled redo does not depend on
the batch, and a pair that vLLM splits is detected and retried. Skipped where vLLM is not installed (`make vllm`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment; `make vllm` adds it")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from redumix.generate.mixture import mixture_loop  # noqa: E402
from redumix.generate.plain import generate_batch  # noqa: E402
from redumix.generate.policy import SamplingPolicy  # noqa: E402
from redumix.generate.state import prefill  # noqa: E402
from redumix.generate.vllm_engine import VllmEngine, VllmSettings  # noqa: E402

STOP, PAD, MAX_NEW = [1], 0, 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Llama with head_dim 64 (vLLM's CPU attention rejects the embedded model's 24). initializer_range
    0.2 makes its next-token distributions peaked, so float32 rounding between the two engines cannot flip an
    argmax."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    folder = tmp_path_factory.mktemp("llama64")
    LlamaForCausalLM(config).float().eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    return VllmEngine(model_dir, VllmSettings(max_num_seqs=16, kv_cache_gib=1), "float32", seed=0)


def _prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(2, 512, (k,), generator=g).tolist() for k in lengths]


X, X2 = _prompts(4, 8, 30, 1), _prompts(4, 40, 90, 2)
SEEDS = [11, 22, 33, 44]


def _hf_mix(model, lam, policy, x=X, x2=X2, seeds=SEEDS):
    with torch.no_grad():
        return mixture_loop(model, prefill(model, x, PAD), prefill(model, x2, PAD), lam, 5, policy,
                            torch.tensor(seeds), STOP, MAX_NEW)


def _greedy(model, prompts):
    with torch.no_grad():
        return [g.token_ids for g in generate_batch(model, prompts, SamplingPolicy(), [0] * len(prompts), STOP, PAD,
                                                    MAX_NEW)]


def test_lambda_one_is_greedy_x_and_zero_is_greedy_x2(engine, hf_model):
    greedy = SamplingPolicy(max_new_tokens=MAX_NEW)
    at_one = engine.mix(X, X2, SEEDS, 1.0, 5, greedy, STOP, MAX_NEW)
    at_zero = engine.mix(X, X2, SEEDS, 0.0, 5, greedy, STOP, MAX_NEW)
    assert [r.generation.token_ids for r in at_one] == _greedy(hf_model, X)
    assert [r.generation.token_ids for r in at_zero] == _greedy(hf_model, X2)
    assert engine.generate(X, SEEDS, greedy, STOP, MAX_NEW)[0].token_ids == _greedy(hf_model, X)[0]


def test_lambda_half_matches_the_hf_mixture_loop_with_its_stored_targets(engine, hf_model):
    greedy = SamplingPolicy(max_new_tokens=MAX_NEW)
    ours = engine.mix(X, X2, SEEDS, 0.5, 5, greedy, STOP, MAX_NEW)
    theirs = _hf_mix(hf_model, 0.5, greedy)
    for r, (gen, ids, lps, tail) in zip(ours, theirs, strict=True):
        assert r.generation.token_ids == gen.token_ids
        assert r.topk_ids == ids
        assert torch.allclose(torch.tensor(r.topk_logprobs), torch.tensor(lps), atol=1e-4)
        assert torch.allclose(torch.tensor(r.tail_logprobs), torch.tensor(tail), atol=1e-4)
        assert r.retries == 0


def test_sampled_redo_is_the_same_whatever_else_is_in_the_batch(engine, hf_model):
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=MAX_NEW)
    alone = engine.mix(X[:1], X2[:1], SEEDS[:1], 0.5, 5, policy, STOP, MAX_NEW)[0]
    crowd = engine.mix(X[::-1], X2[::-1], SEEDS[::-1], 0.5, 5, policy, STOP, MAX_NEW)[-1]
    assert alone.generation.token_ids == crowd.generation.token_ids
    # and it is the Hugging Face harvest's draw: the same noise of (seed, output index)
    assert alone.generation.token_ids == _hf_mix(hf_model, 0.5, policy)[0][0].token_ids
    sampled = engine.generate(X, SEEDS, policy, STOP, MAX_NEW)
    with torch.no_grad():
        hf = generate_batch(hf_model, X, policy, SEEDS, STOP, PAD, MAX_NEW)
    assert [g.token_ids for g in sampled] == [g.token_ids for g in hf]


def test_a_forced_split_is_detected_and_retried_to_the_unforced_rows(engine, model_dir):
    """A 64-token step budget chunks x2's prefill, so x draws before x2 is ready: every pair splits at first."""
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=MAX_NEW)
    unforced = engine.mix(X, X2, SEEDS, 0.5, 5, policy, STOP, MAX_NEW)
    tight = VllmEngine(model_dir, VllmSettings(max_num_seqs=16, max_num_batched_tokens=64, kv_cache_gib=1),
                       "float32", seed=0)
    forced = tight.mix(X, X2, SEEDS, 0.5, 5, policy, STOP, MAX_NEW)
    assert tight.retried_pairs >= 1
    assert any(r.retries for r in forced)
    for a, b in zip(forced, unforced, strict=True):
        assert a.generation.token_ids == b.generation.token_ids
        assert a.topk_ids == b.topk_ids
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-4)
