"""Speculative Thinking: the handover is exact against a cache-free reference (the guide continues from the small
model's exact tokens and back), FPE per model equals a forward-hook count, the random ablation follows its seed,
a trigger that never fires is the small model's greedy, and the decoders reach the eval report through the table."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from bench.models import build_tiny_model, seeded_model, tiny_shape
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.tasks import make_task
from redumix.generate.accounting import ForwardCounter
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import load_model, load_tokenizer
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy, uniform_noise
from redumix.generate.speculative import (
    SpeculativeConfig,
    ends_with_delimiter,
    handover_noise,
    opens_with_trigger,
    speculative_generate,
)
from redumix.pipeline.config import REPO, load_config
from redumix.pipeline.decoders import DECODERS, make_decoder
from redumix.pipeline.eval import run_eval
from redumix.pipeline.report import report_markdown, summarize
from redumix.pipeline.run import RunDir
from tests.conftest import one_thread

ROOT = Path(__file__).resolve().parents[1]
TINY_BASE = ROOT / "models" / "tiny-base"
QUESTIONS = ["What is 2 + 3?", "Tom has 7 apples and eats 2. How many are left?", "9 * 4 = ?",
             "A train leaves at 3 and arrives at 7; how long is the trip?"]
SEEDS = [11, 12, 13, 14]
MAX_NEW = 40


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _random_model(tokenizer, arch: str, seed: int, hidden: int):
    # Weights 10x the usual init scale: a random model whose next token depends on more than the last one, so that a
    # token the catch-up missed changes what it writes.
    return seeded_model(arch, seed, **tiny_shape(hidden), vocab_size=len(tokenizer), max_position_embeddings=512,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                        initializer_range=0.2).eval()


@pytest.fixture(scope="module")
def char_pair(tiny_tokenizer):
    """(small, guide, tokenizer): a random Qwen2 of hidden 16 and a random Llama of hidden 32 over the tests'
    character-level tokenizer."""
    return _random_model(tiny_tokenizer, "qwen2", 3, 16), _random_model(tiny_tokenizer, "llama", 4, 32), tiny_tokenizer


@pytest.fixture(scope="module")
def bpe_pair():
    """(small, guide, tokenizer): the shipped embedded base (trained, byte-level BPE) and a random Llama guide of
    hidden 128 over its tokenizer."""
    small, tokenizer = load_model(TINY_BASE)
    guide = seeded_model("llama", 7, **tiny_shape(128), vocab_size=small.config.vocab_size,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None).eval()
    return small, guide, tokenizer


def _prompts(tokenizer) -> list[list[int]]:
    return [prompt_ids(tokenizer, attempt_messages(q)) for q in QUESTIONS]


def _greedy(model, tokenizer, prompts, stop_ids, max_new=MAX_NEW):
    return generate_batch(model, prompts, SamplingPolicy(max_new_tokens=max_new), [0] * len(prompts), stop_ids,
                          tokenizer.pad_token_id)


def _common_chars(model, tokenizer, prompts, count: int) -> list[str]:
    """The `count` visible characters a random model's greedy answers hold most: delimiters that do occur."""
    texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in _greedy(model, tokenizer, prompts, [-1])]
    return [c for c, _ in Counter("".join(texts)).most_common(count)]


def _char_setup(char_pair):
    """Prompts, stop ids and delimiters for the random pair: a stop id the small model does emit (rows end at
    different steps), and delimiters that both models write."""
    small, guide, tokenizer = char_pair
    prompts = _prompts(tokenizer)
    plain = _greedy(small, tokenizer, prompts, [-1], max_new=12)
    stop_ids = [tokenizer.eos_token_id, plain[0].token_ids[9]]
    delimiters = _common_chars(small, tokenizer, prompts, 3) + _common_chars(guide, tokenizer, prompts, 2)
    return prompts, stop_ids, delimiters


# --- the cache-free reference ---------------------------------------------------------------------------------------


