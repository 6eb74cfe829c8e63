from pathlib import Path

import pytest

from redumix.data.grading import extract_answer, is_correct, verifier_feedback
from redumix.data.gsm8k import load_gsm8k
from redumix.pipeline.config import load_config
from redumix.pipeline.resolve import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("so 3 + 4 = 7. The answer is 1,234.", "1234"),
        ("The final answer is $5.", "5"),
        ("We get \\boxed{42} at the end", "42"),
        ("first 12, then 7, finally -3", "-3"),
        ("#### 10\nThe answer is 11", "10"),  # `####` wins over later phrasings, as GSM8K's own format
        ("no number here", None),
    ],
)
def test_answer_extraction_follows_the_field(text, answer):
    assert extract_answer(text) == answer


def test_answers_compare_as_numbers():
    assert is_correct("The answer is 18.0", "18")
    assert is_correct("#### $1,000", "1000")
    assert not is_correct("The answer is 17", "18")
    assert not is_correct("nothing", "18")


def test_verifier_feedback_never_reveals_the_gold_answer():
    wrong = verifier_feedback("The answer is 17.", "98765")
    right = verifier_feedback("The answer is 98765.", "98765")
    assert "98765" not in wrong and "wrong" in wrong and "17" in wrong
    assert "correct" in right
    assert "could not find" in verifier_feedback("I give up", "3")


@pytest.mark.skipif(not GSM8K.is_dir(), reason="shared GSM8K files not present")
def test_gsm8k_loads_real_files_with_stable_ids():
    test = load_gsm8k(GSM8K / "test.jsonl")
    assert len(test) == 1319 and test[0].id == "gsm8k-test-00000" and test[0].reference == "18"
    assert all(e.reference.lstrip("-").replace(".", "").isdigit() for e in test)


def test_malformed_gsm8k_line_names_file_and_line(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n\n{"question": "broken"\n')
    with pytest.raises(ValueError, match=r"test.jsonl:3: not valid JSON"):
        load_gsm8k(path)
    path.write_text('{"question": "1 + 1?"}\n')
    with pytest.raises(ValueError, match=r"test.jsonl:1: expected an object"):
        load_gsm8k(path)
    with pytest.raises(FileNotFoundError, match="set task.gsm8k.path"):
        load_gsm8k(tmp_path / "missing.jsonl")


def test_recipe_errors_are_collected_and_name_file_and_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("harvest:\n  batch_sise: 4\n  n: many\nredumix:\n  lam: 1.5\nsampling:\n  top_p: 0.9\n")
    with pytest.raises(ConfigError) as error:
        load_config(recipe, ["train.beta=2", "nosuch.key=1"])
    message = str(error.value)
    assert f"{recipe}: unknown key 'harvest.batch_sise' (did you mean 'harvest.batch_size'?)" in message
    assert f"{recipe}: 'harvest.n' = 'many' is not int" in message
    assert "lam must be in [0, 1]" in message
    assert "command line: unknown key 'nosuch'" in message
    assert "command line" in message and "beta" in message
    assert len(message.splitlines()) == 6  # the header and all five problems, reported together


def test_overrides_win_over_the_recipe_and_types_are_coerced(tmp_path):
    recipe = tmp_path / "ok.yaml"
    recipe.write_text("name: mine\nredumix:\n  lam: 0.3\n")
    config = load_config(recipe, ["redumix.lam=0.6", "sampling.temperature=1", "eval.decoders=[greedy, moi]"])
    assert config.name == "mine" and config.redumix.lam == 0.6
    assert config.sampling.temperature == 1.0 and isinstance(config.sampling.temperature, float)
    assert config.eval.decoders == ["greedy", "moi"]
    with pytest.raises(ConfigError, match="not valid YAML"):
        recipe.write_text("a: [\n")
        load_config(recipe)
