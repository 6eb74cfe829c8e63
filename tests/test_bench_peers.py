"""bench/bench_peers.py's comparisons (harvest_vs_hf.py, gkd_vs_trl.py) at toy sizes: both sides of each comparison
make the same product, so the ratios time the same work."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from bench.bench_decode import median_ratio
from bench.bench_peers import with_recipe_batch
from bench.gkd_vs_trl import LiveMixtureGKDTrainer, _training_rows, gkd_offline_vs_trl_live_teacher
from bench.harvest_split import split_harvest
from bench.harvest_vs_hf import (
    Forwards,
    Stages,
    counting,
    harvest_vs_hf_pipeline,
    hf_harvest,
    hf_redo,
    ours_harvest,
)
from bench.models import build_tiny_model
from redumix.generate.mixture import mixture_topk
from redumix.train.loss import select_targets, sparse_gkd_loss
from redumix.train.onpolicy import context_logits

PROMPTS = ["Tom has 12 apples and eats 5. How many are left?", "2 + 2?", "Ann buys 3 pens at 4 each. Cost?"]


def test_transformers_cfg_redo_equals_ours_given_our_x2(tiny_llama_chat_model):
    """Left-padded at batch 3: the same redo ids, top-k ids, log p_mix and tails (guidance_scale = λ is right)."""
    model, tokenizer = tiny_llama_chat_model
    with torch.no_grad():
        ours = ours_harvest(model, tokenizer, PROMPTS, Stages(8, 5))
        theirs = hf_redo(model, tokenizer, PROMPTS, [r.x2 for r in ours], 8)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.topk_ids == b.topk_ids
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-4)
        assert torch.allclose(torch.tensor(a.tail_logprobs), torch.tensor(b.tail_logprobs), atol=1e-4)


def test_harvest_comparison_runs_and_counts(tiny_llama_chat_model):
    model, tokenizer = tiny_llama_chat_model
    found = harvest_vs_hf_pipeline(model, tokenizer, batch=2, n=2, tokens=Stages(4, 6), repeats=1)
    assert found.ratio > 0
    assert found.rows_differ_same_x2 == 0
    assert found.rows_differ <= found.x2_differ  # a redo can differ only where its x2 did
    # Their CFG redo calls the model twice a token and every stage re-encodes its prompt; ours extends one cache.
    assert found.calls_ratio > 1
    assert found.positions_ratio > 1


def test_counting_sees_every_forward_generate_makes(tiny_llama_chat_model):
    model, tokenizer = tiny_llama_chat_model
    batch = tokenizer.pad({"input_ids": [[5, 6, 7], [8, 9]]}, return_tensors="pt", padding_side="left")
    seen = Forwards()
    with counting(model, seen), torch.no_grad():
        model(**batch)
        model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    assert (seen.calls, seen.positions) == (1 + 3, 2 * 3 + (2 * 3 + 2 * 1 + 2 * 1))
    model(**batch)  # the hook is gone afterwards
    assert seen.calls == 4


def test_live_teacher_loss_is_the_sparse_loss_at_full_k(tiny_tokenizer):
    """TRL's loss on the live p_mix equals ours on the stored p_mix when the top-k is the whole vocabulary."""
    student = build_tiny_model(tiny_tokenizer, arch="llama", seed=2)
    teacher = build_tiny_model(tiny_tokenizer, arch="llama", seed=3).eval()
    vocab = len(tiny_tokenizer)
    _, inputs = _training_rows(vocab, rows=2, x=3, x2=9, y=5)
    trainer = SimpleNamespace(teacher_model=teacher, lam=0.3, beta=0.0, temperature=1.0,
                              generalized_jsd_loss=LiveMixtureGKDTrainer.generalized_jsd_loss)
    theirs = LiveMixtureGKDTrainer.compute_loss(trainer, student, inputs)

    def split(ids: torch.Tensor, labels: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        cuts = [(row, int((label == -100).sum())) for row, label in zip(ids, labels, strict=True)]
        return [row[:n].tolist() for row, n in cuts], [row[n:].tolist() for row, n in cuts]

    xs, ys = split(inputs["input_ids"], inputs["labels"])
    x2s, _ = split(inputs["x2_input_ids"], inputs["x2_labels"])
    with torch.no_grad():
        logits = context_logits(teacher, xs + x2s, ys + ys, 0)
    stored = [mixture_topk(logits[i], logits[2 + i], 0.3, vocab) for i in range(2)]
    student_logits, _ = select_targets(student(input_ids=inputs["input_ids"]).logits, inputs["labels"])
    ours = sparse_gkd_loss(student_logits, torch.cat([top.indices for _, top, _ in stored]),
                           torch.cat([top.values for _, top, _ in stored]),
                           tail_logprob=torch.cat([tail for _, _, tail in stored]))
    assert math.isclose(theirs.item(), ours.item(), rel_tol=1e-4)


def test_gkd_comparison_trains_a_copy(tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer, arch="llama", seed=4)
    before = {name: weight.clone() for name, weight in model.state_dict().items()}
    pairs = gkd_offline_vs_trl_live_teacher(model, tiny_tokenizer, rows=2, x=4, x2=8, y=4, repeats=1)
    assert median_ratio(pairs.numerator, pairs.denominator, pairs.pairs) > 0
    # Both trainers stepped a copy: the harvest keys timed in the same rounds keep the model they were built on.
    assert all(torch.equal(before[name], weight) for name, weight in model.state_dict().items())


def test_a_recipe_batch_already_timed_is_not_timed_twice():
    runs = ((1, 8, 9), (16, 16, 5))
    assert with_recipe_batch(runs, 128, 5) == (*runs, (128, 128, 5))
    # A second (1, 1, 5) would give the key of (1, 8, 9) and replace it in the bench's dict of keys.
    assert with_recipe_batch(runs, 1, 5) == runs
    assert with_recipe_batch(runs, 16, 5) == runs


def test_harvest_split_times_every_forward_each_side_makes(tiny_llama_chat_model):
    """Their CFG redo's second forward, our prefills and extensions: each counted once, as prefill or decode."""
    model, tokenizer = tiny_llama_chat_model
    for harvest in (hf_harvest, ours_harvest):
        seen = Forwards()
        with counting(model, seen), torch.no_grad():
            split = split_harvest(model, tokenizer, PROMPTS[:2], Stages(4, 6), harvest)
        assert split.prefill_calls + split.decode_calls == seen.calls
        assert split.prefill_calls >= 1 and split.decode_calls >= 4 + 6 - 2  # the first token of a stage comes free
        assert 0 < split.prefill_seconds + split.decode_seconds <= split.wall