def _next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def reference(small, guide, tokenizer, prompt, seed, stop_ids, config: SpeculativeConfig, max_new: int) -> dict:
    """One example on its own, every next token from the whole sequence with no cache, by the rules written out
    plainly: at a delimiter point (the whole answer decoded ends with a delimiter) the small model's argmax is
    judged; a handover lets the guide write until a delimiter, a stop, the cap or the length limit."""
    tokens: list[int] = []
    guide_tokens = steps = points = 0
    in_step, step_len, at_point = False, 0, False
    while not tokens or (tokens[-1] not in stop_ids and len(tokens) < max_new):
        if not in_step:
            logits = _next_logits(small, prompt + tokens)
            token = int(logits.argmax())
            if at_point:
                points += 1
                if config.random_rate is not None:
                    fire = handover_noise(torch.tensor([seed]), torch.tensor([len(tokens)]))[0] < config.random_rate
                else:
                    text = tokenizer.decode([token], skip_special_tokens=False).strip()
                    word = text != "" and any(t.startswith(text) or text.startswith(t) for t in config.triggers)
                    fire = word or float(torch.softmax(logits, -1).max()) < config.uncertainty
                if fire:
                    steps, in_step, step_len = steps + 1, True, 0
            if not in_step:
                tokens.append(token)
                at_point = tokenizer.decode(tokens, skip_special_tokens=False).endswith(tuple(config.delimiters))
                continue
        tokens.append(int(_next_logits(guide, prompt + tokens).argmax()))
        guide_tokens, step_len = guide_tokens + 1, step_len + 1
        at_point = tokenizer.decode(tokens, skip_special_tokens=False).endswith(tuple(config.delimiters))
        if at_point or step_len >= config.max_guide_tokens or tokens[-1] in stop_ids:
            in_step = False
    return {"tokens": tokens, "tokens_guide": guide_tokens, "guide_steps": steps, "delimiter_points": points}


def _ending_early(small, guide, tokenizer, prompts, stop_ids, config, max_new) -> list[int]:
    """`stop_ids` and a token the first answer holds early: a row's text up to a stop does not depend on the stop
    ids, so with it the rows end at different steps, some of them while others go on."""
    first = speculative_generate(small, guide, tokenizer, prompts, SEEDS, stop_ids, config, max_new)[0]
    return [*stop_ids, first.token_ids[min(9, len(first.token_ids) - 1)]]


def _check_against_reference(small, guide, tokenizer, prompts, stop_ids, config, max_new=MAX_NEW):
    stop_ids = _ending_early(small, guide, tokenizer, prompts, stop_ids, config, max_new)
    results = speculative_generate(small, guide, tokenizer, prompts, SEEDS, stop_ids, config, max_new)
    for result, prompt, seed in zip(results, prompts, SEEDS, strict=True):
        ref = reference(small, guide, tokenizer, prompt, seed, stop_ids, config, max_new)
        assert result.token_ids == ref["tokens"]
        extra = result.extra()
        assert {k: extra[k] for k in ("tokens_guide", "guide_steps", "delimiter_points")} == {
            k: ref[k] for k in ("tokens_guide", "guide_steps", "delimiter_points")}
        assert extra["tokens_small"] + extra["tokens_guide"] == len(result.token_ids) == result.usage.visible_tokens
    # Not vacuous: handovers happened, both models wrote, and rows ended at different lengths.
    assert sum(r.guide_steps for r in results) >= 3
    assert all(sum(r.extra()[k] for r in results) > 0 for k in ("tokens_small", "tokens_guide"))
    assert len({len(r.token_ids) for r in results}) > 1
    return results


def test_handover_is_exact_when_every_delimiter_hands_over(char_pair):
    small, guide, tokenizer = char_pair
    prompts, stop_ids, delimiters = _char_setup(char_pair)
    config = SpeculativeConfig(delimiters=delimiters, triggers=[], uncertainty=1.0, max_guide_tokens=3)
    results = _check_against_reference(small, guide, tokenizer, prompts, stop_ids, config)
    assert sum(r.guide_steps for r in results) == sum(r.delimiter_points for r in results)  # uncertainty 1: always


def test_handover_is_exact_with_a_trigger_word(char_pair):
    small, guide, tokenizer = char_pair
    prompts, stop_ids, delimiters = _char_setup(char_pair)
    # A word that opens with a character the small model writes after a delimiter: it fires at some points only.
    plain = SpeculativeConfig(delimiters=delimiters, triggers=[], max_guide_tokens=4)
    after = Counter()
    for g in _greedy(small, tokenizer, prompts, stop_ids):
        for k in range(1, len(g.token_ids)):
            if ends_with_delimiter(tokenizer, g.token_ids[:k], plain.delimiters):
                after[tokenizer.decode([g.token_ids[k]])] += 1
    word = next(c for c, _ in after.most_common() if c.strip()) + "ait"
    config = dataclasses.replace(plain, triggers=[word])
    results = _check_against_reference(small, guide, tokenizer, prompts, stop_ids, config)
    assert sum(r.guide_steps for r in results) < sum(r.delimiter_points for r in results)


