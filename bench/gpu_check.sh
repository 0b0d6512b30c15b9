#!/usr/bin/env bash
# The device check: everything the CUDA backend does that no CPU can show, in one run.
#
#   bash bench/gpu_check.sh --prepare   # on a machine with network access (CPU, a few
#                                       # minutes): plans the throughput schedule into
#                                       # .gpu_check/ and fetches the pulp wheel into .whl/
#   bash bench/gpu_check.sh             # on the GPU machine, from the repository root, with
#                                       # .gpu_check/ and .whl/ copied beside it
#
# On the GPU (PyTorch 2.11 there, no network, no pulp), each part with its own timeout,
# 7.5 minutes at most in all:
#   1. the machine: nvidia-smi, torch, NCCL                                   (about 10 s)
#   2. tests/test_gpu.py (-m gpu): bitwise exactness of every small schedule, fp32 and
#      bf16 + accumulation + clipping, host-stepped blocks included; GPT-2 small under late
#      copies and NaN-poisoned buffers (bitwise, host tier used, memory within the bound),
#      with the broken-ordering controls that must fail; the emulated smaller GPU; 2 ranks
#      on the one GPU through gloo, bitwise equal to the averaged reference; nccl refused
#      there                                                                    (240 s)
#   3. bench/gpu_throughput.py: GPT-2 medium, sequence 1024, batch 8, on a 16G card
#      emulated: karma first from the carried schedule (planned at 14.5G), then the plain loop,
#      checkpoint and save_on_cpu, each with its own timeout       (75 s + 3 x 40 s)
# It writes $OUT/summary.md, the one file bench/RESULTS.md quotes, with the logs beside it
# ($OUT when it is set, else /tmp/karma-gpu-check).
set -uo pipefail
SCHEDULE=.gpu_check/gpt2-medium-h200-14.5G.yaml
PY=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p .gpu_check .whl
    KARMA_GPT=medium KARMA_SEQ=1024 PYTHONPATH="$PWD" $PY -m karma.cli.plan examples/gpt.py \
        --hardware h200-141g --gpu-mem 14.5G --batch-size 8 --time-limit 20 -o "$SCHEDULE"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d .whl pulp==3.3.2
    ls -l "$SCHEDULE" .whl
    exit 0
fi

OUT=${OUT:-/tmp/karma-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
if ! $PY -c "import pulp" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
start=$(date +%s)
summary="$OUT/summary.md"
{
    echo "# bench/gpu_check.sh, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    nvidia-smi -L
    $PY -c "import torch, torch.distributed as d; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', d.is_nccl_available() and torch.cuda.nccl.version())"
    $PY -c "import torch; from karma.runtime.backends.cuda_backend import CudaBackend; CudaBackend(); torch.empty(1 << 20, device='cuda'); print('expandable segments after CudaBackend():', all(s['is_expandable'] for s in torch.cuda.memory_snapshot()))"
} 2>&1 | tee "$summary"

echo -e "\n## tests/test_gpu.py\n" >> "$summary"
timeout 240 $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfEs \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
{
    echo "exit $tests_rc after $(( $(date +%s) - start )) s (124: timed out)"
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log" | tail -40 | sed 's/^/    /'
} >> "$summary"

echo -e "\n## bench/gpu_throughput.py\n" >> "$summary"
carried=()
if [ -f "$SCHEDULE" ]; then
    carried=(--schedule "$SCHEDULE")
else
    echo "no carried schedule ($SCHEDULE): karma plans on the GPU machine (run --prepare first)" \
        | tee -a "$summary"
fi
timeout 230 $PY bench/gpu_throughput.py --size medium --seq 1024 --batch-size 8 --cap 16G \
    --gpu-mem 14.5G "${carried[@]}" --steps 4 --karma-timeout-s 75 --timeout-s 40 \
    --out "$OUT/throughput" 2>&1 | tee "$OUT/throughput.log"
cat "$OUT/throughput/throughput.md" >> "$summary" 2>/dev/null \
    || echo "no table: see throughput.log" >> "$summary"

echo -e "\ntotal: $(( $(date +%s) - start )) s" | tee -a "$summary"
