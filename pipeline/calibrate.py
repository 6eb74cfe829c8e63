"""`redumix calibrate`: pick the reflective gate's τ_high on train-split problems so that reflections start at
`reflective.calibrate_rate` per visible token, and print the overrides that use it.

The result is a setting, so it goes into the recipe (or ARGS), where every later stage reads it, and into
logs/metrics.jsonl as the record of what was measured.
"""

from __future__ import annotations

from redumix.data.tasks import make_task
from redumix.generate.decoder import attempt_prompts, example_seeds
from redumix.generate.model_io import load_model, stop_token_ids
from redumix.generate.reflective import ReflectiveConfig, ReflectiveResult, reflective_generate
from redumix.generate.reflective_tuning import calibrate_tau
from redumix.pipeline.base import ensure_base
from redumix.pipeline.config import Config
from redumix.pipeline.run import RunDir, log_metrics, model_path, print0


def run_calibrate(config: Config, run: RunDir) -> None:
    ensure_base(config, run)
    model, tokenizer = load_model(model_path(config.model.path, run), config.model.dtype, config.model.device,
                                  config.model.trust_remote_code)
    # Another seed than the harvest's, so the calibration problems are not the ones the harvest trains on.
    examples = make_task(config.task, config.seed + 1).examples("train", config.eval.n_other)
    prompts = attempt_prompts(tokenizer, examples)
    seeds = example_seeds(config.seed, examples, "calibrate")
    stop_ids = stop_token_ids(model, tokenizer)

    def decode(settings: ReflectiveConfig) -> list[ReflectiveResult]:
        return reflective_generate(model, tokenizer, prompts, config.sampling, seeds, stop_ids,
                                   tokenizer.pad_token_id, settings)

    result = calibrate_tau(decode, config.reflective)
    log_metrics(run, "calibrate", **vars(result))
    print0(f"calibrate: reflection rate {result.measured_rate:.3f} per visible token (target {result.target_rate})"
           f"\nuse it with: ARGS=\"reflective.tau_high={result.tau_high:.4f} "
           f"reflective.tau_low={result.tau_low:.4f} reflective.tau_stop={result.tau_stop:.4f}\"")
