"""On-policy mixture distillation: the student samples y from x, and the teacher's p_mix is computed live.

The teacher is the frozen starting model under the two contexts of the harvested row: x, and x2 = [x ‖ y1 ‖ r ‖ c ‖
REDO] with the ids the harvest cached (column `x2_token_ids`). At every token of the student's own y it gives
p_mix = softmax(λ·log p(·|x, y<t) + (1−λ)·log p(·|x2, y<t)), reduced to the same top-k + tail the harvest stores
(`generate.mixture.mixture_topk`, the function the harvest's decode loop calls). The batch it returns has the
layout of a stored batch, so the trainer's sparse loss reads both alike.

With LoRA the frozen starting model is the student with its adapter disabled, which costs no second copy; with
full fine-tuning it is a separate frozen copy loaded from the starting model's folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from redumix.generate.mixture import mixture_topk
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy, example_seed
from redumix.train.data import SparseTeacherCollator


@dataclass
class LiveMixtureTeacher:
    frozen: torch.nn.Module | None  # the starting model (full fine-tuning); None: the student, adapter disabled
    topk: int
    policy: SamplingPolicy  # how the student samples y
    stop_ids: Sequence[int]
    pad_token_id: int
    max_length: int
    seed: int

    def on_policy_batch(self, student: torch.nn.Module, inputs: dict[str, torch.Tensor], step: int) -> dict:
        """Replace the batch's y by the student's samples from x, with the live p_mix at each of their tokens."""
        prompts = [row[:n].tolist() for row, n in zip(inputs["input_ids"], inputs["prompt_lengths"], strict=True)]
        x2s = [row[:n].tolist() for row, n in zip(inputs["x2_ids"], inputs["x2_lengths"], strict=True)]
        seeds = [example_seed(self.seed, f"onpolicy/{step}/{i}") for i in range(len(prompts))]
        was_training = student.training
        student.eval()  # no dropout while sampling
        try:
            samples = generate_batch(student, prompts, self.policy, seeds, self.stop_ids, self.pad_token_id)
        finally:
            student.train(was_training)
        ys = [g.token_ids[: max(1, self.max_length - len(p))] for g, p in zip(samples, prompts, strict=True)]
        targets = self.targets(student, prompts, x2s, ys, inputs["lam"])
        features = [
            {"input_ids": p + y, "prompt_length": len(p), "teacher_ids": ids.tolist(),
             "teacher_logprobs": logprobs.tolist(), "teacher_tail": tail.tolist()}
            for p, y, (ids, logprobs, tail) in zip(prompts, ys, targets, strict=True)
        ]
        device = inputs["input_ids"].device
        return {k: v.to(device) for k, v in SparseTeacherCollator(self.pad_token_id)(features).items()}

    @torch.no_grad()
    def targets(
        self,
        student: torch.nn.Module,
        prompts: list[list[int]],
        x2s: list[list[int]],
        ys: list[list[int]],
        lam: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per row: the top-k ids, their log p_mix and the log tail mass at every token of y ((T, k), (T, k), (T,))."""
        with self._teacher(student) as teacher:
            logits = context_logits(teacher, [*prompts, *x2s], [*ys, *ys], self.pad_token_id)
        rows = len(prompts)
        out = []
        for i in range(rows):
            _, top, tail = mixture_topk(logits[i], logits[rows + i], float(lam[i]), self.topk)
            out.append((top.indices.cpu(), top.values.cpu(), tail.cpu()))
        return out

    @contextlib.contextmanager
    def _teacher(self, student: torch.nn.Module) -> Iterator[torch.nn.Module]:
        was_training = student.training
        student.eval()
        try:
            if self.frozen is not None:
                yield self.frozen
            else:
                with student.disable_adapter():  # peft: the base weights alone, which training never changes
                    yield student
        finally:
            student.train(was_training)


def context_logits(
    model: torch.nn.Module, contexts: list[list[int]], continuations: list[list[int]], pad_token_id: int
) -> list[torch.Tensor]:
    """For each row, the logits that predict each token of its continuation after its context: (len(y), V).

    One right-padded forward over [context ‖ y] for every row; position ids count from 0 in each row.
    """
    rows = [c + y for c, y in zip(contexts, continuations, strict=True)]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.as_tensor(r, dtype=torch.long, device=device)
        attention_mask[b, : len(r)] = 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    return [logits[b, len(c) - 1 : len(c) - 1 + len(y)] for b, (c, y) in enumerate(zip(contexts, continuations,
                                                                                     strict=True))]
