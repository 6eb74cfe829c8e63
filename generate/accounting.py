"""Compute accounting. FPE (forward-pass equivalents) counts every token position the model processes once.

`ForwardCounter` is the independent check: a forward pre-hook on the model that counts the non-padding positions
of every call. Each decoder reports its own per-example FPE; tests assert the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Usage:
    """Per-example token accounting shared by every decoder."""

    visible_tokens: int = 0  # tokens the user sees in the final answer
    generated_tokens: int = 0  # every sampled token, hidden or visible, in every call
    prefill_tokens: int = 0  # prompt positions processed (not counting cache reuse)
    fpe: int = 0  # all positions processed: prefill + decode steps, in every context

    def add(self, other: Usage) -> None:
        self.visible_tokens += other.visible_tokens
        self.generated_tokens += other.generated_tokens
        self.prefill_tokens += other.prefill_tokens
        self.fpe += other.fpe


class ForwardCounter:
    """Counts the non-padding token positions that go through `model.forward`, across all calls.

    Use as a context manager. The count is read from the call's inputs: `attention_mask[:, -T:]` when given
    (T = new positions; a 4D mask's last query row), else every position of input_ids / inputs_embeds.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tokens = 0
        self.calls = 0
        self._handle = None

    def _hook(self, module, args, kwargs) -> None:
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        new_positions = inputs.shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            self.tokens += int(mask[:, -new_positions:].sum())
        elif mask is not None and mask.dim() == 4:
            # A 4D mask (state.step_mask, the static cache): its last query row sees every real new position, so the
            # new positions' own columns there say which are real (bool: True; additive: 0).
            own = mask[:, 0, -1, -new_positions:]
            self.tokens += int((own if own.dtype == torch.bool else own == 0).sum())
        else:
            self.tokens += int(inputs.shape[0] * new_positions)
        self.calls += 1

    def __enter__(self) -> ForwardCounter:
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
