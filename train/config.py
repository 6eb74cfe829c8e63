"""Config of the train stage: sparse-teacher GKD (offline or on-policy), or TRL's SDFT (train/sdft.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

RowFilter = Literal["all", "improved", "redo_correct", "original_correct"]
Target = Literal["mixture", "redo", "gold", "original"]


@dataclass
class TrainConfig:
    # --- the loss ---
    beta: float = field(
        default=0.0, metadata={"help": "Generalized JSD β: 0 forward KL(p_mix‖student), 1 reverse KL."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Distillation temperature applied to student logits and teacher log-probs."}
    )
    # --- the trainer ---
    method: Literal["gkd", "sdft"] = field(
        default="gkd",
        metadata={"help": "'gkd': our trainer (train/trainer.py), the generalized JSD toward the stored p_mix "
                  "(or, with policy on_policy, the live one). 'sdft': TRL's SDFTTrainer (train/sdft.py): the "
                  "student samples y from x alone and learns, on its own samples, the distribution of a teacher "
                  "shown x2 (the row's attempt, feedback, reflection and the redo instruction); no stored p_mix "
                  "is read. sdft takes beta, onpolicy_temperature (for sampling and the distilled logits alike) "
                  "and onpolicy_max_new_tokens; it leaves target, policy, skill_rows and replay at their "
                  "defaults."},
    )
    sdft_teacher: Literal["base", "ema"] = field(
        default="base",
        metadata={"help": "sdft: the teacher's weights (TRL's teacher_model_kind). 'base': the starting model, "
                  "frozen (with LoRA, the adapter disabled). 'ema': an exponential moving average of the student, "
                  "updated after every step at TRL's rate 0.05."},
    )
    sdft_sampler: Literal["generate", "vllm"] = field(
        default="generate",
        metadata={"help": "sdft: what draws the student's samples. 'generate': transformers' `generate` on the "
                  "student. 'vllm': TRL's vLLM in colocate mode (`make vllm`), the student's weights synced into it "
                  "before each step's samples; 1.5 times faster a step on a 2-core CPU (docs/code.md, SDFT)."},
    )
    # --- what the student learns toward ---
    target: Target = field(
        default="mixture",
        metadata={"help": "'mixture': the stored p_mix (sparse top-k + tail). Hard labels (SFT), the controls of "
                  "`redumix evidence`: 'redo' (the harvested redo text), 'gold' (the task's reference working), "
                  "'original' (the model's own first attempt)."},
    )
    policy: Literal["offline", "on_policy"] = field(
        default="offline",
        metadata={"help": "'offline': learn the stored p_mix on the harvested redo. 'on_policy': on a share "
                  "`on_policy_share` of the steps the student samples y from x and the teacher's p_mix is computed "
                  "live "
                  "from x and the row's stored x2 (the frozen starting model; with LoRA, the adapter disabled)."},
    )
    on_policy_share: float = field(
        default=0.5,
        metadata={"help": "on_policy: fraction of steps on student samples (TRL GKD's lmbda); the other steps "
                  "learn the stored redo, which the teacher mixture generated (TRL's seq_kd)."},
    )
    onpolicy_temperature: float = field(default=1.0, metadata={"help": "on_policy and sdft: the student's "
                                        "sampling temperature."})
    onpolicy_max_new_tokens: int = field(default=160, metadata={"help": "on_policy and sdft: most tokens a "
                                         "student sample has."})
    onpolicy_topk: int = field(
        default=32, metadata={"help": "on_policy: top-k ids of the live p_mix kept (+ tail), as the harvest stores."}
    )
    # --- the data ---
    rows: RowFilter = field(
        default="all",
        metadata={"help": "Rows to learn from: 'all', 'improved' (original wrong, redo right), 'redo_correct', or "
                  "'original_correct' (the first attempt right: with target 'original', rejection-sampling "
                  "fine-tuning, RFT, on the harvest's one attempt per problem)."},
    )
    heldout_fraction: float = field(
        default=0.05, metadata={"help": "Fraction of rows held out (chosen by hashed id) for the held-out KL metric."}
    )
    heldout_max_rows: int = field(default=200, metadata={"help": "At most this many held-out rows are scored."})
    max_length: int = field(
        default=1024,
        metadata={"help": "Longest student input [x ‖ y]; the redo is cut to fit. sdft: a row is left out when its "
                  "teacher input, x2 and a sample of onpolicy_max_new_tokens, could be longer."},
    )
    # --- what is trained ---
    adapter: Literal["lora", "full"] = field(
        default="lora", metadata={"help": "What is trained: 'lora' (a peft adapter) or 'full' (every weight)."}
    )
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Module names that get LoRA adapters ('all-linear' alone means every linear layer)."},
    )
    harvest_dir: str = field(
        default="", metadata={"help": "Harvest folder to learn from; empty = RUN_DIR/harvest (evidence arms share)."}
    )
    more_harvests: list[str] = field(
        default_factory=list,
        metadata={"help": "Further harvest folders whose rows join harvest_dir's (rounds.accumulate lists the "
                  "earlier rounds' harvests here)."},
    )
    skill_rows: bool = field(
        default=False,
        metadata={"help": "Also learn, as hard labels, the reflection turn (prompt + attempt + feedback -> "
                  "reflection) and the in-context redo (x2 -> redo) of every row whose redo is right: the skill "
                  "that makes the harvest is trained, not only its product x -> redo."},
    )
    replay: float = field(
        default=0.0,
        metadata={"help": "Share of the training examples that replay the embedded base's own reflection, critique "
                  "and refine episodes (its corpus), as hard labels, so that distilling redos does not erase the "
                  "turns PDR, SR and reflection run on; 0 = none. Arith only."},
    )
    seed: int = field(
        default=-1, metadata={"help": "Trainer seed (initialisation, data order, on-policy samples); -1 = the run's."}
    )
    # --- the optimizer ---
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = field(
        default="cosine", metadata={"help": "Learning-rate schedule."}
    )
    warmup_ratio: float = field(
        default=0.03, metadata={"help": "Fraction of the optimizer steps spent warming up (ceil(ratio * steps))."}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    epochs: float = field(default=1.0, metadata={"help": "Passes over the training rows (ignored if max_steps > 0)."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 derives them from epochs."})
    batch_size: int = field(default=8, metadata={"help": "Rows per device per micro-batch."})
    grad_accum: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    # --- the machine ---
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 autocast. On for GPUs; on a CPU without AVX512-BF16/AMX it is emulated and slower."},
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward."})
    deepspeed: str = field(
        default="", metadata={"help": "DeepSpeed JSON config (e.g. recipes/zero3.json); empty for none."}
    )
    # --- checkpoints and logs ---
    save_steps: int = field(default=100, metadata={"help": "Checkpoint every this many optimizer steps."})
    save_total_limit: int = field(default=2, metadata={"help": "Checkpoints kept (oldest deleted first)."})
    logging_steps: int = field(default=10, metadata={"help": "Log the loss every this many steps."})
    report_to: Literal["none", "tensorboard", "wandb"] = field(
        default="none",
        metadata={"help": "Where the HF Trainer also logs: 'tensorboard' (RUN_DIR/train/checkpoints/runs/; "
                  "`pip install -e .[tensorboard]`) or 'wandb' (needs wandb installed and logged in). The loss goes "
                  "to RUN_DIR/logs/metrics.jsonl either way."},
    )

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 <= self.beta <= 1.0:
            problems.append(f"beta must lie in [0, 1], got {self.beta}")
        if self.temperature <= 0:
            problems.append(f"temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            problems.append(f"heldout_fraction must lie in [0, 1), got {self.heldout_fraction}")
        positive = ("max_length", "lora_rank", "lora_alpha", "batch_size", "grad_accum", "save_steps", "logging_steps")
        for name in positive:
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.heldout_max_rows < 0 or self.save_total_limit < 1:
            problems.append("heldout_max_rows must be >= 0 and save_total_limit >= 1")
        if not 0.0 <= self.lora_dropout < 1.0 or not 0.0 <= self.warmup_ratio < 1.0:
            problems.append("lora_dropout and warmup_ratio must lie in [0, 1)")
        if self.learning_rate <= 0 or self.epochs <= 0:
            problems.append("learning_rate and epochs must be positive")
        if self.max_steps == 0 or self.max_steps < -1:
            problems.append(f"max_steps must be -1 (use epochs) or positive, got {self.max_steps}")
        if not self.lora_target_modules:
            problems.append("lora_target_modules must name at least one module")
        if not 0.0 <= self.on_policy_share <= 1.0:
            problems.append(f"on_policy_share must lie in [0, 1], got {self.on_policy_share}")
        if self.onpolicy_temperature < 0 or self.onpolicy_max_new_tokens < 1 or self.onpolicy_topk < 1:
            problems.append("onpolicy_temperature must be >= 0, onpolicy_max_new_tokens and onpolicy_topk >= 1")
        if self.policy == "on_policy" and self.target != "mixture":
            problems.append(f"policy 'on_policy' learns the live p_mix, so target must be 'mixture', not "
                            f"{self.target!r}")
        if self.policy == "on_policy" and (self.skill_rows or self.replay):
            problems.append("skill_rows and replay are offline hard labels; use them with policy 'offline'")
        if self.method == "sdft":
            if self.target != "mixture" or self.policy != "offline" or self.skill_rows or self.replay:
                problems.append("method 'sdft' learns from its own samples and a teacher shown x2: leave target "
                                "'mixture', policy 'offline', skill_rows false and replay 0")
            if self.onpolicy_temperature <= 0 or self.temperature != self.onpolicy_temperature:
                problems.append("method 'sdft' samples and distils at one temperature (TRL's): set "
                                "onpolicy_temperature > 0 and temperature equal to it")
        if not 0.0 <= self.replay < 1.0:
            problems.append(f"replay must lie in [0, 1), got {self.replay}")
        if problems:
            raise ValueError("; ".join(problems))
