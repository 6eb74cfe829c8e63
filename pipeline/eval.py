"""`redumix eval`: rerun the decoders on the base and tuned checkpoints over held-out problems, and report what
each decoder buys (accuracy, with a 95% Wilson interval) and what it costs (tokens, FPE, wall time).

Decoders, by name in `eval.decoders`:
  greedy, sample                     plain decoding (sample uses eval.sample_temperature)
  redumix-oracle[@λ], redumix-self   ReDuMix with verifier feedback (it knows the answer, hence "oracle") or the
                                     model's own critique; `@λ` overrides redumix.lam, for the λ sweep
  moi                                Mixture of Inputs
  pdr, sr                            Parallel-Distill-Refine; sr is the same with one draft
  reflective[-periodic|-random|-fixed]  hidden-KV Reflective Decoding and its ablations, matched to the gated
                                     run's hidden budget (the gated run goes first)

Resume: each (checkpoint, decoder) keeps its per-example records in `eval/generations/`, rewritten atomically
after every batch. A rerun skips the examples already scored. `report.json` is written last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm import tqdm

from redumix.data.grading import extract_answer, is_correct, verifier_feedback
from redumix.data.tasks import Example, load_examples
from redumix.pipeline.run import (
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    log_metrics,
    model_path,
    print0,
    read_json,
)

if TYPE_CHECKING:
    from redumix.pipeline.config import Config

DEFAULT_DECODERS = [
    "greedy", "sample", "redumix-oracle@1", "redumix-oracle", "redumix-oracle@0", "redumix-self", "moi", "pdr", "sr",
    "reflective", "reflective-periodic", "reflective-random", "reflective-fixed",
]


@dataclass
class EvalConfig:
    n: int = field(default=500, metadata={"help": "Held-out examples for greedy decoding."})
    n_other: int = field(default=200, metadata={"help": "Held-out examples for every other decoder (costlier)."})
    split: Literal["train", "test"] = field(default="test", metadata={"help": "Task split to evaluate on."})
    batch_size: int = field(default=32, metadata={"help": "Examples decoded together."})
    decoders: list[str] = field(default_factory=lambda: list(DEFAULT_DECODERS), metadata={"help": "Decoders to run."})
    checkpoints: list[Literal["base", "tuned"]] = field(
        default_factory=lambda: ["base", "tuned"],
        metadata={"help": "base = model.path; tuned = RUN_DIR/train/merged (skipped with a note if missing)."},
    )
    sample_temperature: float = field(default=0.7, metadata={"help": "Temperature of the `sample` decoder."})

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("n", "n_other", "batch_size") if getattr(self, name) < 1]
        for name in self.decoders:
            if decoder_family(name) is None:
                problems.append(f"unknown decoder {name!r} (known: {', '.join(DEFAULT_DECODERS)}, redumix-oracle@λ)")
        if problems:
            raise ValueError("; ".join(problems))


def decoder_family(name: str) -> str | None:
    base, _, lam = name.partition("@")
    if base in ("redumix-oracle", "redumix-self") and lam:
        try:
            return base if 0 <= float(lam) <= 1 else None
        except ValueError:
            return None
    return base if base in DEFAULT_DECODERS else None


# --- the stage ----------------------------------------------------------------------------------------------------


def run_eval(config: Config, run: RunDir) -> None:
    out = run.eval
    checkpoints = available_checkpoints(config, run)
    fingerprint = eval_fingerprint(config, checkpoints)
    report_path = out / "report.json"
    if report_path.exists() and read_json(report_path).get("fingerprint") == fingerprint:
        print0(f"eval: complete ({report_path}), skipping. Delete it to evaluate again.")
        return
    from redumix.pipeline.harvest import ensure_base

    ensure_base(config, run)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", _yaml(config))
    rows, diagnostics = [], {}
    for checkpoint, path in checkpoints.items():
        records = evaluate_checkpoint(config, run, checkpoint, path)
        for decoder, recs in records.items():
            rows.append(summarize(checkpoint, decoder, recs))
            if decoder_family(decoder) in ("reflective", "reflective-periodic", "reflective-random", "reflective-fixed"):
                diagnostics[f"{checkpoint}/{decoder}"] = reflection_diagnostics(recs)
    report = {"fingerprint": fingerprint, "task": config.task.name, "split": config.eval.split,
              "checkpoints": {k: str(v) for k, v in checkpoints.items()}, "rows": rows, "diagnostics": diagnostics}
    atomic_write_text(out / "report.md", report_markdown(report))
    plot_accuracy_vs_fpe(rows, out / "accuracy_vs_fpe.png")
    atomic_write_json(report_path, report)  # last: its presence means the stage is complete
    for row in rows:
        log_metrics(run, "eval", **{k: v for k, v in row.items() if isinstance(v, (int, float, str))})
    print0(report_markdown(report))


def available_checkpoints(config: Config, run: RunDir) -> dict[str, Path]:
    found = {}
    for name in config.eval.checkpoints:
        path = model_path(config.model.path, run) if name == "base" else run.train / "merged"
        if name == "tuned" and not (path / "config.json").is_file():
            print0(f"eval: no tuned checkpoint at {path} (run `redumix train` first); evaluating the others")
            continue
        found[name] = path
    return found


def evaluate_checkpoint(config: Config, run: RunDir, checkpoint: str, path: Path) -> dict[str, list[dict]]:
    from redumix.generate.model_io import load_model

    model, tokenizer = load_model(path, config.model.dtype, config.model.device, config.model.trust_remote_code)
    identity = f"{model_identity(path)}:{decoding_fingerprint(config)}"
    examples = load_examples(config.task, config.eval.split, max(config.eval.n, config.eval.n_other), config.seed)
    results = {}
    for decoder in config.eval.decoders:
        count = config.eval.n if decoder == "greedy" else config.eval.n_other
        results[decoder] = run_decoder_resumable(
            config, run, checkpoint, identity, decoder, model, tokenizer, examples[:count], results
        )
    return results


def run_decoder_resumable(config, run, checkpoint, identity, decoder, model, tokenizer, examples, earlier) -> list[dict]:
    """Score `examples` with one decoder, skipping ids already recorded for this model, saving after each batch."""
    path = run.eval / "generations" / f"{checkpoint}--{decoder.replace('@', '-lam')}.jsonl"
    done = {r["id"]: r for r in _read_records(path) if r.get("model") == identity}
    todo = [e for e in examples if e.id not in done]
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=f"eval {checkpoint}/{decoder}", unit="ex")
    for start in range(0, len(todo), config.eval.batch_size):
        batch = todo[start : start + config.eval.batch_size]
        began = time.perf_counter()
        outputs = decode(config, decoder, model, tokenizer, batch, earlier)
        seconds = (time.perf_counter() - began) / len(batch)
        for example, output in zip(batch, outputs, strict=True):
            done[example.id] = record(example, output, decoder, checkpoint, identity, seconds)
        wanted = [done[e.id] for e in examples if e.id in done]
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in wanted).encode())
        bar.update(len(batch))
        bar.set_postfix(acc=f"{sum(r['correct'] for r in wanted) / len(wanted):.2f}")
    bar.close()
    return [done[e.id] for e in examples]


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record(example: Example, output: dict, decoder: str, checkpoint: str, identity: str, seconds: float) -> dict:
    return {
        "id": example.id,
        "checkpoint": checkpoint,
        "decoder": decoder,
        "model": identity,
        "prompt": example.prompt,
        "reference": example.reference,
        "output": output["text"],
        "answer": extract_answer(output["text"]),
        "correct": is_correct(output["text"], example.reference),
        "tokens": output["tokens"],
        "fpe": output["fpe"],
        "prefill_tokens": output["prefill_tokens"],
        "seconds": round(seconds, 5),
        "extra": output.get("extra", {}),
    }


# --- decoders -----------------------------------------------------------------------------------------------------


def decode(config: Config, decoder: str, model, tokenizer, batch: list[Example], earlier: dict) -> list[dict]:
    """Run one decoder on a batch; each output is {text, tokens, fpe, prefill_tokens, extra}."""
    from redumix.data.prompts import attempt_messages
    from redumix.generate.chat import prompt_ids
    from redumix.generate.model_io import stop_token_ids
    from redumix.generate.policy import example_seed

    family = decoder_family(decoder)
    stop_ids = stop_token_ids(model, tokenizer)
    policy = config.sampling
    seeds = [example_seed(policy.seed, f"{e.id}/{decoder}") for e in batch]
    prompts = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in batch]
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    if family in ("greedy", "sample"):
        from redumix.generate.sampling import generate_batch

        if family == "greedy":
            policy = dataclasses.replace(policy, temperature=0.0)
        else:
            policy = dataclasses.replace(policy, temperature=config.eval.sample_temperature)
        gens = generate_batch(model, prompts, policy, seeds, stop_ids, tokenizer.pad_token_id)
        return [_plain(text(g.content_ids(stop_ids)), g.usage) for g in gens]
    if family == "moi":
        from redumix.generate.moi import moi_generate

        gens = moi_generate(model, prompts, policy, seeds, stop_ids, tokenizer.pad_token_id, config.moi)
        return [_plain(text(g.content_ids(stop_ids)), g.usage) for g in gens]
    if family in ("redumix-oracle", "redumix-self"):
        from redumix.generate.redumix import redumix_generate

        lam = float(decoder.partition("@")[2]) if "@" in decoder else None
        feedback = None
        if family == "redumix-oracle":
            feedback = lambda i, attempt: verifier_feedback(attempt, batch[i].reference)  # noqa: E731
        redumix_config = dataclasses.replace(config.redumix, feedback="self" if feedback is None else "verifier")
        results = redumix_generate(model, tokenizer, [e.prompt for e in batch], [e.id for e in batch],
                                   redumix_config, policy, stop_ids, feedback, lam=lam)
        return [
            {**_plain(r.redo, r.usage), "extra": {"original": r.original, "feedback": r.feedback,
                                                  "reflection": r.reflection, "lam": r.meta["lam"],
                                                  "original_correct": is_correct(r.original, e.reference)}}
            for r, e in zip(results, batch, strict=True)
        ]
    if family in ("pdr", "sr"):
        from redumix.generate.pdr import pdr_generate

        pdr_config = config.pdr if family == "pdr" else dataclasses.replace(config.pdr, drafts=1)
        results = pdr_generate(model, tokenizer, [e.prompt for e in batch], policy, seeds, stop_ids, pdr_config)
        return [
            {**_plain(r.text, r.usage), "extra": {"tokens_per_round": r.tokens_per_round,
                                                  "longest_context": r.longest_context,
                                                  "rounds": [asdict(x) for x in r.rounds]}}
            for r in results
        ]
    from redumix.generate.reflective import reflective_generate

    reflective_config = reflective_config_for(config, decoder, earlier)
    results = reflective_generate(model, tokenizer, prompts, policy, seeds, stop_ids, tokenizer.pad_token_id,
                                  reflective_config)
    return [
        {**_plain(r.text, r.usage), "extra": {"n_reflections": r.n_reflections, "hidden_tokens": r.hidden_tokens,
                                              "delta_uncertainty": r.delta_uncertainty, "delta_nll": r.delta_nll,
                                              "visible_tokens": len(r.token_ids)}}
        for r in results
    ]


def reflective_config_for(config: Config, decoder: str, earlier: dict[str, list[dict]]):
    """The gated decoder uses the recipe; an ablation is matched to the gated run's hidden budget."""
    from redumix.generate.reflective import matched_ablations

    if decoder == "reflective":
        return config.reflective
    gated = earlier.get("reflective")
    if not gated:
        raise ValueError(f"eval.decoders: {decoder!r} is matched to 'reflective', so list 'reflective' before it")
    visible = sum(r["extra"]["visible_tokens"] for r in gated)
    reflections = sum(r["extra"]["n_reflections"] for r in gated)
    hidden = sum(r["extra"]["hidden_tokens"] for r in gated)
    return matched_ablations(config.reflective, visible, reflections, hidden)[decoder]


