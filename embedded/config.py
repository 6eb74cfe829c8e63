"""`EmbeddedConfig`: the `embedded` config section, which says how `redumix embedded` builds the embedded default
model.

The corpus mix is its own section, `embedded.corpus` (`CorpusSpec` in embedded/corpus.py, which holds its defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redumix.embedded.corpus import CorpusSpec
from redumix.embedded.vocab import SPECIAL_TOKENS


@dataclass
class EmbeddedConfig:
    steps: int = field(default=3500, metadata={"help": "Optimizer steps of pre-training (fixed, not timed)."})
    batch_rows: int = field(default=2, metadata={"help": "Packed rows per optimizer step."})
    seq_len: int = field(default=512, metadata={"help": "Tokens per packed row; also the model's window."})
    vocab_size: int = field(
        default=768,
        metadata={"help": "Byte-level BPE vocabulary size, special tokens included. 768 makes the fixed instruction "
                  "strings one to four tokens, so a reflection episode is ~190 tokens instead of ~345 at 432."},
    )
    # Narrow and many steps beats wide and few at a fixed wall time (docs/measurements.md, "Base width").
    hidden_size: int = field(default=96, metadata={"help": "Model width."})
    layers: int = field(default=4, metadata={"help": "Transformer blocks."})
    heads: int = field(default=4, metadata={"help": "Attention heads (hidden_size must divide by it)."})
    intermediate_size: int = field(default=256, metadata={"help": "MLP width."})
    lr: float = field(default=3e-3, metadata={"help": "Peak AdamW learning rate."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decays to lr * this."})
    warmup_steps: int = field(default=60, metadata={"help": "Linear warmup steps."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices."})
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 autocast. Off: on a CPU without native bf16 (no AVX512-BF16 or AMX) it makes a "
                  "training step slower than float32."},
    )
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads while building."})
    checkpoint_steps: int = field(
        default=250,
        metadata={"help": "Save weights, optimizer and step every this many steps; a rerun resumes from the last."},
    )
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    eval_n: int = field(
        default=300, metadata={"help": "Held-out test problems for the built model's greedy accuracy."})
    eval_reflection: bool = field(
        default=True, metadata={"help": "Also measure attempt -> feedback -> reflection -> x2-only redo on eval_n."}
    )
    eval_batch_size: int = field(default=100, metadata={"help": "Problems decoded together when measuring."})
    shipped: str | None = field(
        default=None,
        metadata={"help": "A folder with a model that `redumix embedded` built from these settings. When its "
                  "build_config.yaml matches, harvest, eval, calibrate, rounds and evidence copy it into "
                  "RUN_DIR/embedded instead of building; `redumix embedded` always builds from the code."},
    )

    def __post_init__(self) -> None:
        problems = []
        for name in ("steps", "batch_rows", "vocab_size", "hidden_size", "layers", "heads", "intermediate_size",
                     "threads", "eval_n", "eval_batch_size", "checkpoint_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 64:
            problems.append(f"seq_len must be >= 64, got {self.seq_len}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            problems.append(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
        if self.heads >= 1 and self.hidden_size % self.heads:
            problems.append(f"hidden_size {self.hidden_size} must divide by heads {self.heads}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0 or self.weight_decay < 0:
            problems.append("need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0, weight_decay >= 0")
        if problems:
            raise ValueError("; ".join(problems))
