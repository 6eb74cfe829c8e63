"""`redumix calibrate`: pick Reflective Decoding's settings on train-split problems, never on test ones, and print
the overrides that use them.

1. τ_high (with τ_low and τ_stop at their configured gaps below it), so that reflections start at
   `reflective.calibrate_rate` per visible token (`calibrate_tau`).
2. The stop rule: the same problems are decoded with the calibrated gate and each of end_marker, peek and
   peek_agree, graded by the task, and the most accurate rule is kept (`choose_stop`). end_marker is left out
   when the tokenizer's markers are not single ids, since a model cannot write such an R_END.

The result is a setting, so it goes into the recipe (or ARGS), where every later stage reads it, and into
logs/metrics.jsonl as the record of what was measured: one `calibrate` line, and one `calibrate_stop` line per
candidate rule (accuracy, reflections, hidden and peek tokens, FPE, end reasons).
"""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from redumix.common.files import log_metrics
from redumix.common.ranks import print0, rank
from redumix.data.tasks import make_task
from redumix.generate.decoder import attempt_prompts, example_seeds
from redumix.generate.model_io import load_model, stop_token_ids
from redumix.generate.reflective_config import STOP_RULES, ReflectiveConfig
from redumix.generate.reflective_loop import ReflectiveResult, reflective_generate
from redumix.generate.reflective_markers import resolve_markers
from redumix.generate.reflective_tuning import calibrate_tau, choose_stop
from redumix.pipeline.config import Config
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.run import RunDir, model_path


def run_calibrate(config: Config, run: RunDir) -> None:
    ensure_embedded(config, run)
    model, tokenizer = load_model(model_path(config.model.path, run), config.model)
    # Another seed than the harvest's, so the calibration problems are not the ones the harvest trains on.
    task = make_task(config.task, config.seed + 1)
    examples = task.examples("train", config.eval.n_other)
    prompts = attempt_prompts(tokenizer, examples)
    seeds = example_seeds(config.seed, examples, "calibrate")
    stop_ids = stop_token_ids(model, tokenizer)

    def decode(settings: ReflectiveConfig) -> list[ReflectiveResult]:
        """Every prompt, in batches of eval.batch_size under one progress bar (each prompt has its own seed, so the
        batching changes nothing decoded)."""
        batch = config.eval.batch_size
        results: list[ReflectiveResult] = []
        starts = range(0, len(prompts), batch)
        for lo in tqdm(starts, desc=f"calibrate (stop={settings.stop})", unit="batch", disable=rank() != 0):
            results += reflective_generate(model, tokenizer, prompts[lo : lo + batch], config.sampling,
                                           seeds[lo : lo + batch], stop_ids, tokenizer.pad_token_id, settings)
        return results

    def decode_and_grade(settings: ReflectiveConfig) -> tuple[list[ReflectiveResult], list[bool]]:
        results = decode(settings)
        return results, [task.is_correct(r.text, ex) for r, ex in zip(results, examples, strict=True)]

    settings = config.reflective
    single = resolve_markers(tokenizer, settings).single_ids
    candidates = [s for s in STOP_RULES if single or s != "end_marker"]
    if settings.stop not in candidates:
        print0(f"calibrate: {tokenizer.name_or_path} has no single-id markers, so stop=end_marker cannot run; "
               f"calibrating with stop={candidates[0]}")
        settings = dataclasses.replace(settings, stop=candidates[0])

    # --- the gate's thresholds
    result = calibrate_tau(decode, settings)
    log_metrics(run.metrics, "calibrate", **vars(result))
    print0(f"calibrate: reflection rate {result.measured_rate:.3f} per visible token (target {result.target_rate})")
    # Every uncertainty measure is >= 0, so thresholds carried below 0 by the configured gaps switch a rule off.
    if result.tau_low <= 0:
        print0(f"calibrate: warning: tau_low {result.tau_low:.4f} <= 0, so the gate never re-arms (one reflection "
               "per problem at most); set reflective.tau_low closer to tau_high and calibrate again")
    if result.tau_stop < 0:
        print0(f"calibrate: warning: tau_stop {result.tau_stop:.4f} < 0, so no peek ends a reflection: peek and "
               "peek_agree decode as end_marker does, plus the peeks' cost")

    # --- the stop rule, with the calibrated gate
    tuned = dataclasses.replace(settings, tau_high=result.tau_high, tau_low=result.tau_low, tau_stop=result.tau_stop)
    choice = choose_stop(decode_and_grade, tuned, candidates)
    for trial in choice.trials:
        log_metrics(run.metrics, "calibrate_stop", chosen=trial.stop == choice.stop, **vars(trial))
        print0(f"calibrate: stop={trial.stop:<10} accuracy {trial.accuracy:.3f} on {trial.n} train problems, "
               f"{trial.reflections} reflections, {trial.hidden_tokens} hidden tokens, FPE {trial.fpe}, "
               f"ends {trial.end_reasons}")
    print0(f"use it with: ARGS=\"reflective.tau_high={result.tau_high:.4f} reflective.tau_low={result.tau_low:.4f} "
           f"reflective.tau_stop={result.tau_stop:.4f} reflective.stop={choice.stop}\"")
