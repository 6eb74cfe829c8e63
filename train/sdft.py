"""SDFT through TRL (`train.method=sdft`): the student samples y from x alone, and learns on its own samples the
distribution of a teacher that was shown x2. The peer of the mixture arm in `redumix evidence` (arms sdft-base and
sdft-ema): the same rows, no stored p_mix, and TRL's own trainer (`trl.experimental.sdft.SDFTTrainer`; Shenfeld et
al. 2026, "Self-Distillation Enables Continual Learning").

The teacher's prompt is x2's conversation, exactly. A row's `prompt` is x as chat messages (one user turn) and its
`privileged_context` the turns x2 adds after it: the attempt y1 (assistant), the feedback with REFLECT (user), the
reflection c (assistant) and REDO (user). TRL's `teacher_prompt_template` cannot express that: it formats prompt and
context into the text of one user turn, so the teacher would see the attempt and the reflection as something the user
wrote, in a prompt the harvest never decoded from. `ConversationTeacherContext` replaces that one method of TRL's
context builder with list concatenation, and TRL renders x + the privileged turns with the chat template as it does
the student's x. The teacher's prompt ids are then `prompt_ids(tokenizer, redo_messages(...))`, which on the tiny
recipe's harvest equals the stored `x2_token_ids` on every row (y1 and c re-tokenise to their sampled ids, and no
attempt was cut to fit the window); tests/test_sdft.py checks the teacher input of a real batch against it.

How the settings map onto SDFTConfig:
- train.sdft_teacher -> teacher_model_kind: 'base' the starting model, 'ema' an EMA of the student.
- train.beta -> distillation_alpha: TRL's divergence is the same generalized JSD as GKD's (0 forward KL, 1 reverse).
- train.onpolicy_temperature -> temperature: TRL samples, and scales both models' logits, at one temperature.
- train.onpolicy_max_new_tokens -> max_completion_length, as the on-policy GKD arm's samples.
- distillation_mode full_logits: the teacher is live, so nothing forces a top-k; the divergence is exact.
- num_generations 1: one sample per row, so a step sees batch_size x grad_accum rows, as every other arm does.
- max_prompt_length None: TRL cuts a long prompt from the left, which would cut x off the front of x2.
- train.sdft_sampler -> use_vllm: 'vllm' samples through TRL's vLLM, colocated in this process. On a CPU vLLM
  repacks each linear layer's weights after loading them, so TRL's sync, which loads parameter by parameter into the
  loaded model, fails ("'Parameter' object has no attribute 'weight_loader'"); there the sync goes through vLLM's own
  `reload_weights`, which loads and repacks (`sync_by_reload`). vLLM draws with its own seed (TRL's: the process
  index), so its samples differ from `generate`'s; tests/test_sdft_vllm.py checks that they come from the student.

Optimizer, schedule, batch, seed, LoRA or full, checkpoints: as the GKD trainer (train/trainer.py `hf_arguments`,
`trainer_parts`). TRL turns dropout off in the student and the teacher (`disable_dropout`), so `lora_dropout` has no
effect here.

Resume: HF checkpoints hold the student, optimizer, scheduler, RNG and data position, and rollouts are drawn afresh
at every optimizer step, so a resumed run goes on as an unbroken one. The EMA teacher is training state that TRL does
not resume: with full fine-tuning it is a model of its own that no checkpoint holds (a resumed run would restart it
from the starting model), and with LoRA it is a second adapter, which the checkpoint holds in `teacher/` and HF
Trainer loads back, after which TRL's EMA callback fails adding it again. `X2SDFTTrainer` saves the first with the
optimizer (`ema_teacher.pt`) and hands the second to TRL's callback as its average; tests/test_sdft.py checks that
a resumed run ends with the model of an unbroken one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import get_peft_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl.experimental.sdft import SDFTConfig, SDFTTrainer
from trl.experimental.sdft.sdft_trainer import DemonstrationTeacherContextBuilder
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

from redumix.data.chat import prompt_ids
from redumix.data.prompts import Message, attempt_messages, redo_messages
from redumix.train.config import TrainConfig
from redumix.train.trainer import TrainerSetup, hf_arguments, trainer_parts

EMA_TEACHER = "ema_teacher.pt"  # the full fine-tuning EMA teacher's weights, in each checkpoint
TEACHER_ADAPTER = "teacher"  # the name TRL gives the LoRA EMA teacher's adapter (and its folder in a checkpoint)


def sdft_examples(rows: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, max_new_tokens: int) -> Dataset:
    """One example per harvest row: `prompt` (x, as chat messages) and `privileged_context` (the turns x2 adds).

    A row is left out when its teacher input, x2 and a sample of `max_new_tokens`, could exceed `max_length`
    tokens: TRL would otherwise score the sample past the window.
    """
    columns = rows.select_columns(["id", "prompt", "original", "feedback", "reflection"])
    examples = []
    for row in columns:
        x = attempt_messages(row["prompt"])
        x2 = redo_messages(row["prompt"], row["original"], row["feedback"], row["reflection"])
        if len(prompt_ids(tokenizer, x2)) + max_new_tokens <= max_length:
            examples.append({"id": row["id"], "prompt": x, "privileged_context": x2[len(x) :]})
    if len(columns) and not examples:
        raise ValueError(
            f"train: method sdft: every row's x2 plus a sample of train.onpolicy_max_new_tokens={max_new_tokens} "
            f"is longer than train.max_length={max_length} tokens; raise train.max_length"
        )
    return Dataset.from_list(examples)


class ConversationTeacherContext(DemonstrationTeacherContextBuilder):
    """TRL's teacher-context builder, with the teacher prompt made as a conversation: x's messages followed by the
    privileged turns (x2), instead of TRL's template, which folds them into the text of one user turn."""

    def _compose_teacher_prompt(self, prompt: list[Message], privileged_context: list[Message]) -> list[Message]:
        return [*prompt, *privileged_context]


