"""The embedded default's vocabulary: the hidden check-span markers and the chat format's special tokens.

The markers are the embedded model's own words. A model trained with them writes `<|reflect|>` check spans, and
the reflective decoder finds them by name through the tokenizer; nothing outside `embedded/` imports them.
"""

from __future__ import annotations

REFLECT_OPEN = "<|reflect|>"
REFLECT_CLOSE = "<|/reflect|>"

PAD, END, USER, ASSISTANT, SYSTEM = "<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [PAD, END, USER, ASSISTANT, SYSTEM, REFLECT_OPEN, REFLECT_CLOSE]

# Every turn opens and closes with a special token, and the tokenizer splits on special tokens before anything
# else, so a conversation's ids are exactly the concatenation of its turns' ids (the decoders rely on this).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}" + USER + "{{ message['content'] }}" + END +
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT + "{{ message['content'] }}" + END +
    "{%- elif message['role'] == 'system' -%}" + SYSTEM + "{{ message['content'] }}" + END +
    "{%- else -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)
