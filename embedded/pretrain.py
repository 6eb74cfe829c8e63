"""Pre-training the embedded base from scratch: packed rows, the model, the training loop and its checkpoints.

Whole episodes are packed into rows (none is cut), attention stays inside each episode, and the loss falls on
trained assistant tokens only. AdamW with warmup and cosine decay runs for a fixed number of steps: the machine is
shared, so wall time cannot be the budget. Training is float32 unless `embedded.bf16`, which pays only on a CPU with
native bf16.

Every `embedded.checkpoint_steps` the loop saves weights, optimizer state and step. The packed rows are a pure
function of the tokenizer and the seed, so a run resumed from a checkpoint takes exactly the steps an unbroken one
would.
"""

from __future__ import annotations

import itertools
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_model as save_safetensors_model
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from redumix.common.files import atomic_write_json, log_metrics, read_json
from redumix.common.ranks import print0, rank
from redumix.embedded.config import EmbeddedConfig
from redumix.embedded.corpus import Episode
from redumix.embedded.vocab import ASSISTANT, END, REFLECT_OPEN, SYSTEM, USER

# --- episodes -> packed rows ---------------------------------------------------------------------------------------


def encode_episodes(
    tokenizer: PreTrainedTokenizerFast, episodes: list[Episode]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) per episode, identical to the chat template's rendering. `trained[i]` marks ids[i] as a target.

    Targets are the content and closing `<|end|>` of trained assistant turns, except `<|reflect|>` itself: only the
    reflective decoder's gate opens a check span, so the model must never learn to emit one.
    """
    ids_of = tokenizer.convert_tokens_to_ids
    role_id = {"user": ids_of(USER), "assistant": ids_of(ASSISTANT), "system": ids_of(SYSTEM)}
    end_id, open_id = ids_of(END), ids_of(REFLECT_OPEN)
    contents = [m["content"] for e in episodes for m in e.messages]
    encoded = iter(tokenizer.backend_tokenizer.encode_batch_fast(contents, add_special_tokens=False))
    out = []
    for episode in episodes:
        ids: list[int] = []
        trained: list[bool] = []
        for index, message in enumerate(episode.messages):
            content = next(encoded).ids
            ids += [role_id[message["role"]], *content, end_id]
            trained += [False] + [index in episode.trained] * (len(content) + 1)
        ids_array = np.asarray(ids, dtype=np.int64)
        out.append((ids_array, np.asarray(trained) & (ids_array != open_id)))
    return out


def pack_rows(
    docs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First-fit packing of whole episodes into rows (none is cut). Returns input ids, labels (-100 off target)
    and position ids, which restart at 0 for every episode as they do at inference; `episode_mask` uses them."""
    input_ids = np.full((len(docs), seq_len), pad_id, dtype=np.int64)  # at most one row per episode
    labels = np.full((len(docs), seq_len), -100, dtype=np.int64)
    positions = np.zeros((len(docs), seq_len), dtype=np.int64)  # padding is one more "episode" starting at 0
    used: list[int] = []  # tokens filled per row
    for ids, trained in docs:
        n = len(ids)
        if n > seq_len:
            continue  # cannot happen with default difficulty; a cut episode would teach a context that never occurs
        for r in range(max(0, len(used) - 8), len(used)):  # a short window keeps packing linear
            if used[r] + n <= seq_len:
                break
        else:
            r = len(used)
            used.append(0)
        input_ids[r, used[r] : used[r] + n] = ids
        labels[r, used[r] : used[r] + n] = np.where(trained, ids, -100)
        positions[r, used[r] : used[r] + n] = np.arange(n)
        used[r] += n
    rows = len(used)
    return tuple(torch.from_numpy(a[:rows]) for a in (input_ids, labels, positions))