class X2SDFTTrainer(SDFTTrainer):
    """SDFTTrainer whose teacher sees x2's conversation, and whose checkpoints hold the EMA teacher."""

    args: SDFTConfig  # built by sdft_arguments (HF Trainer types it as TrainingArguments)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs["args"].use_vllm:
            # TRL reaches into the engine to sync weights, so its core must run in this process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        super().__init__(*args, **kwargs)
        self.teacher_context_builder = ConversationTeacherContext(self)
        if self.use_vllm and self.accelerator.device.type == "cpu":
            generation = self.vllm_generation
            generation.sync_weights = lambda: sync_by_reload(generation)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Saved here, before HF Trainer writes trainer_state.json, so that a finished checkpoint always holds it.
        super()._save_optimizer_and_scheduler(output_dir)
        if self._separate_ema_teacher() and self.args.should_save:
            teacher = self.accelerator.unwrap_model(self.teacher_model)
            torch.save(teacher.state_dict(), Path(output_dir) / EMA_TEACHER)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.args.teacher_model_kind != "ema":
            return
        if self._separate_ema_teacher():
            state = torch.load(Path(checkpoint) / EMA_TEACHER, map_location="cpu", weights_only=True)
            self.accelerator.unwrap_model(self.teacher_model).load_state_dict(state)
            return
        # LoRA: HF Trainer has already loaded the checkpoint's teacher/ folder as an adapter named "teacher".
        # TRL's EMA callback would add that adapter again at on_train_begin (and fail: it already exists) and
        # start its average from zero; so it takes the loaded weights as its average instead.
        [ema] = [c for c in self.callback_handler.callbacks if isinstance(c, PEFTAdapterEMACallback)]
        model = self.accelerator.unwrap_model(self.model)
        loaded = get_peft_model_state_dict(model, adapter_name=TEACHER_ADAPTER)
        ema.shadow_weights = {key: weights.detach().clone() for key, weights in loaded.items()}
        ema.teacher_adapter_config = model.peft_config[TEACHER_ADAPTER]
        ema._initialized = True

    def _separate_ema_teacher(self) -> bool:
        """An EMA teacher that is a model of its own (full fine-tuning), not an adapter of the student's."""
        return self.args.teacher_model_kind == "ema" and self.teacher_model is not self.model


def sync_by_reload(generation: Any) -> None:
    """TRL's colocated weight sync (`VLLMGeneration.sync_weights`) through vLLM's `reload_weights`, for vLLM's CPU
    backend (see the module docstring)."""
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=generation._iter_named_params())
    generation.llm.reset_prefix_cache()


def sdft_arguments(config: TrainConfig, output_dir: str, seed: int, use_cpu: bool, processes: int) -> SDFTConfig:
    """The TRL/HF arguments of an SDFT run (the table in the module docstring)."""
    return SDFTConfig(
        **hf_arguments(config, output_dir, seed, use_cpu, processes),
        teacher_model_kind=config.sdft_teacher,
        distillation_mode="full_logits",
        distillation_alpha=config.beta,
        temperature=config.onpolicy_temperature,
        max_completion_length=config.onpolicy_max_new_tokens,
        max_prompt_length=None,
        num_generations=1,
        use_vllm=config.sdft_sampler == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=config.max_length,
    )


def build_sdft_trainer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_examples: Dataset,
    config: TrainConfig,
    setup: TrainerSetup,
) -> X2SDFTTrainer:
    """A trainer over examples from `sdft_examples`; with adapter 'lora' TRL wraps the model with peft."""
    args = sdft_arguments(config, setup.output_dir, setup.seed, setup.use_cpu, setup.processes)
    return X2SDFTTrainer(**trainer_parts(model, tokenizer, train_examples, config, setup, args))
