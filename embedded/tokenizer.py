"""The embedded base's tokenizer: byte-level BPE trained on its corpus, where every digit is its own token.

It is wrapped as a `PreTrainedTokenizerFast` with the chat template of embedded/vocab.py, whose turn boundaries are
special tokens, so rendering is token-concatenative across turns.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from redumix.embedded.corpus import Episode
from redumix.embedded.vocab import (
    ASSISTANT,
    CHAT_TEMPLATE,
    END,
    PAD,
    REFLECT_CLOSE,
    REFLECT_OPEN,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE where every digit is its own token, wrapped with the chat template and special tokens."""
    tok = Tokenizer(models.BPE())
    # Digits are isolated first, so no merge can span them; between digits, ByteLevel keeps runs whole, which lets
    # frequent pieces such as " = " become single tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=END, extra_special_tokens=[USER, ASSISTANT, SYSTEM,
                                                                                  REFLECT_OPEN, REFLECT_CLOSE],
        chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=1 << 30,
    )


def episode_texts(episodes: list[Episode]) -> list[str]:
    return [m["content"] for e in episodes for m in e.messages]


def corpus_tokenizer(episodes: list[Episode], vocab_size: int) -> PreTrainedTokenizerFast:
    """The tokenizer a build trains: on the texts of its first episodes and the chat template's own text."""
    return train_tokenizer(episode_texts(episodes) + [CHAT_TEMPLATE], vocab_size)
