"""The studies: stages that measure the product rather than make it. `ladder` (does a redo beat a second sample),
`evidence` (the controls and ablations of the distillation claim, with `rft`'s rows and `drift`'s measures),
`rounds` and `ablation` (self-improvement round after round, and which ingredient of its policy gains) and
`calibrate` (the reflective gate). They run the product's stages (pipeline/harvest.py, train.py, eval.py) and are
never imported by them."""
