"""`redumix train`: distil the stored mixture p_mix into the base model, which sees only the original prompt.

Reads RUN_DIR/harvest, keeps the rows `train.rows` selects, holds out a hashed few percent of them, and trains with
the sparse generalized JSD (train/loss.py) through TRL. `train.method=sdft` trains the same rows with TRL's
SDFTTrainer instead (train/sdft.py): the student's own samples, a teacher shown x2. Writes RUN_DIR/train/:
  checkpoints/checkpoint-N/  HF Trainer checkpoints (weights, optimizer, scheduler, data position, RNG)
  adapter/                   the peft adapter (train.adapter 'lora')
  merged/                    base + adapter merged, with the tokenizer: loads with plain AutoModelForCausalLM
  config.yaml                the resolved config
  metrics.json               written last: held-out KL of base and merged model, losses, counts, wall time
A rerun after a kill resumes from the last checkpoint. A rerun after metrics.json exists does nothing, unless the
base or the harvest it records in `inputs` changed since (pipeline/lineage.py): then it trains again from the start.
Either way the model's own settings (`train_settings`, kept in settings.json) must be those it was trained with: a
rerun with another learning rate, seed or loss is refused, naming the keys, rather than resumed or called complete.
Multi-process runs come from torchrun (see the Makefile); `train.deepspeed` selects a ZeRO config in recipes/.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from datasets import concatenate_datasets
from transformers import PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from redumix.common.files import atomic_write_json, atomic_write_text, log_metrics, read_json, read_json_or_none
from redumix.common.ranks import peak_rss_mb, print0, rank, world_size
from redumix.data.tasks import make_task
from redumix.embedded import CONTEXT_ONLY, replay_conversations
from redumix.generate.model_io import load_tokenizer, load_weights, stop_token_ids
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.config import Config, load_config
from redumix.pipeline.harvest_folder import check_harvest, claim_settings
from redumix.pipeline.lineage import changed_inputs, harvest_id, model_id
from redumix.pipeline.resolve import ConfigError, config_to_yaml
from redumix.pipeline.run import EMBEDDED, RunDir, model_path
from redumix.train.data import (
    build_examples,
    conversation_examples,
    filter_rows,
    load_harvest,
    skill_examples,
    split_heldout,
)
from redumix.train.onpolicy import LiveMixtureTeacher
from redumix.train.trainer import TrainerSetup, build_trainer, heldout_kl

STAGE = "train"


def run_train(config: Config, run: RunDir, callbacks: list[TrainerCallback] | None = None) -> dict[str, Any]:
    """Train, merge, score, and write the completion marker. `callbacks` are extra HF TrainerCallbacks (tests)."""
    started = time.time()
    tc = config.train
    model_path = base_model_path(config, run)
    harvest_dir = Path(tc.harvest_dir) if tc.harvest_dir else run.harvest
    harvest_dirs = [harvest_dir, *map(Path, tc.more_harvests)]
    for folder in harvest_dirs:
        check_harvest(folder)
    inputs = {"base": model_id(model_path), "harvest": harvest_id(harvest_dir)}
    if tc.more_harvests:
        inputs["more_harvests"] = [harvest_id(folder) for folder in harvest_dirs[1:]]
    marker = run.train / "metrics.json"
    if not changed_inputs(recorded_inputs(run.train), inputs):  # what is here was made from these inputs
        claim_train_settings(config, run.train)  # and with these settings, or it is neither resumed nor complete
        if marker.is_file():
            print0(f"train: already complete ({marker}); delete {run.train} to train again")
            return read_json(marker)
    tokenizer = load_tokenizer(model_path, config.model.trust_remote_code)

    # --- rows -> examples -----------------------------------------------------------------------------------------
    harvested = concatenate_datasets([load_harvest(folder) for folder in harvest_dirs])
    rows = filter_rows(harvested, tc.rows)
    train_rows, held_rows = split_heldout(rows, tc.heldout_fraction)
    held_rows = held_rows.select(range(min(len(held_rows), tc.heldout_max_rows)))
    solutions = gold_solutions(config) if tc.target == "gold" else None
    on_policy = tc.policy == "on_policy"
    if tc.method == "sdft":  # prompts and x2's turns: TRL samples the student and tokenises both itself
        # Imported here: trl.experimental warns on import, and only this arm uses it.
        from redumix.train.sdft import build_sdft_trainer, sdft_examples

        train_examples = sdft_examples(train_rows, tokenizer, tc.max_length, tc.onpolicy_max_new_tokens)
    else:
        train_examples = build_examples(train_rows, tokenizer, tc.max_length, tc.target, solutions, on_policy)
    # The held-out KL is always against the stored p_mix, whatever the arm learns toward: one yardstick for all.
    held_examples = build_examples(held_rows, tokenizer, tc.max_length)
    counts = {"harvested": len(harvested), "selected": len(rows), "train": len(train_examples),
              "heldout": len(held_examples)}
    if tc.skill_rows:  # the trainer's sampler shuffles them in among the x -> y examples
        skill = skill_examples(train_rows, tokenizer, tc.max_length)
        if len(skill):  # none when no redo was right
            train_examples = concatenate_datasets([train_examples, skill.cast(train_examples.features)])
        counts["skill"] = len(skill)
    if tc.replay:
        wanted = round(len(train_examples) * tc.replay / (1 - tc.replay))
        context_only = frozenset(tokenizer.convert_tokens_to_ids(list(CONTEXT_ONLY)))
        replay = conversation_examples(replay_conversations(
            config.task, config.embedded.corpus, config.seed, wanted), tokenizer, tc.max_length, context_only)
        train_examples = concatenate_datasets([train_examples, replay.cast(train_examples.features)])
        counts["replay"] = len(replay)
    print0(f"train: rows {counts} (filter '{tc.rows}', method '{tc.method}', target '{tc.target}', "
           f"policy '{tc.policy}')")
    if len(train_examples) == 0:
        if any(train_rows["redo_token_ids"]):  # rows with a redo, but every prompt alone fills train.max_length
            raise ValueError(
                f"train: no rows to learn from in {harvest_dir}: every selected prompt fills "
                f"train.max_length={tc.max_length} tokens by itself, leaving no room for its redo; "
                "raise train.max_length"
            )
        raise ValueError(
            f"train: no rows to learn from in {harvest_dir} with train.rows={tc.rows!r} "
            f"({len(harvested)} harvested, {len(rows)} selected); try train.rows=all or harvest more"
        )
    forget_stale_outputs(run.train, inputs)  # the first write to train/: bad rows above leave no folder
    claim_train_settings(config, run.train)
    if rank() == 0:
        atomic_write_text(run.train / "config.yaml", config_to_yaml(config))

    # --- train (resuming from the last checkpoint if there is one) ------------------------------------------------
    checkpoints = run.train / "checkpoints"
    model = load_weights(model_path, config.model)
    seed = trainer_seed(config)
    callbacks = [MetricsToRunLog(run), *(callbacks or [])]
    setup = TrainerSetup(str(checkpoints), seed, use_cpu(config), world_size(), tuple(callbacks))
    if tc.method == "sdft":
        trainer = build_sdft_trainer(model, tokenizer, train_examples, tc, setup)
    else:
        teacher = live_teacher(config, model_path, model, tokenizer, seed) if on_policy else None
        trainer = build_trainer(model, tokenizer, train_examples, tc, setup, live_teacher=teacher)
    last = last_complete_checkpoint(checkpoints)
    if last:
        print0(f"train: resuming from {last}")
    began = time.time()
    trainer.train(resume_from_checkpoint=last)
    train_seconds = time.time() - began  # of this run's steps (a resumed run's earlier steps are not in it)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    # --- outputs: adapter, merged model (all ranks save: ZeRO-3 gathers the weights) -----------------------------
    saved = run.train / ".saved.tmp"
    trainer.save_model(str(saved))
    trainer.accelerator.wait_for_everyone()
    if rank() != 0:
        return {}
    _drop_deepspeed_init()
    merged = run.train / "merged"
    if tc.adapter == "lora":
        _replace_dir(saved, run.train / "adapter")
        merge_adapter(model_path, run.train / "adapter", merged, tokenizer, config)
    else:
        tokenizer.save_pretrained(str(saved))
        _replace_dir(saved, merged)

    # --- held-out KL(p_mix ‖ model), base against merged: undefined (null, and why) with no held-out tokens --------
    device = train_device(config)
    kl_base = kl_merged = None
    no_heldout = heldout_missing(tc, len(rows), len(held_rows)) if len(held_examples) == 0 else None
    if no_heldout is None:
        kl_base = heldout_kl(load_weights(model_path, config.model).to(device), held_examples, tokenizer.pad_token_id)
        kl_merged = heldout_kl(load_weights(merged, config.model).to(device), held_examples, tokenizer.pad_token_id)
    result = {
        "rows": counts,
        "method": tc.method if tc.method == "gkd" else f"sdft-{tc.sdft_teacher}",  # as the evidence arms name it
        "target": tc.target,
        "policy": tc.policy,
        "steps": trainer.state.global_step,
        "seconds_per_step": round(train_seconds / max(trainer.state.global_step, 1), 4),
        "final_loss": losses[-1] if losses else None,
        "heldout_kl_base": kl_base,
        "heldout_kl_merged": kl_merged,
        **({"heldout_note": no_heldout} if no_heldout else {}),  # why the held-out KL is null
        "heldout_tokens": sum(len(e["input_ids"]) - e["prompt_length"] for e in held_examples),
        "wall_seconds": round(time.time() - started, 1),
        "peak_rss_mb": peak_rss_mb(),
        "inputs": inputs,  # the base and harvest it was made from: a rerun after either changed trains again
    }
    log_metrics(run.metrics, STAGE, **{k: v for k, v in result.items() if k != "rows"})
    kl = (f"base {kl_base:.4f} -> merged {kl_merged:.4f} ({result['heldout_tokens']} tokens)" if no_heldout is None
          else f"undefined ({no_heldout})")
    print0(f"train: held-out KL(p_mix ‖ model) per token: {kl}; {result['steps']} steps in {result['wall_seconds']} s")
    atomic_write_json(run.train / "metrics.json", result)  # the completion marker, last
    return result


# --- helpers --------------------------------------------------------------------------------------------------------


def recorded_inputs(out: Path) -> dict | None:
    """The inputs a train folder's outputs were made from (inputs.json, else the completion marker's), or None."""
    recorded = read_json_or_none(out / "inputs.json")
    if recorded is None and (out / "metrics.json").is_file():
        recorded = read_json(out / "metrics.json").get("inputs")
    return recorded


# Train settings that change how the stage runs, not the model it makes: they may change between sittings.
_HOW_IT_RUNS = frozenset({"harvest_dir", "more_harvests", "deepspeed", "gradient_checkpointing", "save_steps",
                          "save_total_limit", "logging_steps", "report_to"})


def train_settings(config: Config) -> dict[str, Any]:
    """What the trained model depends on besides its inputs' hashes: the train section (less `_HOW_IT_RUNS`; the
    harvests are their hashes in `inputs`) with the seed it trains with, the weights' dtype, and what the arm reads
    from elsewhere (the on-policy teacher's λ and redo, gold's solutions and replay's conversations)."""
    tc = config.train
    train = {k: v for k, v in dataclasses.asdict(tc).items() if k not in _HOW_IT_RUNS}
    train["seed"] = trainer_seed(config)  # the one it trains with, however it was set
    # The sampler is kept where it samples and is off its default only, so that every setting written before the key
    # existed (all sampled by `generate`, or by no sampler at all) still matches.
    if tc.method != "sdft" or tc.sdft_sampler == "generate":
        del train["sdft_sampler"]
    settings: dict[str, Any] = {"model.dtype": config.model.dtype, "train": train}
    if tc.policy == "on_policy":
        settings["redumix"] = dataclasses.asdict(config.redumix)
    if tc.target == "gold" or tc.replay:
        settings["task"] = dataclasses.asdict(config.task)
    if tc.replay:  # the run's seed draws the replayed conversations
        settings["seed"] = config.seed
    return settings


def claim_train_settings(config: Config, out: Path) -> None:
    """Refuse to resume, or to call complete, a train folder trained with other `train_settings`, naming each key
    that differs. A folder from before settings.json is held to the config.yaml it was written with."""
    path = out / "settings.json"
    if not path.exists() and (out / "config.yaml").is_file():
        try:
            claim_settings(path, train_settings(load_config(out / "config.yaml")), "", "")
        except ConfigError as e:  # written by a redumix whose keys this one does not know: nothing to hold it to
            print0(f"train: {out / 'config.yaml'} no longer loads ({e}); its settings are not checked")
    claim_settings(path, train_settings(config), "checkpoints and model",
                   f"delete {out} to train again with these settings, or use another --run-dir")


def forget_stale_outputs(out: Path, inputs: dict[str, str | None]) -> None:
    """Clear `out` when what it holds (finished or not) was made from other inputs, then record these inputs.

    Rank 0 clears and records; the other ranks wait until the record is this run's, so none resumes a checkpoint
    that belongs to another harvest.
    """
    record = out / "inputs.json"
    if rank() != 0:
        deadline = time.time() + 600
        while not (record.is_file() and read_json_or_none(record) == inputs):
            if time.time() > deadline:
                raise RuntimeError(f"train: rank 0 did not record this run's inputs in {record} within 10 minutes")
            time.sleep(0.1)
        return
    changed = changed_inputs(recorded_inputs(out), inputs) if out.exists() and any(out.iterdir()) else []
    if changed:
        print0(f"train: {out} was made from another {' and '.join(changed)} than the one here now; "
               "it is stale, so it is trained again from the start")
        shutil.rmtree(out)
    atomic_write_json(record, inputs)


def heldout_missing(tc: Any, selected: int, held_rows: int) -> str:
    """Why there is no held-out token to score the KL on: metrics.json's `heldout_note` beside the null figures."""
    if held_rows == 0 and tc.heldout_max_rows == 0:
        return "train.heldout_max_rows=0 holds no rows out"
    if held_rows == 0:
        return (f"no held-out rows: train.heldout_fraction={tc.heldout_fraction} of the {selected} selected rows "
                "held none out; harvest more rows, or raise train.heldout_fraction")
    return (f"each of the {held_rows} held-out rows' prompt fills train.max_length={tc.max_length} by itself, "
            "leaving no redo token to score")


def base_model_path(config: Config, run: RunDir) -> Path:
    """The checkpoint train starts from (the untuned base): model.path, or the embedded model in the run folder."""
    path = model_path(config.model.path, run)
    if not (path / "config.json").is_file():
        hint = ("run `redumix embedded` first" if config.model.path == EMBEDDED
                else "set model.path to a local HF folder")
        raise FileNotFoundError(f"no model at {path} ({hint})")
    return path


def gold_solutions(config: Config) -> dict[str, str]:
    """The task's reference working for the rows (train.target gold), from the split and range they came from."""
    task = make_task(config.task, config.seed)
    return task.solutions(config.harvest.split, config.harvest.skip + config.harvest.n)


def live_teacher(
    config: Config, model_path: Path, student: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, seed: int
) -> LiveMixtureTeacher:
    """The on-policy teacher: the starting model, frozen. With LoRA the student with its adapter disabled is that
    model; with full fine-tuning it is a second copy, loaded from the same folder."""
    tc = config.train
    frozen = None
    if tc.adapter == "full":
        frozen = load_weights(model_path, config.model).to(train_device(config)).eval().requires_grad_(False)
    policy = SamplingPolicy(temperature=tc.onpolicy_temperature, max_new_tokens=tc.onpolicy_max_new_tokens)
    return LiveMixtureTeacher(frozen, tc.onpolicy_topk, policy, stop_token_ids(student, tokenizer),
                              tokenizer.pad_token_id, tc.max_length, seed)


def last_complete_checkpoint(folder: Path) -> str | None:
    """The newest checkpoint that HF Trainer finished writing, or None.

    Trainer writes `trainer_state.json` last, so a kill while it saves leaves a newest folder without it (or with it
    cut short). `get_last_checkpoint` would pick that folder and the resume would fail. Such a folder is skipped;
    the resumed run writes it again when it reaches that step.
    """
    if not folder.is_dir():
        return None
    steps = []
    for path in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = path.name.rpartition("-")[2]
        if path.is_dir() and suffix.isdigit():
            steps.append((int(suffix), path))
    for _, path in sorted(steps, reverse=True):
        try:
            read_json(path / "trainer_state.json")
        except (OSError, ValueError):
            print0(f"train: {path.name} was not finished when the last run stopped; not resuming from it")
            continue
        return str(path)
    return None


def trainer_seed(config: Config) -> int:
    """The seed the trainer runs with: train.seed, or the run's where it is -1."""
    return config.seed if config.train.seed < 0 else config.train.seed


def use_cpu(config: Config) -> bool:
    return config.model.device == "cpu" or not torch.cuda.is_available()


def train_device(config: Config) -> str:
    """Where rank 0's extra models (the frozen teacher, the held-out KL's) go: the GPU unless the config says CPU."""
    return "cuda" if torch.cuda.is_available() and not use_cpu(config) else "cpu"


def merge_adapter(
    model_path: Path, adapter: Path, out: Path, tokenizer: PreTrainedTokenizerBase, config: Config
) -> None:
    """Base + adapter -> a plain HF model folder (no peft needed to load it), written under a temporary name."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(load_weights(model_path, config.model), str(adapter)).merge_and_unload()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    _replace_dir(tmp, out)


def _replace_dir(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    src.rename(dst)


def _drop_deepspeed_init() -> None:
    """After a ZeRO-3 run, later from_pretrained calls must not build partitioned models on rank 0 alone."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


class MetricsToRunLog(TrainerCallback):
    """Every Trainer log (loss, learning rate, grad norm) becomes a line of logs/metrics.jsonl."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and state.is_world_process_zero:
            log_metrics(self.run.metrics, STAGE, step=state.global_step, **logs)
