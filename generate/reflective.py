"""Hidden-KV Reflective Decoding (the reflective-decoding seed paper, sections 3.2-3.9).

When the next visible token is uncertain, the row pauses its visible output, appends R_START to its KV cache,
decodes hidden tokens under a reflection policy, and appends R_END; then visible decoding resumes from a cache
that holds the reflection. The user never sees the hidden tokens or the markers.

Features and the settings that switch them (`ReflectiveConfig`, in reflective_config.py):
- The gate (seed 3.2): `gate`, `tau_high`/`tau_low` (hysteresis), `cooldown`; `ablation` swaps the gating signal
  for a periodic or random trigger, or keeps the gate with fixed-length reflections and no stop.
- Trigger points: `trigger_after` (e.g. `[" = "]`) lets a reflection start only where the visible text so far ends
  with one of the strings, the way Speculative Thinking hands off to the large model only after "\\n\\n". It applies
  to the gate and to the periodic/random ablations alike, so only the gating signal differs between a gated run and
  its ablations. A periodic ablation triggers at the first trigger point once `period` visible tokens have passed.
- How a reflection ends, `stop` (besides `reflect_length` and `budget_total`, which always end it):
  `end_marker` (default): only the model's own R_END ends it (single-id markers); no peek is ever fed.
  `peek`: the seed's rule (3.4), a peek with u <= `tau_stop` after R_END, or the model's own R_END.
  `peek_agree`: a confident peek that also agrees with the check the span just finished (see `peek_agrees`), or
  the model's own R_END. `ReflectiveResult.end_reasons` records why each reflection ended.
- Hidden tokens are greedy by default (`reflect_temperature` 0).

Where each part lives: the settings in reflective_config.py, the decode loop (phase by phase) and its result in
reflective_loop.py, the markers and banlists in reflective_markers.py, the gate, trigger points and peek_agree's test
in reflective_rules.py, one step's forward with its peek in reflective_step.py, and this module the eval decoder.

Why the defaults are what they are, from runs on the embedded arithmetic model, which was trained with hidden check
spans (`54 * 3 = <|reflect|>50 * 3 = 150, 4 * 3 = 12, 150 + 12 = 162<|/reflect|>162` after ` = ` on terse lines);
docs/measurements.md ("Reflective decoding") has the numbers:
- The copy trap: a peek stop rewards spans whose end a model can copy. After a one-digit junk span, the visible
  token after R_END copies the span's last number, so the peek's u is near zero and the peek ends nearly every span
  after a hidden token or two: `peek` loses half the accuracy that `end_marker` gains. Hence `end_marker` by default.
- Ungated, spans also opened where training never put them (mostly inside a number): hence `trigger_after`.
- Sampled hidden tokens cost accuracy against greedy ones, and a reflect_length below the median training span cut
  the checks short: hence greedy, 48 (and budget_total 128).
- `peek_agree` ends almost every span where the model's own R_END would (its peek agrees with the finished check),
  so on a model trained with the markers it matches `end_marker`'s accuracy and only adds the peeks' cost.

How it differs from the seed's pseudocode, and why:
- Batched: every example is a row of one `DecodeState` with its own state machine (visible or hidden mode,
  armed/cooldown, budgets). Each step feeds one segment per row: a visible token, R_START, or a hidden token.
- The peek is a *crop-back branch*, not a cache copy: the hidden token h and R_END go through the model in one
  forward pass ("dual-path batching", seed 3.4): the logits at h's position are the next hidden distribution, the
  logits after R_END are the peek. Causal attention means h's logits cannot see R_END. If the row goes on
  reflecting, R_END is cropped back off (physically when no row keeps its peek, else masked out as a hole).
  `dual_path=False` runs the same thing as two forward passes (the sequential baseline `make bench` compares).
- When the peek says stop, its R_END *is* the main path's R_END: the branch is adopted, not recomputed. The seed's
  formula FPE = V + H(1+m_e) + N_ref(m_s+m_e) charges that append twice. Here, with N_model the reflections the
  model ended itself (it wrote R_END, m_e = 1):
    peek, peek_agree: FPE = prefill + V_fed + H(1+m_e) + N_ref·m_s + N_model·m_e
    end_marker, fixed: FPE = prefill + V_fed + H + N_ref(m_s+m_e)  (no peeks are fed)
  Each part is in the result (`hidden_tokens`, `peek_tokens`, `marker_tokens`), and the sum equals
  `ForwardCounter`'s count.
- Δ-NLL is measured on the first visible token emitted after a reflection, under the model's own distribution
  (temperature 1, banlist applied, no truncation, so it stays finite): NLL after minus NLL before. Δ-uncertainty is
  the gate's u after minus before. Negative means the reflection made the model surer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redumix.data.task import Example, Task
from redumix.generate.decoder import Decoded, attempt_prompts, example_seeds
from redumix.generate.engine import Engine
from redumix.generate.hf_engine import hf_parts
from redumix.generate.model_io import stop_token_ids
from redumix.generate.policy import SamplingPolicy
from redumix.generate.reflective_config import ReflectiveConfig  # the config and the eval import it from here
from redumix.generate.reflective_loop import reflective_generate


@dataclass
class ReflectiveDecoder:
    """`reflective` and its ablations (`reflective-periodic|random|fixed`, set by config.ablation).

    Besides the counts, each record keeps `trigger_points` (visible steps at a trigger point, which
    `matched_ablations` needs to match the random ablation's rate) and the `end_reasons` of its reflections.
    """

    name: str
    config: ReflectiveConfig
    policy: SamplingPolicy
    seed: int

    needs_hf_engine = True  # it reads the cache token by token to decide when to reflect

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        model, tokenizer = hf_parts(engine)
        results = reflective_generate(model, tokenizer, attempt_prompts(tokenizer, examples), self.policy,
                                      example_seeds(self.seed, examples, self.name),
                                      stop_token_ids(model, tokenizer), tokenizer.pad_token_id, self.config)
        return [
            Decoded(r.text, r.token_ids, r.usage, {
                "n_reflections": r.n_reflections, "hidden_tokens": r.hidden_tokens,
                "delta_uncertainty": r.delta_uncertainty, "delta_nll": r.delta_nll,
                "visible_tokens": len(r.token_ids), "trigger_points": sum(r.at_trigger), "end_reasons": r.end_reasons,
            })
            for r in results
        ]
