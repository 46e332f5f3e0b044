#!/usr/bin/env bash
# The GPU check in one command: the cuda tier (tests marked `cuda`), then benchmarks/gpu_suite.py within what is left
# of a total budget, on one CUDA GPU that cannot reach the network (the project's lent machines: docs/testing.md).
#
#   benchmarks/gpu_run.sh prepare   here, with the package registry: the wheels to carry, into .gpu-wheels/ (ignored by
#                                   git): this package's, torchao 0.18.0 (the release for torch >= 2.11), the `cli`
#                                   extra's pieces the GPU image lacks (jsonargparse, docstring-parser,
#                                   typeshed-client) and pytest, for the image's Python (GPU_PYTHON, default 3.12)
#   benchmarks/gpu_run.sh           there: installs .gpu-wheels/ into .gpu-site/ (no network, nothing of the image's
#                                   replaced), runs the cuda tier (at most TIER_SECONDS, default 170), then the suite
#                                   with --budget what is left of TOTAL_SECONDS (default 540, inside the device tool's
#                                   600 s a command) less a margin for its last row; results in $OUT (the device tool's
#                                   folder that comes back) or benchmarks/results/gpu-<date>
#
# With the device tool: `benchmarks/gpu_run.sh prepare` here, then run `benchmarks/gpu_run.sh` there with
# carry=[".gpu-wheels"]. Exits 0 when the tier passed and the suite ran a row, 1 otherwise; every step's output is also
# in the results folder (environment.txt, cuda_tier.txt and .xml, gpu_suite.md and .json, gpu_suite.log).
#
# SMOKE=1 runs the same steps on a CPU (the tier with LIGHTNING_PRECISION_CUDA_TIER=cpu, the suite with --smoke): a
# check of this script, not of any GPU. GPU_WHEELS and GPU_SITE move the two folders; SUITE_ARGS adds arguments to the
# suite's (e.g. "--only encoder,true"); PYTHON names the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=${GPU_SITE:-.gpu-site}
python=${PYTHON:-python3}  # the image's Python (with torch and Lightning)

if [ "${1:-}" = "prepare" ]; then
    set -e
    python_version=${GPU_PYTHON:-3.12}
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    "$python" -m pip wheel -q --no-deps . -w "$WHEELS"
    "$python" -m pip download -q --only-binary=:all: --no-deps --implementation cp --python-version "$python_version" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" \
        torchao==0.18.0 jsonargparse docstring-parser typeshed-client pytest pluggy iniconfig pygments packaging
    du -sh "$WHEELS"
    ls "$WHEELS"
    exit 0
elif [ -n "${1:-}" ]; then
    echo "usage: benchmarks/gpu_run.sh [prepare]" >&2
    exit 2
fi

start=$(date +%s)
total=${TOTAL_SECONDS:-540}
tier_seconds=${TIER_SECONDS:-170}
out=${OUT:-benchmarks/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
elapsed() { echo $(( $(date +%s) - start )); }

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_run.sh: no wheels in $WHEELS: run 'benchmarks/gpu_run.sh prepare' where the registry is reachable, and" \
         "carry $WHEELS" >&2
    exit 1
fi
rm -rf "$SITE"
"$python" -m pip install -q --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH="$(cd "$SITE" && pwd)${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1
    "$python" -c "import sys, torch, lightning, torchao, lightning_precision; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'torchao',
torchao.__version__, 'from', torchao.__file__, 'lightning_precision from', lightning_precision.__file__, 'device',
torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
} | tee "$out/environment.txt"

smoke=()
if [ "${SMOKE:-0}" = 1 ]; then
    export LIGHTNING_PRECISION_CUDA_TIER=cpu
    smoke=(--smoke)
fi
read -r -a suite_args <<<"${SUITE_ARGS:-}"

echo "=== the cuda tier ($(elapsed) s)"
timeout --signal=TERM --kill-after=10 "$tier_seconds" "$python" -m pytest -q -p no:cacheprovider -m cuda tests/gpu/test_cuda.py \
    --junitxml="$out/cuda_tier.xml" 2>&1 | tee "$out/cuda_tier.txt"
tier_status=${PIPESTATUS[0]}
echo "cuda tier: exit $tier_status after $(elapsed) s"

budget=$(( total - $(elapsed) - 40 ))  # 40 s: the last row's overrun, and writing the results
suite_status=1
if [ "$budget" -ge 60 ]; then
    echo "=== gpu_suite.py --budget $budget ($(elapsed) s)"
    timeout --signal=TERM --kill-after=10 $(( budget + 30 )) "$python" benchmarks/gpu_suite.py --budget "$budget" \
        --out "$out" "${smoke[@]}" "${suite_args[@]}" 2>"$out/gpu_suite.log" | tail -n 200
    suite_status=${PIPESTATUS[0]}
    tail -n 40 "$out/gpu_suite.log"
else
    echo "gpu_suite.py not run: $budget s left of $total" | tee "$out/gpu_suite.log"
fi
echo "gpu_run.sh: cuda tier exit $tier_status, suite exit $suite_status, $(elapsed) s; results in $out"
[ "$tier_status" = 0 ] && [ "$suite_status" = 0 ]
