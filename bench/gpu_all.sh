#!/usr/bin/env bash
# Every GPU measurement of the project in one command, for a CUDA host you hold for a few
# minutes only: the tests that need CUDA, then the kernel benchmark in float32 and bfloat16, then
# the server end to end with a CUDA cache against a CPU one. Each step has a time limit and the
# run goes on past a failed step; every step's output lands in OUTDIR/<step>.log and one line
# per step in OUTDIR/summary.txt.
#
#   bash bench/gpu_all.sh OUTDIR              # on the CUDA host
#   bash bench/gpu_all.sh --dry-run OUTDIR    # the same steps on a CPU machine: the tests are
#                                             # only collected, the benchmarks run their --dry-run
#
# The project and its dev extra must be importable by PYTHON (pip install -e '.[dev]'): the
# package aggsrv.kernels is the folder kernels/ only once installed. Environment: PYTHON (default
# python3), WORKERS (pytest-xdist workers for the tests, default 8; 0 runs them in one process).
# The limits add up to 9 minutes (each step is killed 5 s after its limit if it ignores the
# interrupt); the 400 MB server runs come first, since the server's target is about large
# uploads.
set -uo pipefail

dry=0
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: bash bench/gpu_all.sh [--dry-run] OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
workers=${WORKERS:-8}
if ! [[ $workers =~ ^[0-9]+$ ]]; then
    echo "WORKERS must be a number of pytest-xdist workers (0: none), not '$workers'" >&2
    exit 2
fi
if ! "$py" -c "import aggsrv.kernels, pytest, xdist" 2>"$out/import-error.txt"; then
    cat "$out/import-error.txt" >&2
    echo "$py cannot import the project and its test tools: pip install -e '.[dev]' first" >&2
    exit 2
fi
rm -f "$out/import-error.txt"
export PYTHONUNBUFFERED=1
: >"$out/summary.txt"
failed=0

# step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    local verdict=ok
    if [ "$rc" -ne 0 ] && [ "$took" -ge "$limit" ]; then
        verdict="stopped at its limit"
    elif [ "$rc" -ne 0 ]; then
        verdict="failed (exit $rc)"
    fi
    [ "$verdict" = ok ] || failed=1
    echo "$name: $verdict, $took s" | tee -a "$out/summary.txt"
}

# The tests that skip without CUDA, every Triton kernel's oracle tests run compiled, and the
# bit-for-bit check of uploads crossing to the device.
cuda_tests=(tests/kernels tests/transport/test_device_crossing.py
    tests/server/test_upload_crossing.py tests/server/test_server_failstop.py
    tests/client/test_client_train.py tests/strategies/test_strategy_guards.py)
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers")
# Flower's adapter tests need the flower extra, which a GPU host need not have.
select=(-k "not flower")

if [ "$dry" -eq 1 ]; then
    step tests 60 "$py" -m pytest -q -p no:cacheprovider --collect-only "${parallel[@]}" \
        "${select[@]}" "${cuda_tests[@]}"
    step kernels 120 "$py" bench/gpu_kernels.py --dry-run
    step server 240 "$py" bench/gpu_server.py --dry-run
else
    "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "no CUDA device here: use --dry-run on a CPU machine" >&2
        exit 2
    }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
    step tests 120 "$py" -m pytest -q -p no:cacheprovider "${parallel[@]}" "${select[@]}" \
        "${cuda_tests[@]}"
    step kernels-float32 60 "$py" bench/gpu_kernels.py
    step kernels-bfloat16 60 "$py" bench/gpu_kernels.py --dtype bfloat16
    step server-400mb 220 "$py" bench/gpu_server.py --model-mb 400 --seconds 8
    step server-67mb 80 "$py" bench/gpu_server.py --model-mb 67 --seconds 4
fi
echo "== summary"
cat "$out/summary.txt"
exit "$failed"