def test_handover_is_exact_on_the_embedded_base_with_its_bpe_tokenizer(bpe_pair):
    small, guide, tokenizer = bpe_pair
    task = make_task(load_config("tiny").task, 0)
    prompts = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in task.examples("test", len(SEEDS))]
    stop_ids = [tokenizer.eos_token_id]
    # Steps begin at a new line or after " = " (the embedded world's delimiters); the trained model is unsure at some.
    config = SpeculativeConfig(delimiters=["\n", " = "], triggers=["<|reflect|>"], uncertainty=0.9,
                               max_guide_tokens=2)
    results = _check_against_reference(small, guide, tokenizer, prompts, stop_ids, config, max_new=32)
    assert sum(r.guide_steps for r in results) < sum(r.delimiter_points for r in results)


def test_a_guide_that_is_the_small_model_changes_nothing(bpe_pair):
    small, _, tokenizer = bpe_pair
    task = make_task(load_config("tiny").task, 0)
    prompts = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in task.examples("test", 8)]
    stop_ids = [tokenizer.eos_token_id]
    config = SpeculativeConfig(delimiters=["\n", " = "], triggers=[], uncertainty=0.9, max_guide_tokens=3)
    results = speculative_generate(small, small, tokenizer, prompts, SEEDS * 2, stop_ids, config, 48)
    assert [r.token_ids for r in results] == [g.token_ids for g in _greedy(small, tokenizer, prompts, stop_ids, 48)]
    assert sum(r.guide_steps for r in results) > 0


# --- accounting -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("uncertainty", [1.0, 0.0])
def test_fpe_per_model_equals_the_forward_counter(char_pair, uncertainty):
    small, guide, tokenizer = char_pair
    prompts, stop_ids, delimiters = _char_setup(char_pair)
    config = SpeculativeConfig(delimiters=delimiters, triggers=[], uncertainty=uncertainty, max_guide_tokens=3)
    with ForwardCounter(small) as small_count, ForwardCounter(guide) as guide_count:
        results = speculative_generate(small, guide, tokenizer, prompts, SEEDS, stop_ids, config, MAX_NEW)
    assert small_count.tokens == sum(r.fpe_small for r in results)
    assert guide_count.tokens == sum(r.fpe_guide for r in results)
    assert all(r.usage.fpe == r.fpe_small + r.fpe_guide for r in results)
    for r, prompt in zip(results, prompts, strict=True):
        # Each model reads the prompt once (the guide only if it joined) and never the last token of the answer.
        joined = r.fpe_guide > 0
        assert r.usage.prefill_tokens == len(prompt) * (1 + joined)
        assert r.fpe_small <= len(prompt) + len(r.token_ids) - 1
        assert r.fpe_guide <= joined * (len(prompt) + len(r.token_ids) - 1)
    if uncertainty == 0.0:  # nothing hands over: the guide never runs
        assert guide_count.tokens == 0 and guide_count.calls == 0


# --- the rules and the ablation -------------------------------------------------------------------------------------


def test_no_handover_is_the_small_models_greedy(char_pair):
    small, guide, tokenizer = char_pair
    prompts, stop_ids, delimiters = _char_setup(char_pair)
    plain = _greedy(small, tokenizer, prompts, stop_ids)
    for config in [SpeculativeConfig(delimiters=delimiters, triggers=["§§"], uncertainty=0.0),
                   SpeculativeConfig(delimiters=delimiters, uncertainty=1.0, random_rate=0.0)]:
        results = speculative_generate(small, guide, tokenizer, prompts, SEEDS, stop_ids, config, MAX_NEW)
        assert [r.token_ids for r in results] == [g.token_ids for g in plain]
        assert [r.usage.fpe for r in results] == [g.usage.fpe for g in plain]
        assert all(r.guide_steps == r.tokens_guide == r.fpe_guide == 0 for r in results)
        assert sum(r.delimiter_points for r in results) > 0


def test_random_handovers_follow_the_seed(char_pair):
    small, guide, tokenizer = char_pair
    prompts, stop_ids, delimiters = _char_setup(char_pair)
    config = SpeculativeConfig(delimiters=delimiters, triggers=[], max_guide_tokens=3, random_rate=0.5)
    first = speculative_generate(small, guide, tokenizer, prompts, SEEDS, stop_ids, config, MAX_NEW)
    again = speculative_generate(small, guide, tokenizer, prompts[::-1], SEEDS[::-1], stop_ids, config, MAX_NEW)
    assert [r.token_ids for r in first] == [r.token_ids for r in again[::-1]]  # per example, whatever the batch
    steps, points = sum(r.guide_steps for r in first), sum(r.delimiter_points for r in first)
    assert 0 < steps < points
    for r, prompt, seed in zip(first, prompts, SEEDS, strict=True):
        assert r.token_ids == reference(small, guide, tokenizer, prompt, seed, stop_ids, config, MAX_NEW)["tokens"]
    always = speculative_generate(small, guide, tokenizer, prompts, SEEDS, stop_ids,
                                  dataclasses.replace(config, random_rate=1.0), MAX_NEW)
    assert all(r.guide_steps == r.delimiter_points for r in always)


