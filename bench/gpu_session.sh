#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine that has PyTorch but no network and not this project installed: install the
# wheels carried in .whl/ (TRL, datasets and what they need that the machine lacks), put the checkout on the path as
# `redumix.*` (links, as `make lint` does for mypy), print the versions, then run the check. Its table ends the
# output; with OUT set, the rows are also written to $OUT/gpu_check.json.
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
$python -c 'import torch, transformers, trl, peft, datasets, pyarrow; print("torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__, "| trl", trl.__version__, "| peft", peft.__version__, "| datasets", datasets.__version__, "| pyarrow", pyarrow.__version__)'
$python -m bench.gpu_check ${OUT:+--json "$OUT/gpu_check.json"} "$@"
