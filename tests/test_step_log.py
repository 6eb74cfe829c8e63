"""The two bulk conversions a harvest step leans on: the decode loop's log turned into per-output lists
(`StepLog.per_row`, through `as_lists`), and a batch's chat-template pieces tokenized in one call
(`batch_template_pieces`). Each must give exactly what the one-value-at-a-time way gives."""

from __future__ import annotations

import copy

import pytest
import torch

from redumix.data.chat import batch_template_pieces, prompt_ids, template_pieces
from redumix.data.prompts import attempt_messages, redo_messages, reflect_messages
from redumix.generate.loop import StepLog, as_lists


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.float64, torch.bool, torch.bfloat16])
def test_as_lists_gives_the_values_tolist_gives(dtype):
    values = (torch.randn(7, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    assert as_lists(values) == values.tolist()
    assert as_lists(values[:, 2]) == values[:, 2].tolist()  # a strided view


def logged_steps(outputs: int, steps: int, k: int) -> tuple[StepLog, list[tuple[list, ...]]]:
    """A log as a loop with compaction writes it: rows drop out as their outputs finish, the survivors keep their
    order, and a row's last step is logged with it dead. Returns the log and each output's values, one at a time."""
    rng = torch.Generator().manual_seed(1)
    log, expected = StepLog(), [([], [], []) for _ in range(outputs)]
    rows = [3, 0, 4, 1, 2, 5][:outputs]  # the batch's order need not be the outputs'
    for step in range(steps):
        alive = torch.rand(len(rows), generator=rng) > 0.15
        tokens = torch.randint(0, 50, (len(rows),), generator=rng)
        top = torch.randn(len(rows), k, generator=rng)
        tail = torch.randn(len(rows), generator=rng).to(torch.bfloat16)
        log.add(list(rows), alive, tokens, top, tail)
        for i, row in enumerate(rows):
            if alive[i]:
                for column, values in zip(expected[row], (tokens, top, tail), strict=True):
                    column.append(values[i].tolist())
        if step % 3 == 2:  # a compaction: the rows dead at this step leave
            rows = [row for i, row in enumerate(rows) if alive[i]]
    return log, expected


def test_the_log_per_output_is_every_value_it_was_alive_for_in_step_order():
    log, expected = logged_steps(outputs=6, steps=12, k=4)
    assert log.per_row(6) == [tuple(columns) for columns in expected]
    assert log.per_row(8)[6:] == [([], [], [])] * 2  # outputs the log never names still get their (empty) lists


def test_an_empty_log_gives_empty_lists_per_output():
    assert StepLog().per_row(3) == [(), (), ()]


def test_batch_pieces_equal_the_pieces_of_each_conversation(tiny_tokenizer):
    conversations = [
        attempt_messages("What is 3 + 4?"),
        reflect_messages("2 * 8 = ?", "2 * 8 = 18", "Wrong: the answer is not 18."),
        redo_messages("Tom has 12 apples.", "12 - 5 = 7", "Correct.", "I subtracted."),
    ]
    batched = batch_template_pieces(tiny_tokenizer, conversations)
    assert batched == [template_pieces(tiny_tokenizer, c) for c in conversations]
    for conversation, pieces in zip(conversations, batched, strict=True):
        # the pieces around the assistant's own ids are the whole conversation (the character-level tokenizer
        # splits alike wherever a text is cut)
        turns = [tiny_tokenizer(m["content"], add_special_tokens=False)["input_ids"]
                 for m in conversation if m["role"] == "assistant"]
        joined = pieces[0] + [i for turn, piece in zip(turns, pieces[1:], strict=True) for i in turn + piece]
        assert joined == prompt_ids(tiny_tokenizer, conversation)
    assert batch_template_pieces(tiny_tokenizer, []) == []


def test_batch_pieces_name_a_template_that_rewrites_assistant_turns(tiny_tokenizer):
    rewriting = copy.deepcopy(tiny_tokenizer)
    rewriting.chat_template = "{% for m in messages %}{{ m['content'] | replace('_', ' ') }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render assistant turns verbatim"):
        batch_template_pieces(rewriting, [attempt_messages("hi"), reflect_messages("2 * 8 = ?", "18", "Wrong.")])