def test_handover_noise_is_a_pure_function_of_seed_and_position():
    seeds, positions = torch.tensor([5, 5, 6]), torch.tensor([3, 4, 3])
    noise = handover_noise(seeds, positions)
    assert noise.tolist() == [handover_noise(seeds[i : i + 1], positions[i : i + 1])[0].item() for i in range(3)]
    assert len(set(noise.tolist())) == 3 and bool(((noise > 0) & (noise < 1)).all())
    assert not torch.equal(noise, uniform_noise(seeds, positions, 1)[:, 0])  # not the sampling noise's stream


def test_trigger_words_match_the_opening_token():
    assert opens_with_trigger("Wait", ["Wait"]) and opens_with_trigger(" Wa", ["Wait"])
    assert opens_with_trigger("Wait,", ["Wait"]) and opens_with_trigger(" Let", ["Let me check"])
    assert opens_with_trigger("<|reflect|>", ["<|reflect|>"])
    assert not opens_with_trigger("\n", ["Wait"]) and not opens_with_trigger("We", ["Wait"])
    assert not opens_with_trigger("Wait", [])


def test_delimiters_are_found_across_bpe_tokens(bpe_pair):
    _, _, tokenizer = bpe_pair
    ids = tokenizer("12 + 3 = 15\nThe answer is é ü", add_special_tokens=False)["input_ids"]
    for k in range(len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        for delimiters in (["\n"], [" = "], ["5\nThe"], ["é ü"], [" = 1", "is"]):
            assert ends_with_delimiter(tokenizer, ids[:k], delimiters) == (k > 0 and text.endswith(tuple(delimiters)))


def test_settings_are_checked():
    for bad, key in [({"delimiters": []}, "delimiters"), ({"delimiters": [""]}, "delimiters"),
                     ({"triggers": [" "]}, "triggers"), ({"uncertainty": 1.5}, "uncertainty"),
                     ({"max_guide_tokens": 0}, "max_guide_tokens"), ({"random_rate": -0.1}, "random_rate")]:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig(**bad)


# --- the decoders in the table, and the report ----------------------------------------------------------------------


def _config(small_dir, guide_dir, *more):
    return load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={small_dir}", f"speculative.guide_path={guide_dir}", "sampling.max_new_tokens=12",
        "eval.batch_size=2", "eval.n=4", "eval.n_other=3", "eval.checkpoints=[base]", "speculative.uncertainty=1.0",
        "speculative.max_guide_tokens=2", *more])


@pytest.fixture(scope="module")
def guide_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("guide")
    build_tiny_model(tiny_tokenizer, seed=4, hidden=48).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_decoders_reach_the_eval_report_with_the_guide_share(tmp_path, tiny_model_dir, guide_dir):
    small, tokenizer = load_model(tiny_model_dir)
    prompts = _prompts(tokenizer)
    delimiters = _common_chars(small, tokenizer, prompts, 4)
    config = _config(tiny_model_dir, guide_dir, f"speculative.delimiters={json.dumps(delimiters)}",
                     "eval.decoders=[greedy, guide-greedy, speculative-thinking, speculative-random]")
    run_eval(config, RunDir(tmp_path))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    rows = {r["decoder"]: r for r in report["rows"]}
    assert list(rows) == ["greedy", "guide-greedy", "speculative-thinking", "speculative-random"]
    assert "fpe_guide" not in rows["greedy"]
    assert rows["guide-greedy"]["guide_share"] == 1.0 and rows["guide-greedy"]["fpe_small"] == 0
    thinking = rows["speculative-thinking"]
    assert 0 < thinking["guide_share"] < 1 and thinking["fpe_guide"] > 0 and thinking["fpe_small"] > 0
    assert thinking["fpe_small"] + thinking["fpe_guide"] == pytest.approx(thinking["mean_fpe"])
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "| base | speculative-thinking | FPE small " in markdown and "guide share" in markdown
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--speculative-random.jsonl").open()]
    assert all(r["extra"]["guide_steps"] <= r["extra"]["delimiter_points"] for r in records)


