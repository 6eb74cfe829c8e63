"""`model.dtype`: 'auto' picks bfloat16 only where the hardware computes it, the embedded recipe stays float32, and
with bfloat16 weights the mixture, its stored top-k log-probs and tail, and the training loss are float32 maths over
the bfloat16 logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.models import build_tiny_model
from redumix.generate.mixture import mixture_loop
from redumix.generate.model_io import ModelConfig, cpu_has_bf16, load_model, resolve_dtype
from redumix.generate.policy import SamplingPolicy
from redumix.generate.state import clone, prefill
from redumix.pipeline.config import load_config
from redumix.train.loss import sparse_gkd_loss

ROOT = Path(__file__).resolve().parents[1]


def test_auto_is_bfloat16_only_on_a_cpu_with_bf16_in_hardware(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32 and resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: False, raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert not cpu_has_bf16() and resolve_dtype("auto", cpu) == torch.float32  # emulated bf16 is slower
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert resolve_dtype("auto", cpu) == torch.bfloat16


def test_the_default_and_the_embedded_recipe_stay_float32():
    """What has been measured on the embedded model was float32; 'auto' is for the real-model recipes."""
    assert ModelConfig().dtype == "float32"
    assert load_config(ROOT / "recipes" / "tiny.yaml").model.dtype == "float32"


def test_auto_loads_the_weights_in_the_dtype_it_resolves_to(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, ModelConfig(dtype="auto", device="cpu"))
    assert next(model.parameters()).dtype == resolve_dtype("auto", torch.device("cpu"))


def reference_mixture(logits_x: torch.Tensor, logits_x2: torch.Tensor, lam: float, k: int):
    """log p_mix, its top-k and tail in float64 over the given logits: the maths the harvest must match."""
    mix = torch.log_softmax(lam * torch.log_softmax(logits_x.double(), -1)
                            + (1 - lam) * torch.log_softmax(logits_x2.double(), -1), -1)
    top = mix.topk(k, dim=-1)
    return top, torch.logsumexp(mix.scatter(-1, top.indices, float("-inf")), -1)


def test_a_bf16_model_mixes_stores_and_sums_its_tail_in_float32(tiny_tokenizer):
    """The redo's stored top-k and tail equal float64 maths over the very bf16 logits the model gave, to float32's
    precision, where the same maths in bf16 would be off by far more."""
    model = build_tiny_model(tiny_tokenizer, seed=5).to(torch.bfloat16)
    seen: list[torch.Tensor] = []  # every lm_head output: [rows, 1, V] in bf16
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out[:, -1]))
    xs = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
    x2s = [x + list(range(20, 20 + 5 + i)) for i, x in enumerate(xs)]
    lam, k, steps = 0.5, 8, 6
    try:
        pad = tiny_tokenizer.pad_token_id
        x_state, x2_state = prefill(model, xs, pad), prefill(model, x2s, pad)
        assert x_state.last_logits.dtype == torch.float32
        redo = mixture_loop(model, clone(x_state), x2_state, lam, k, SamplingPolicy(max_new_tokens=steps),
                            torch.zeros(3, dtype=torch.long), stop_ids=[tiny_tokenizer.pad_token_id])
    finally:
        handle.remove()
    assert all(len(gen.token_ids) == steps for gen, *_ in redo)  # no row stopped, so every step has all rows
    assert all(t.dtype == torch.bfloat16 for t in seen)
    step_logits = [torch.cat(seen[:2]), *seen[2:]]  # step 0 mixes the two prefills' logits, then one call a step
    worst, worst_bf16 = 0.0, 0.0
    for t, logits in enumerate(step_logits[:steps]):
        top, tail = reference_mixture(logits[:3], logits[3:], lam, k)
        for i, (gen, ids, logprobs, tails) in enumerate(redo):
            assert ids[t] == top.indices[i].tolist() and gen.token_ids[t] == ids[t][0]
            worst = max(worst, (torch.tensor(logprobs[t]) - top.values[i]).abs().max().item(),
                        abs(tails[t] - tail[i].item()))
        in_bf16 = torch.log_softmax(lam * torch.log_softmax(logits[:3], -1)
                                    + (1 - lam) * torch.log_softmax(logits[3:], -1), -1)
        worst_bf16 = max(worst_bf16, (in_bf16.gather(-1, top.indices).double() - top.values).abs().max().item())
    assert worst < 1e-5
    assert worst_bf16 > 100 * worst  # the check tells float32 maths from bf16 maths


def test_the_training_loss_of_bf16_logits_is_the_float32_loss():
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 50)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (5, 4))
    teacher = torch.log_softmax(torch.randn(5, 4), -1) - 0.1
    tail = torch.full((5,), -2.3)
    assert sparse_gkd_loss(logits, ids, teacher, tail_logprob=tail).dtype == torch.float32
    assert torch.equal(sparse_gkd_loss(logits, ids, teacher, tail_logprob=tail),
                       sparse_gkd_loss(logits.float(), ids, teacher, tail_logprob=tail))


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-gsm8k", "qwen2.5-coder-0.5b-constraints",
                                  "qwen2.5-coder-1.5b-gsm8k", "qwen2.5-coder-1.5b-constraints"])
def test_the_real_model_recipes_ask_for_auto(name):
    assert load_config(ROOT / "recipes" / f"{name}.yaml").model.dtype == "auto"