def _plain(text: str, usage) -> dict:
    return {"text": text, "tokens": usage.visible_tokens, "fpe": usage.fpe, "prefill_tokens": usage.prefill_tokens}


# --- report -------------------------------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def summarize(checkpoint: str, decoder: str, records: list[dict]) -> dict[str, Any]:
    n = len(records)
    right = sum(r["correct"] for r in records)
    low, high = wilson_interval(right, n)
    tokens = sum(r["tokens"] for r in records)
    wall = sum(r["seconds"] for r in records)
    row = {
        "checkpoint": checkpoint,
        "decoder": decoder,
        "accuracy": right / max(n, 1),
        "n": n,
        "ci_low": low,
        "ci_high": high,
        "mean_tokens": tokens / max(n, 1),
        "mean_fpe": sum(r["fpe"] for r in records) / max(n, 1),
        "prefill_tokens": sum(r["prefill_tokens"] for r in records) / max(n, 1),
        "wall_s": round(wall, 2),
        "tokens_per_s": tokens / wall if wall else 0.0,
    }
    if decoder.startswith("redumix"):
        row["fixed"] = sum(r["correct"] and not r["extra"]["original_correct"] for r in records)
        row["broken"] = sum(r["extra"]["original_correct"] and not r["correct"] for r in records)
    if decoder in ("pdr", "sr"):
        row["longest_context"] = max((r["extra"]["longest_context"] for r in records), default=0)
        per_round = [r["extra"]["tokens_per_round"] for r in records]
        row["tokens_per_round"] = [sum(x) / len(per_round) for x in zip(*per_round, strict=True)] if per_round else []
    if decoder.startswith("reflective"):
        row["reflections_per_example"] = sum(r["extra"]["n_reflections"] for r in records) / max(n, 1)
        row["hidden_tokens_per_example"] = sum(r["extra"]["hidden_tokens"] for r in records) / max(n, 1)
    return row