def test_random_ablation_is_matched_to_speculative_thinkings_budget(tiny_model_dir, guide_dir):
    config = _config(tiny_model_dir, guide_dir)
    with pytest.raises(ValueError, match="list 'speculative-thinking' before it"):
        make_decoder(config, "speculative-random", {})
    earlier = {"speculative-thinking": [{"extra": {"guide_steps": 1, "delimiter_points": 4}},
                                        {"extra": {"guide_steps": 2, "delimiter_points": 4}}]}
    ablation = make_decoder(config, "speculative-random", earlier)
    assert ablation.config.random_rate == pytest.approx(3 / 8)
    assert make_decoder(config, "speculative-thinking", earlier).config.random_rate is None


def test_guide_path_errors_name_the_key(tmp_path, tiny_model_dir, monkeypatch):
    unset = dataclasses.replace(_config(tiny_model_dir, "x"), speculative=SpeculativeConfig())
    for name in ("speculative-thinking", "guide-greedy"):
        with pytest.raises(ValueError, match="speculative.guide_path is not set"):
            make_decoder(unset, name, {})
    with pytest.raises(ValueError, match="speculative.guide_path=nowhere: no model there"):
        make_decoder(_config(tiny_model_dir, "nowhere"), "speculative-thinking", {})
    # A relative path is read from the repository when it is not in the working directory, as embedded.shipped is.
    monkeypatch.chdir(tmp_path)
    decoder = make_decoder(_config(tiny_model_dir, "models/tiny-base"), "speculative-thinking", {})
    assert decoder.guide == str(TINY_BASE)
    # ... and a guide must share the model's tokenizer.
    small, tokenizer = load_model(tiny_model_dir)
    with pytest.raises(ValueError, match="the guide's tokenizer is not the model's"):
        decoder(HfEngine(small, tokenizer), [], make_task(unset.task, 0))


def test_the_guide_is_loaded_once_on_the_models_device_and_dtype(tiny_model_dir, guide_dir):
    from redumix.generate.speculative import load_guide

    small, tokenizer = load_model(tiny_model_dir)
    first = load_guide(guide_dir, "id", small, tokenizer)
    assert load_guide(guide_dir, "id", small, tokenizer) is first
    assert first.device == small.device and first.dtype == small.dtype
    assert load_tokenizer(guide_dir).get_vocab() == tokenizer.get_vocab()


def test_the_report_rows_of_other_decoders_are_unchanged():
    records = [{"id": str(i), "correct": i % 2 == 0, "tokens": 10, "fpe": 30, "prefill_tokens": 20, "seconds": 0.1,
                "extra": {}} for i in range(4)]
    speculative = [dict(r, extra={"fpe_small": 20, "fpe_guide": 10, "tokens_small": 6, "tokens_guide": 4,
                                  "guide_steps": 2, "delimiter_points": 5, "guide_share": 0.4}) for r in records]
    plain_row = summarize("base", "greedy", records)
    row = summarize("base", "speculative-thinking", speculative, greedy=records,
                    details=DECODERS["speculative-thinking"].details)
    assert not {"fpe_small", "fpe_guide", "tokens_small", "tokens_guide", "guide_share"} & set(plain_row)
    assert (row["fpe_small"], row["fpe_guide"], row["tokens_small"], row["tokens_guide"]) == (20, 10, 6, 4)
    assert row["guide_share"] == pytest.approx(0.4) and row["guide_steps_per_example"] == 2
    report = {"task": "arith", "split": "test", "rows": [plain_row, row], "diagnostics": {}}
    assert ("| base | speculative-thinking | FPE small 20 + guide 10; tokens small 6.0 + guide 4.0 (guide share "
            "40.0%); 2.00 guide steps at 5.00 delimiter points per example |") in report_markdown(report)


def test_the_tiny_recipes_guide_is_shipped_with_the_bases_tokenizer_at_about_four_times_its_size():
    """recipes/tiny.yaml points speculative.guide_path at models/tiny-guide, which `make guide` builds: the same
    tokenizer and chat format as the shipped base, about 4x its parameters, and the build settings `make guide`
    passes."""
    config = load_config("tiny", [])
    guide, base = Path(REPO) / config.speculative.guide_path, Path(REPO) / "models" / "tiny-base"
    assert (guide / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert (guide / "chat_template.jinja").read_text() == (base / "chat_template.jinja").read_text()
    sizes = [json.loads((folder / "metrics.json").read_text())["build"]["parameters"] for folder in (guide, base)]
    assert 3 <= sizes[0] / sizes[1] <= 5
    makefile = (Path(REPO) / "Makefile").read_text()
    settings = makefile.split("GUIDE_SETTINGS := ")[1].splitlines()[0].split()
    built = (guide / "build_config.yaml").read_text()
    for setting in settings:
        key, value = setting.split("=")
        if key != "embedded.shipped":
            assert f"{key.split('.')[1]}: {value}" in built, setting
