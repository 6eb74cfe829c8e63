"""Offline sparse-teacher GKD on TRL: an SFTTrainer whose loss reads the stored top-k of p_mix from the batch.

Why SFTTrainer and not GKDTrainer: GKDTrainer's constructor needs a live teacher model (it loads and wraps one, and
checks vocabularies against it), and its compute_loss runs that teacher. Here the teacher is data, so all that is
kept of GKD is its loss (train/loss.py, equal to `GKDTrainer.generalized_jsd_loss` when k = vocabulary). SFTTrainer
brings the rest unchanged: peft wrapping, DeepSpeed, checkpoints and resume, logging.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments
from trl import SFTConfig, SFTTrainer

from redumix.train.config import TrainConfig
from redumix.train.data import SparseTeacherCollator
from redumix.train.loss import select_targets, sparse_gkd_loss
from redumix.train.onpolicy import LiveMixtureTeacher


class SparseGKDTrainer(SFTTrainer):
    """SFTTrainer with compute_loss replaced by the sparse generalized JSD against the batch's stored teacher."""

    def __init__(
        self,
        *args: Any,
        beta: float = 0.0,
        temperature: float = 1.0,
        live_teacher: LiveMixtureTeacher | None = None,
        on_policy_share: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.beta = beta
        self.temperature = temperature
        self.live_teacher = live_teacher  # train.policy on_policy
        self.on_policy_share = on_policy_share
        # Our loss is normalised by num_items_in_batch, so tell HF Trainer to count it (over labels[..., 1:]) and not
        # to divide the loss again by the gradient-accumulation steps.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        if self.live_teacher is not None and model.training and self.on_policy_step(self.state.global_step):
            student = self.accelerator.unwrap_model(model)
            inputs = self.live_teacher.on_policy_batch(student, inputs, self.state.global_step)
            num_items_in_batch = None  # HF counted the stored batch's tokens; this batch's own count normalises it
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        logits, _ = select_targets(outputs.logits, inputs["labels"])
        mask = inputs["teacher_mask"]
        loss = sparse_gkd_loss(
            logits,
            inputs["teacher_ids"][mask],
            inputs["teacher_logprobs"][mask],
            beta=self.beta,
            temperature=self.temperature,
            num_items_in_batch=num_items_in_batch,
            tail_logprob=inputs["teacher_tail"][mask] if "teacher_tail" in inputs else None,
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch is then the count over all ranks, and DDP/DeepSpeed average the gradients over
            # ranks: scaling by the rank count makes the step the gradient of (global sum / global count).
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def on_policy_step(self, step: int) -> bool:
        """Whether optimizer step `step` trains on student samples: a draw fixed by the seed and the step, so a
        resumed run makes the same choices (TRL's GKD draws `random.random() <= lmbda` per step; its lmbda is our
        on_policy_share)."""
        draw = hashlib.sha256(f"{self.args.seed}:lmbda:{step}".encode()).digest()
        return int.from_bytes(draw[:8], "big") / 2**64 < self.on_policy_share


class NoFinalCheckpoint(TrainerCallback):
    """Skip the checkpoint at the last step. Resuming from a checkpoint taken at max_steps makes HF Trainer run one
    step more (it checks max_steps only after a step), so a crash between the last step and the outputs would
    change the model. Without it, the rerun resumes one checkpoint earlier and redoes the last steps exactly."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= state.max_steps:
            control.should_save = False
        return control


def lora_config(config: TrainConfig) -> LoraConfig | None:
    if config.adapter == "full":
        return None
    targets: list[str] | str = config.lora_target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def hf_arguments(config: TrainConfig, output_dir: str, seed: int, use_cpu: bool, processes: int) -> dict[str, Any]:
    """The HF TrainingArguments every trainer here shares (GKD's SFTConfig, SDFT's SDFTConfig, train/sdft.py).
    Checkpoints hold weights, optimizer, scheduler, data position and RNG."""
    check_report_to(config.report_to)
    return dict(
        output_dir=output_dir,
        seed=seed,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler,
        # transformers 5 has no warmup_ratio: a warmup_steps below 1 is the ratio, ceil(ratio * total) steps.
        warmup_steps=config.warmup_ratio,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        bf16=config.bf16,
        use_cpu=use_cpu,
        ddp_backend="gloo" if use_cpu and processes > 1 else None,
        gradient_checkpointing=config.gradient_checkpointing,
        deepspeed=config.deepspeed or None,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        logging_steps=config.logging_steps,
        logging_first_step=True,
        report_to=config.report_to,
        disable_tqdm=False,
        dataloader_num_workers=0,
    )


# The package each `train.report_to` needs; HF Trainer would otherwise fail later with a traceback.
REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_report_to(report_to: str) -> None:
    package = REPORT_PACKAGES.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise ValueError(f"train.report_to={report_to} needs the {package} package: pip install {package} (for "
                         "tensorboard, `pip install -e .[tensorboard]`)")


def training_arguments(config: TrainConfig, output_dir: str, seed: int, use_cpu: bool, processes: int) -> SFTConfig:
    """The TRL/HF arguments of a GKD run."""
    return SFTConfig(
        **hf_arguments(config, output_dir, seed, use_cpu, processes),
        # The teacher columns must reach the collator, and the examples are already tokenised.
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=None,
    )


@dataclass(frozen=True)
class TrainerSetup:
    """Where and how a trainer runs, whatever it learns: its checkpoint folder, seed, device, how many ranks train
    together (gloo joins them on CPU) and callbacks beyond the run's own."""

    output_dir: str
    seed: int
    use_cpu: bool
    processes: int = 1
    callbacks: tuple[TrainerCallback, ...] = ()


def trainer_parts(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train_examples: Dataset, config: TrainConfig,
    setup: TrainerSetup, args: TrainingArguments,
) -> dict[str, Any]:
    """What every trainer here is built with (GKD's, and SDFT's in train/sdft.py): the model (wrapped by peft with
    adapter 'lora'), its arguments, the examples, the tokenizer and the callbacks, no checkpoint at the last step
    first."""
    if config.deepspeed and setup.use_cpu:
        skip_deepspeed_shm_build()
    return dict(model=model, args=args, train_dataset=train_examples, processing_class=tokenizer,
                peft_config=lora_config(config), callbacks=[NoFinalCheckpoint(), *setup.callbacks])


def build_trainer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_examples: Dataset,
    config: TrainConfig,
    setup: TrainerSetup,
    live_teacher: LiveMixtureTeacher | None = None,
) -> SparseGKDTrainer:
    """A trainer over examples from `train.data.build_examples`. `live_teacher` turns on on-policy steps
    (train.policy on_policy, train/onpolicy.py)."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one (e.g. pad_token = eos_token) before training")
    args = training_arguments(config, setup.output_dir, setup.seed, setup.use_cpu, setup.processes)
    return SparseGKDTrainer(
        **trainer_parts(model, tokenizer, train_examples, config, setup, args),
        data_collator=SparseTeacherCollator(pad_token_id=tokenizer.pad_token_id),
        beta=config.beta,
        temperature=config.temperature,
        live_teacher=live_teacher,
        on_policy_share=config.on_policy_share if live_teacher is not None else 0.0,
    )


def skip_deepspeed_shm_build() -> None:
    """On CPU, DeepSpeed's comm backend JIT-compiles a C++ shared-memory all-reduce (minutes, and a compiler) at
    init. Training never uses it (that op serves inference all-reduce; ZeRO goes through torch.distributed/gloo), so
    mark it incompatible and DeepSpeed skips the build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@torch.no_grad()
def heldout_kl(model: PreTrainedModel, examples: Dataset, pad_token_id: int, batch_size: int = 8) -> float:
    """Mean per-token KL(p_mix ‖ model) over the examples' target tokens (β=0, temperature 1, top-k + tail)."""
    if len(examples) == 0:
        return float("nan")
    collate = SparseTeacherCollator(pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        rows = examples.select(range(start, min(start + batch_size, len(examples))))
        batch = {name: tensor.to(device) for name, tensor in collate(list(rows)).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        student, _ = select_targets(logits, batch["labels"])
        mask = batch["teacher_mask"]
        n = student.shape[0]
        tail = batch["teacher_tail"][mask] if "teacher_tail" in batch else None
        loss = sparse_gkd_loss(student, batch["teacher_ids"][mask], batch["teacher_logprobs"][mask], tail_logprob=tail)
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)