def _quantiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "p10": pick(0.1), "p50": pick(0.5),
            "p90": pick(0.9)}


def reflection_diagnostics(records: list[dict]) -> dict:
    du = [v for r in records for v in r["extra"]["delta_uncertainty"]]
    dn = [v for r in records for v in r["extra"]["delta_nll"]]
    return {"delta_uncertainty": _quantiles(du), "delta_nll": _quantiles(dn)}


def report_markdown(report: dict) -> str:
    lines = [
        f"# redumix eval: {report['task']} ({report['split']} split)",
        "",
        "Accuracy with its 95% Wilson interval. FPE counts every token position the model processed (prefill "
        "included); prefill is the mean prompt positions per example. `redumix-oracle` gets verifier feedback, "
        "which knows the gold answer; `redumix-self` uses the model's own critique.",
        "",
        "| checkpoint | decoder | accuracy | 95% CI | n | mean tokens | mean FPE | prefill | wall s | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['checkpoint']} | {r['decoder']} | {r['accuracy']:.1%} | {r['ci_low']:.1%}–{r['ci_high']:.1%} | "
            f"{r['n']} | {r['mean_tokens']:.1f} | {r['mean_fpe']:.0f} | {r['prefill_tokens']:.0f} | "
            f"{r['wall_s']:.1f} | {r['tokens_per_s']:.0f} |"
        )
    extras = [r for r in report["rows"] if "fixed" in r or "longest_context" in r or "reflections_per_example" in r]
    if extras:
        lines += ["", "| checkpoint | decoder | details |", "|---|---|---|"]
        for r in extras:
            if "fixed" in r:
                detail = f"fixed {r['fixed']}, broke {r['broken']} (vs. its own first attempt)"
            elif "longest_context" in r:
                rounds = ", ".join(f"{t:.0f}" for t in r["tokens_per_round"])
                detail = f"tokens per round [{rounds}], longest context {r['longest_context']}"
            else:
                detail = (f"{r['reflections_per_example']:.2f} reflections and "
                          f"{r['hidden_tokens_per_example']:.1f} hidden tokens per example")
            lines.append(f"| {r['checkpoint']} | {r['decoder']} | {detail} |")
    if report["diagnostics"]:
        lines += ["", "Reflection diagnostics (after − before each reflection; negative is better):", "",
                  "| run | reflections | Δ-uncertainty mean / p10 / p50 / p90 | Δ-NLL mean / p10 / p50 / p90 |",
                  "|---|---|---|---|"]
        for name, d in report["diagnostics"].items():
            cells = []
            for key in ("delta_uncertainty", "delta_nll"):
                q = d[key]
                cells.append("–" if not q["count"] else
                             f"{q['mean']:+.3f} / {q['p10']:+.3f} / {q['p50']:+.3f} / {q['p90']:+.3f}")
            lines.append(f"| {name} | {d['delta_uncertainty']['count']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_fpe(rows: list[dict], path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for checkpoint, marker in (("base", "o"), ("tuned", "s")):
        points = [r for r in rows if r["checkpoint"] == checkpoint]
        if not points:
            continue
        xs = [r["mean_fpe"] for r in points]
        ys = [100 * r["accuracy"] for r in points]
        errors = [[100 * (r["accuracy"] - r["ci_low"]) for r in points], [100 * (r["ci_high"] - r["accuracy"]) for r in points]]
        ax.errorbar(xs, ys, yerr=errors, fmt=marker, capsize=3, label=checkpoint, alpha=0.85)
        for r, x, y in zip(points, xs, ys, strict=True):
            ax.annotate(r["decoder"], (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("mean forward-pass equivalents per example (log scale)")
    ax.set_ylabel("accuracy (%), 95% Wilson interval")
    ax.set_title("Accuracy against compute, per checkpoint and decoder")
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


# --- identity and fingerprints ------------------------------------------------------------------------------------


def model_identity(path: Path) -> str:
    """Changes when the checkpoint is rebuilt (a retrained tuned model must not reuse old records)."""
    parts = []
    for f in sorted(Path(path).glob("*.safetensors")) + [Path(path) / "config.json"]:
        stat = f.stat()
        parts.append(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def decoding_fingerprint(config: Config) -> str:
    """Everything besides the model that decides a record's text: a change invalidates the stored records."""
    decisive = {
        "seed": config.seed, "task": asdict(config.task), "sampling": asdict(config.sampling),
        "redumix": asdict(config.redumix), "moi": asdict(config.moi), "pdr": asdict(config.pdr),
        "reflective": asdict(config.reflective), "sample_temperature": config.eval.sample_temperature,
    }
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:12]


def eval_fingerprint(config: Config, checkpoints: dict[str, Path]) -> str:
    decisive = {
        "seed": config.seed, "task": asdict(config.task), "sampling": asdict(config.sampling),
        "redumix": asdict(config.redumix), "moi": asdict(config.moi), "pdr": asdict(config.pdr),
        "reflective": asdict(config.reflective), "eval": asdict(config.eval),
        "models": {k: model_identity(v) for k, v in checkpoints.items()},
    }
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:16]


def _yaml(config: Config) -> str:
    import yaml

    return yaml.safe_dump(asdict(config), sort_keys=False)


def run_calibrate(config: Config, run: RunDir) -> None:
    """Pick τ_high on a dev split so the gate fires at reflective.target_rate, and save it for eval to use."""
    from redumix.data.prompts import attempt_messages
    from redumix.generate.chat import prompt_ids
    from redumix.generate.model_io import load_model, stop_token_ids
    from redumix.generate.policy import example_seed
    from redumix.generate.reflective import calibrate_tau
    from redumix.pipeline.harvest import ensure_base

    ensure_base(config, run)
    model, tokenizer = load_model(model_path(config.model.path, run), config.model.dtype, config.model.device,
                                  config.model.trust_remote_code)
    examples = load_examples(config.task, "train", config.eval.n_other, config.seed + 1)
    prompts = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in examples]
    seeds = [example_seed(config.seed, f"{e.id}/calibrate") for e in examples]
    result = calibrate_tau(model, tokenizer, prompts, config.sampling, seeds, stop_token_ids(model, tokenizer),
                           tokenizer.pad_token_id, config.reflective)
    path = run.root / "calibration.json"
    atomic_write_json(path, dataclasses.asdict(result))
    print0(f"calibrate: reflection rate {result.measured_rate:.3f} per visible token (target {result.target_rate}) "
           f"-> {path}\nuse it with: ARGS=\"reflective.tau_high={result.tau_high:.4f} "
           f"reflective.tau_low={result.tau_low:.4f} reflective.tau_stop={result.tau_stop:.4f}\"")

