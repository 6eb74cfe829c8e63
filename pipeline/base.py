"""`redumix base`: build the embedded default model, so a fresh CPU machine runs the pipeline with no download.

What it does, top to bottom:
1. Generates the training text of data/arith.py (terse solutions with slips, reflection episodes, self-critiques,
   PDR refines, hidden `<|reflect|>` check spans) on problems outside the test and train buckets.
2. Trains a byte-level BPE tokenizer (digits are single tokens) and wraps it as a `PreTrainedTokenizerFast` with a
   chat template whose turn boundaries are special tokens, so rendering is token-concatenative across turns.
3. Trains a tiny Llama from scratch on packed rows (attention stays inside each episode), loss on trained
   assistant tokens only, AdamW with warmup and cosine decay, for a fixed number of steps (the machine is shared,
   so wall time cannot be the budget). float32: bf16 autocast measured 2.8x slower on this CPU, which lacks
   AVX512-BF16; `base.bf16=true` turns it on where it pays.
4. Measures greedy accuracy on held-out `test` problems and, with `base.eval_reflection`, what reflection buys:
   attempt -> verifier feedback -> reflection -> redo decoded from x2 alone.

Files appear atomically: the model is built in `.base.partial/` and renamed to `base/`, and `base/metrics.json`,
the completion marker, is written last. Every `base.checkpoint_steps` the build saves its weights, optimizer state
and step in `.base.partial/checkpoint/` (the tokenizer is saved first, and the packed rows are a pure function of
it and the seed), so a rerun after a crash resumes from there and ends with the same weights as an unbroken run.
If `base/` holds a model but no metrics (a crash during evaluation), the rerun evaluates that model.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_model as save_safetensors_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
)

from redumix.data.arith import LINE, REFLECT_CLOSE, REFLECT_OPEN, Episode, apply
from redumix.data.chat import ASSISTANT, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS, SYSTEM, USER
from redumix.data.prompts import Message, attempt_messages, critique_messages, redo_messages, reflect_messages
from redumix.data.task import Example, Task
from redumix.data.tasks import flat_settings, make_task
from redumix.pipeline.config import BaseConfig, Config
from redumix.pipeline.run import (
    RunDir,
    atomic_write_json,
    atomic_write_text,
    barrier,
    log_metrics,
    print0,
    rank,
    read_json,
)

# --- tokenizer ----------------------------------------------------------------------------------------------------


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


# --- corpus -> packed rows ----------------------------------------------------------------------------------------


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
    config: BaseConfig, tokenizer: PreTrainedTokenizerFast, seed: int, vocab_size: int | None = None
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


def lr_at(step: int, config: BaseConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(
    model: LlamaForCausalLM, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], config: BaseConfig,
    run: RunDir | None, checkpoint: Path | None = None,
) -> dict[str, float]:
    """Train for config.steps, resuming from `checkpoint` when it holds a saved step, and saving there as it goes.

    Step s reads packed rows [s·batch_rows, (s+1)·batch_rows), and nothing else is random, so a resumed run
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
        print0(f"base: resuming from step {first} of {config.steps} ({checkpoint})")
    model.train()
    start = time.perf_counter() - elapsed_before
    bar = tqdm(range(first, config.steps), desc="base", disable=rank() != 0, mininterval=2.0, initial=first,
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
        if run is not None and (step % 100 == 0 or step == config.steps - 1):
            log_metrics(run, "base", step=step, loss=round(ema, 4), lr=lr_at(step, config),
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


# --- measuring ----------------------------------------------------------------------------------------------------

_SPAN = re.compile(re.escape(REFLECT_OPEN) + r".*?(?:" + re.escape(REFLECT_CLOSE) + r"|$)", re.S)


def visible_text(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """What the user sees: hidden check spans removed, then every other special token."""
    text = _SPAN.sub("", tokenizer.decode(ids, skip_special_tokens=False))
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text.strip()


class _ForceCheckSpans(LogitsProcessor):
    """Opens a `<|reflect|>` span right after every visible ` = `: the hidden-span experiment's stand-in gate."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, prompt_len: int) -> None:
        self.trigger = tokenizer(" = ", add_special_tokens=False)["input_ids"]
        self.open_id = tokenizer.convert_tokens_to_ids(REFLECT_OPEN)
        self.close_id = tokenizer.convert_tokens_to_ids(REFLECT_CLOSE)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = len(self.trigger)
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            inside = ids.count(self.open_id) > ids.count(self.close_id)
            if not inside and ids[-k:] == self.trigger:
                scores[row] = float("-inf")
                scores[row, self.open_id] = 0.0
        return scores


@torch.inference_mode()
def greedy(
    model, tokenizer: PreTrainedTokenizerFast, conversations: list[list[Message]], max_new_tokens: int,
    batch_size: int, force_checks: bool = False,
) -> list[str]:
    """Greedy replies (visible text) to each conversation, batched with left padding."""
    tokenizer.padding_side = "left"
    replies = []
    for lo in range(0, len(conversations), batch_size):
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                 for c in conversations[lo : lo + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_len = batch["input_ids"].shape[1]
        processors = LogitsProcessorList([_ForceCheckSpans(tokenizer, prompt_len)] if force_checks else [])
        out = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, logits_processor=processors,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        replies += [visible_text(tokenizer, row[prompt_len:].tolist()) for row in out]
    return replies


def line_accuracy(solutions: list[str]) -> float:
    """Share of terse lines `a op b = r` whose r is right for their own a and b."""
    lines = [m for text in solutions for m in LINE.findall(text)]
    right = sum(apply(int(a), op, int(b)) == int(r) for a, op, b, r in lines)
    return right / max(1, len(lines))


def reflection_check(
    model, tokenizer: PreTrainedTokenizerFast, task: Task, examples: list[Example], attempts: list[str],
    feedback: str, batch_size: int,
) -> dict[str, float | int]:
    """attempt -> feedback -> reflection -> redo decoded from x2 alone (greedy): does reflecting fix answers?

    feedback "verifier" is the answer check; "self" is the model's own critique of its attempt.
    """
    if feedback == "verifier":
        notes = [task.feedback(a, e) for a, e in zip(attempts, examples, strict=True)]
        critique_right = None
    else:
        critiques = [critique_messages(e.prompt, a) for e, a in zip(examples, attempts, strict=True)]
        notes = greedy(model, tokenizer, critiques, 32, batch_size)
        truth = [task.feedback(a, e) for a, e in zip(attempts, examples, strict=True)]
        critique_right = sum(n.strip() == t for n, t in zip(notes, truth, strict=True)) / len(examples)
    reflections = greedy(model, tokenizer, [reflect_messages(e.prompt, a, r) for e, a, r in
                                            zip(examples, attempts, notes, strict=True)], 256, batch_size)
    redos = greedy(model, tokenizer, [redo_messages(e.prompt, a, r, c) for e, a, r, c in
                                      zip(examples, attempts, notes, reflections, strict=True)], 160, batch_size)
    before = [task.is_correct(a, e) for a, e in zip(attempts, examples, strict=True)]
    after = [task.is_correct(y, e) for y, e in zip(redos, examples, strict=True)]
    out = {
        "original_accuracy": round(sum(before) / len(examples), 4),
        "redo_accuracy": round(sum(after) / len(examples), 4),
        "fixed": sum(a and not b for a, b in zip(after, before, strict=True)),
        "broken": sum(b and not a for a, b in zip(after, before, strict=True)),
    }
    if critique_right is not None:
        out["critique_verdict_accuracy"] = round(critique_right, 4)
    return out


def measure(model, tokenizer: PreTrainedTokenizerFast, config: Config, task: Task) -> dict:
    """Greedy accuracy on held-out test problems; with eval_reflection, what reflection and check spans buy."""
    base = config.base
    examples = task.examples("test", base.eval_n)
    attempts = greedy(model, tokenizer, [attempt_messages(e.prompt) for e in examples], 160, base.eval_batch_size)
    correct = [task.is_correct(a, e) for a, e in zip(attempts, examples, strict=True)]
    metrics: dict = {
        "n": len(examples),
        "accuracy": round(sum(correct) / len(examples), 4),
        "no_answer": sum(task.answer(a) is None for a in attempts),
        "line_accuracy": round(line_accuracy(attempts), 4),
    }
    if base.eval_reflection:
        metrics["reflection_verifier"] = reflection_check(model, tokenizer, task, examples, attempts, "verifier",
                                                          base.eval_batch_size)
        metrics["reflection_self"] = reflection_check(model, tokenizer, task, examples, attempts, "self",
                                                      base.eval_batch_size)
        forced = greedy(model, tokenizer, [attempt_messages(e.prompt) for e in examples], 400, base.eval_batch_size,
                        force_checks=True)
        metrics["forced_check_spans"] = {
            "accuracy": round(sum(map(task.is_correct, forced, examples)) / len(examples), 4),
            "line_accuracy": round(line_accuracy(forced), 4),
        }
    return metrics


# --- the stage ----------------------------------------------------------------------------------------------------


def base_is_complete(run: RunDir) -> bool:
    return (run.base / "metrics.json").is_file()


def training_task(config: Config) -> Task:
    """The task whose training text builds the base; only a task with `training_episodes` (arith) has one."""
    task = make_task(config.task, config.seed)
    if not hasattr(task, "training_episodes"):
        raise ValueError(
            f"task.name={task.name!r} has no training text for the embedded base; build the base with task.name=arith "
            "in another run folder, or set model.path to a local checkpoint"
        )
    return task


def build_base(config: Config, out_dir: Path, run: RunDir | None = None) -> dict:
    """Tokenizer, corpus, model and training into `out_dir` (no metrics). Returns build statistics.

    Resumes a build that `out_dir` holds from an earlier run of the same settings (its tokenizer and checkpoint).
    """
    base = config.base
    torch.set_num_threads(base.threads)
    settings = build_settings(config)
    episodes = training_task(config).training_episodes(base.corpus_spec())
    sample = list(itertools.islice(episodes, 3000))
    if (out_dir / "tokenizer.json").is_file() and _read_text(out_dir / "build_config.yaml") == settings:
        tokenizer = AutoTokenizer.from_pretrained(out_dir)  # the one this build trained before it stopped
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        tokenizer = train_tokenizer(episode_texts(sample) + [CHAT_TEMPLATE], base.vocab_size)
        tokenizer.save_pretrained(out_dir)
        atomic_write_text(out_dir / "build_config.yaml", settings)
    n_rows = base.steps * base.batch_rows
    *rows, counts = build_rows(tokenizer, itertools.chain(sample, episodes), n_rows, base.seq_len)
    model = build_model(base, tokenizer, config.seed)
    params = sum(p.numel() for p in model.parameters())
    print0(f"base: {params / 1e6:.2f}M parameters, vocab {len(tokenizer)}, {counts['episodes']} episodes packed "
           f"into {n_rows} rows of {base.seq_len} ({(rows[1] != -100).float().mean():.0%} of tokens trained)")
    stats = train_model(model, rows, base, run, checkpoint=out_dir / "checkpoint")
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)
    return {"parameters": params, "vocab_size": len(tokenizer), **counts, **stats}


def _read_text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


# Settings that change neither the weights nor metrics.json: a shipped build made with other values still applies.
_NOT_DECISIVE = ("threads", "checkpoint_steps", "eval_batch_size", "shipped")


def build_settings(config: Config) -> str:
    """What decides the built base (its `build_config.yaml`): a build is resumed or reused only when these match."""
    base = {k: v for k, v in asdict(config.base).items() if k not in _NOT_DECISIVE}
    return yaml.safe_dump({"seed": config.seed, "base": base, "task": flat_settings(config.task)}, sort_keys=False)


def shipped_base(config: Config) -> Path | None:
    """`base.shipped` when it holds a complete build of exactly these settings, else None (with the reason)."""
    if not config.base.shipped:
        return None
    folder = Path(config.base.shipped)
    if not (folder / "metrics.json").is_file():
        print0(f"base: base.shipped={folder} holds no complete build (no metrics.json); building from the code")
        return None
    if _read_text(folder / "build_config.yaml") != build_settings(config):
        print0(f"base: the build in base.shipped={folder} was made with other settings (its build_config.yaml "
               "differs from this recipe's seed, base and task); building from the code")
        return None
    return folder


def copy_shipped_base(folder: Path, run: RunDir) -> None:
    partial = run.root / ".base.shipped.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(folder, partial)
    partial.rename(run.base)
    accuracy = read_json(run.base / "metrics.json")["accuracy"]
    log_metrics(run, "base", shipped_from=str(folder), accuracy=accuracy)
    print0(f"base: copied the shipped build {folder} (greedy {accuracy:.1%} on held-out problems) into {run.base}; "
           "`redumix base` builds it from the code instead")


def ensure_base(config: Config, run: RunDir) -> None:
    """The embedded default on first use, by rank 0 while the others wait: the shipped build when it matches the
    recipe's settings, else built from the code."""
    if config.model.path == "base" and not base_is_complete(run):
        if rank() == 0:
            shipped = shipped_base(config)
            if shipped is not None and not run.base.exists():
                copy_shipped_base(shipped, run)
            else:
                print0("base: the embedded default model is not built yet; building it first")
                run_base(config, run)
        barrier()


def run_base(config: Config, run: RunDir) -> None:
    start = time.perf_counter()
    if base_is_complete(run):
        print0(f"base: complete ({run.base / 'metrics.json'} exists); delete {run.base} to rebuild")
        return
    torch.set_num_threads(config.base.threads)
    if (run.base / "config.json").is_file() and (run.base / "build.json").is_file():
        print0(f"base: {run.base} holds a trained model without metrics; evaluating it")
        build = read_json(run.base / "build.json")
    else:
        # Kept across a crash: the next run resumes the build from its checkpoint.
        partial = run.root / ".base.partial"
        shutil.rmtree(run.base, ignore_errors=True)
        build = build_base(config, partial, run)
        atomic_write_json(partial / "build.json", build)
        partial.rename(run.base)
    model = AutoModelForCausalLM.from_pretrained(run.base).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.base)
    measured = measure(model, tokenizer, config, training_task(config))
    metrics = {**measured, "build": build, "wall_seconds": round(time.perf_counter() - start, 1)}
    log_metrics(run, "base", **{k: v for k, v in measured.items() if not isinstance(v, dict)},
                wall_seconds=metrics["wall_seconds"])
    atomic_write_json(run.base / "metrics.json", metrics)  # the completion marker: last
    print0(f"base: greedy accuracy {measured['accuracy']:.1%} on {measured['n']} held-out problems"
           + (f"; x2-only redo after verifier feedback {measured['reflection_verifier']['redo_accuracy']:.1%}"
              if "reflection_verifier" in measured else "") + f" ({metrics['wall_seconds']:.0f} s)")
