"""The embedded default model: a tiny Llama that the pipeline trains itself on arith, so a fresh CPU machine runs
the pipeline with no download (`redumix base`).

One module per part of the build: `vocab` (its special tokens and chat format), `corpus` (its training text),
`config` (the `base` config section), `tokenizer`, `pretrain` (packed rows, the model, the training loop and its
checkpoints), `measure` (what the built model scores, with generate/'s decoders) and `stage` (building, resuming,
reusing the shipped build). Stages import only `stage.ensure_base`, and the CLI `stage.run_base`.
"""
