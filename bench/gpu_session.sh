#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine that has PyTorch but no network and not this project installed: install the
# wheels carried in .whl/ (TRL, datasets and what they need that the machine lacks), put the checkout on the path as
# `redumix.*` (links, as `make lint` does for mypy), print the versions, then run the check. Its table ends the
# output; with OUT set, the rows are also written to $OUT/gpu_check.json, each as soon as it is done.
#
# One lease, one call: `bash bench/gpu_session.sh` runs the full check under a budget (BUDGET_S, default 300 s: no row
# starts after it, and the skipped checks are named), in gpu_check's order: the static path against the dynamic loop
# and the CUDA graph against eager, the decode step's ms and the harvest's examples/s of the `generate` loop, ours,
# the static path eager and as CUDA graphs side by side, at batch 16 and 64 on the Qwen2.5-1.5B and SmolLM2-135M
# shapes (random weights made on the GPU), then the checks earlier leases passed. Give the device call a timeout of
# BUDGET_S plus about 200 s (a row that starts before the budget may run past it). Extra arguments pass through
# (`--only step,throughput`, `--smoke`).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
site=/tmp/redumix-site
if compgen -G ".whl/*.whl" > /dev/null; then
  $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
if [ -n "$($python -c 'import pyarrow; print(int(pyarrow.__version__.split(".")[0]) < 24 or "")')" ] \
    && compgen -G ".whl/alt/*.whl" > /dev/null; then
  $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/alt/*.whl
fi
mkdir -p /tmp/redumix-pkg/redumix
ln -sfn "$PWD/pipeline/_root/__init__.py" /tmp/redumix-pkg/redumix/__init__.py
for d in common data embedded generate pipeline train; do ln -sfn "$PWD/$d" "/tmp/redumix-pkg/redumix/$d"; done
export PYTHONPATH="$site:/tmp/redumix-pkg:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$python - <<'PY'  # the versions; TRL and datasets only where their wheels came (the LoRA row needs them, no other)
import importlib
for name in ("torch", "transformers", "trl", "peft", "datasets", "pyarrow"):
    try:
        print(name, importlib.import_module(name).__version__, end=" | ")
    except ImportError:
        print(name, "missing", end=" | ")
import torch
print("cuda", torch.version.cuda)
PY
$python -m bench.gpu_check --budget-s "${BUDGET_S:-300}" ${OUT:+--json "$OUT/gpu_check.json"} "$@"