def episode_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] causal attention that stays inside each packed episode (a new one starts where position is 0),
    so an episode never sees the numbers of the one before it: at inference there is none."""
    episode = torch.cumsum(positions == 0, dim=1)
    same = episode[:, :, None] == episode[:, None, :]
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


def build_rows(
    tokenizer: PreTrainedTokenizerFast, episodes_iter, n_rows: int, seq_len: int, chunk: int = 2000
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, int]]:
    """Draw episodes until `n_rows` rows are full."""
    pad_id = tokenizer.pad_token_id
    parts, counts = [], {"episodes": 0, "rows": 0}
    while counts["rows"] < n_rows:
        episodes = list(itertools.islice(episodes_iter, chunk))
        parts.append(pack_rows(encode_episodes(tokenizer, episodes), seq_len, pad_id))
        counts["episodes"] += len(episodes)
        counts["rows"] += len(parts[-1][0])
    input_ids, labels, positions = (torch.cat([p[i] for p in parts])[:n_rows] for i in range(3))
    return input_ids, labels, positions, counts


# --- model and training -------------------------------------------------------------------------------------------


def build_model(
    config: EmbeddedConfig, tokenizer: PreTrainedTokenizerFast, seed: int, vocab_size: int | None = None
) -> LlamaForCausalLM:
    """The embedded default's Llama with fresh weights; `vocab_size` overrides the tokenizer's (benchmarks)."""
    torch.manual_seed(seed)
    llama = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer), hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.heads,
        max_position_embeddings=config.seq_len, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(llama)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def lr_at(step: int, config: EmbeddedConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(
    model: LlamaForCausalLM, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], config: EmbeddedConfig,
    metrics: Path | None, checkpoint: Path | None = None,
) -> dict[str, float]:
    """Train for config.steps, resuming from `checkpoint` when it holds a saved step, and saving there as it goes.

    With `metrics` (a metrics.jsonl file) the loss is logged there every 100 steps. Step s reads packed rows
    [s·batch_rows, (s+1)·batch_rows), and nothing else is random, so a resumed run
    takes exactly the steps an unbroken one would.
    """
    input_ids, labels, positions = rows
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95),
    )
    first, tokens, ema, elapsed_before = 0, 0, None, 0.0
    if checkpoint is not None and (checkpoint / "state.json").is_file():
        first, tokens, ema, elapsed_before = load_checkpoint(checkpoint, model, optimizer)
        print0(f"embedded: resuming from step {first} of {config.steps} ({checkpoint})")
    model.train()
    start = time.perf_counter() - elapsed_before
    bar = tqdm(range(first, config.steps), desc="embedded", disable=rank() != 0, mininterval=2.0, initial=first,
               total=config.steps)
    for step in bar:
        lo = step * config.batch_rows
        x, y, pos = (t[lo : lo + config.batch_rows] for t in (input_ids, labels, positions))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            loss = model(input_ids=x, labels=y, position_ids=pos, attention_mask=episode_mask(pos)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tokens / elapsed:.0f}", refresh=False)
        if metrics is not None and (step % 100 == 0 or step == config.steps - 1):
            log_metrics(metrics, "embedded", step=step, loss=round(ema, 4), lr=lr_at(step, config),
                        tokens_per_s=round(tokens / elapsed))
        if checkpoint is not None and (step + 1) % config.checkpoint_steps == 0 and step + 1 < config.steps:
            save_checkpoint(checkpoint, model, optimizer, step + 1, tokens, ema, elapsed)
    model.eval()
    elapsed = time.perf_counter() - start
    return {"train_seconds": round(elapsed, 1), "steps_per_s": round(config.steps / elapsed, 2),
            "tokens_per_s": round(tokens / elapsed), "final_loss": round(ema, 4)}


def save_checkpoint(
    folder: Path, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, step: int, tokens: int, ema: float,
    elapsed: float,
) -> None:
    """Weights (safetensors), optimizer state and counters, written beside the folder and swapped in whole."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_safetensors_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")  # tensors and numbers only: loads with weights_only
    atomic_write_json(tmp / "state.json", {"step": step, "tokens": tokens, "ema": ema, "elapsed": elapsed})
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    folder: Path, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer
) -> tuple[int, int, float, float]:
    """Restore a `save_checkpoint` folder; returns (next step, tokens seen, loss EMA, seconds spent)."""
    load_safetensors_model(model, str(folder / "model.safetensors"))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    state = read_json(folder / "state.json")
    return state["step"], state["tokens"], state["ema"], state["elapsed"]


