#!/usr/bin/env bash
# The device check: the `gpu` tests and the GPU throughput benchmark, in under 6 minutes.
#
#   bash bench/gpu_check.sh            # on a machine with CUDA, from the repository root
#
# On the lent H200 (PyTorch 2.11 there, no network, no pulp): carry the pulp wheel, made here
# with `pip download --no-deps --only-binary=:all: -d .whl pulp==3.3.2` (.whl is ignored by
# git), as `carry: [".whl"]`. Logs go to $OUT (the device tool's folder) or /tmp.
set -uo pipefail
OUT=${OUT:-/tmp/karma-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
PY=${PYTHON:-python3}
if ! $PY -c "import pulp" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
timeout 210 $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log"
echo "gpu tests: $(( $(date +%s) - start )) s"
timeout 150 $PY bench/gpu_throughput.py --size medium --seq 1024 --batch-size 8 --cap 16G \
    --steps 5 --out "$OUT/throughput" 2>&1 | tee "$OUT/throughput.log"
echo "total: $(( $(date +%s) - start )) s"
