"""`gkd_offline_vs_trl_live_teacher`: our offline sparse trainer's step against TRL's GKDTrainer with a live
two-context teacher, the only way TRL can train toward p_mix. bench_peers.py runs it at each shape.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.bench_decode import Pairs, timed
from bench.harvest_vs_hf import LAM, TOP_K
from redumix.train.config import TrainConfig
from redumix.train.data import SparseTeacherCollator
from redumix.train.loss import select_targets
from redumix.train.trainer import SparseGKDTrainer, training_arguments

with warnings.catch_warnings():  # TRL warns that its experimental API may change; this bench measures that API
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDConfig, GKDTrainer


class LiveMixtureGKDTrainer(GKDTrainer):
    """TRL's GKDTrainer trained toward p_mix, the only way TRL can: every step the frozen teacher runs on both
    contexts, [x ‖ y] and [x2 ‖ y], and p_mix = log_softmax(λ·log p(·|x ‖ y) + (1−λ)·log p(·|x2 ‖ y)) goes to
    TRL's own `generalized_jsd_loss` in place of the teacher's logits."""

    def __init__(self, *args: Any, lam: float = LAM, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lam = lam

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        student, _ = select_targets(outputs.logits, inputs["labels"])
        self.teacher_model.eval()
        with torch.no_grad():
            on_x = self.teacher_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            on_x2 = self.teacher_model(input_ids=inputs["x2_input_ids"], attention_mask=inputs["x2_attention_mask"])
            # y is the same in both rows, so the two selections line up token for token.
            logits_x, _ = select_targets(on_x.logits, inputs["labels"])
            logits_x2, _ = select_targets(on_x2.logits, inputs["x2_labels"])
            mix = torch.log_softmax(self.lam * F.log_softmax(logits_x, dim=-1)
                                    + (1 - self.lam) * F.log_softmax(logits_x2, dim=-1), dim=-1)
        # [N, V] rows: TRL's "batchmean" then divides by N, the target tokens (or by num_items_in_batch).
        loss = self.generalized_jsd_loss(student, mix, beta=self.beta, temperature=self.temperature,
                                         num_items_in_batch=num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


def _training_rows(vocab: int, rows: int, x: int, x2: int, y: int) -> tuple[dict, dict]:
    """One batch as each trainer reads it: ours [x ‖ y] with a stored top-k + tail of p_mix at every token of y;
    theirs [x ‖ y] and [x2 ‖ y] for the live teacher. Random ids: the content does not change the cost."""
    gen = torch.Generator().manual_seed(1)
    features, x2_features = [], []
    for _ in range(rows):
        prompt, context, redo = (torch.randint(7, vocab, (n,), generator=gen).tolist() for n in (x, x2, y))
        teacher = torch.log_softmax(torch.randn(y, vocab, generator=gen) * 3, dim=-1)
        top = teacher.topk(TOP_K, dim=-1)
        tail = torch.logsumexp(teacher.double().scatter(-1, top.indices, float("-inf")), dim=-1)
        features.append({"input_ids": prompt + redo, "prompt_length": x, "teacher_ids": top.indices.tolist(),
                         "teacher_logprobs": top.values.half().float().tolist(), "teacher_tail": tail.tolist()})
        x2_features.append({"input_ids": context + redo, "prompt_length": x2, "teacher_ids": [[0]] * y,
                            "teacher_logprobs": [[0.0]] * y})
    collate = SparseTeacherCollator(pad_token_id=0)
    ours = collate(features)
    x2_batch = collate(x2_features)
    theirs = {"input_ids": ours["input_ids"], "attention_mask": ours["attention_mask"], "labels": ours["labels"],
              "x2_input_ids": x2_batch["input_ids"], "x2_attention_mask": x2_batch["attention_mask"],
              "x2_labels": x2_batch["labels"]}
    return ours, theirs


def gkd_offline_vs_trl_live_teacher(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: int = 16, x: int = 40, x2: int = 280,
    y: int = 120, repeats: int = 3,
) -> Pairs:
    """Goal ≥ 1.5. Step time of TRL's GKDTrainer with a live teacher computing p_mix from x and x2 every step
    (`LiveMixtureGKDTrainer`, TRL's lmbda=0 so both train on the same fixed y) over our offline step (SparseGKDTrainer,
    the stored top-k + tail of p_mix), on one batch of `rows` rows of x, x2 and y tokens. Both go through
    `Trainer.training_step` (forward, loss, backward) then the same AdamW step over the same student; float32,
    β=0 as the tiny recipe trains. The student and the frozen teacher are copies of `model`, which stays as it was,
    so the pairs can be dealt out among other keys' (the student's changing weights do not change a step's cost).

    Floor: theirs does everything ours does plus two teacher forwards over [x ‖ y] and [x2 ‖ y] and a full-vocabulary
    loss over three [N, V] distributions. A student step (forward + backward) costs about 3 forwards over x ‖ y, so
    on a compute-bound CPU the ratio is ≈ 1 + (|x| + |x2| + 2|y|) / (3·(|x| + |y|)) ≈ 2.2 at 40/280/120, plus the
    [N, V] work where the vocabulary is large against the body. On a GPU the same ≈2.2 where the batch makes it
    compute-bound, toward ≈1.7 where a small batch leaves it latency-bound (two teacher forwards against a forward
    and a backward, each costing about its call).
    """
    teacher = copy.deepcopy(model).eval()
    student = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)  # one optimizer: both step the same weights
    ours_batch, theirs_batch = _training_rows(min(len(tokenizer), student.config.vocab_size), rows, x, x2, y)
    tokens = int((ours_batch["labels"][:, 1:] != -100).sum())  # what HF Trainer passes as num_items_in_batch
    dataset = Dataset.from_list([{"input_ids": [0, 1]}])  # never read: the steps are fed their batch
    with tempfile.TemporaryDirectory() as out:  # the trainers make it; their training steps never write to it
        common = {"output_dir": out, "per_device_train_batch_size": rows, "bf16": False, "use_cpu": True,
                  "report_to": "none", "max_length": None, "remove_unused_columns": False}
        trl = LiveMixtureGKDTrainer(
            model=student, teacher_model=teacher, args=GKDConfig(lmbda=0.0, beta=0.0, temperature=1.0, **common),
            data_collator=lambda rows: rows, train_dataset=dataset, processing_class=tokenizer,
            optimizers=(optimizer, None))
        ours = SparseGKDTrainer(
            model=student, args=training_arguments(TrainConfig(batch_size=rows, bf16=False), out, 0, True, 1),
            data_collator=lambda rows: rows, train_dataset=dataset, processing_class=tokenizer,
            optimizers=(optimizer, None), beta=0.0)

    def step(trainer: Any, batch: dict[str, torch.Tensor]) -> Callable[[], float]:
        def go() -> None:
            trainer.training_step(student, dict(batch), num_items_in_batch=tokens)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return lambda: timed(go)

    return Pairs(step(trl, theirs_batch), step(ours, ours_batch), pairs=repeats)
