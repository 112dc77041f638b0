#!/usr/bin/env bash
# The backward's checks and timings on a GPU: GPU tests, compute-sanitizer (racecheck,
# memcheck) over the forced tensor-core cases, the tensor-core variants at head_dim 128, and the
# benchmark beside SDPA; kvariants: the default's block orders and dQ stream (backward_variants
# --kernel-variants); wgmma: the wgmma tiles (tests/test_wgmma.py) on the device.
# Each step has its own time limit and log under the folder given (default:
# benchmarks/results/dev/gpu-backward-checks); a step that fails or runs out of time does not
# stop the others. All steps take up to 22 minutes, more than one 10-minute device
# call: name the steps to run a part.
#
#     bash benchmarks/gpu_backward_checks.sh "$OUT" wgmma pytest                  # <= 6.8 min
#     bash benchmarks/gpu_backward_checks.sh "$OUT" racecheck memcheck bench      # <= 7.7 min
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/dev/gpu-backward-checks}
shift || true
steps=${*:-wgmma pytest racecheck memcheck variants kvariants bench}
mkdir -p "$out"

step() {  # step NAME SECONDS COMMAND...: run it if asked for, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    [[ " $steps " == *" $name "* ]] || return 0
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$out/steps.txt"
}

step wgmma 90 python -m pytest -q tests/test_wgmma.py
step pytest 320 python -m pytest -q -m gpu tests/test_backward.py
for tool in racecheck memcheck; do
    step "$tool" 170 env NUMFLASH_LINEINFO=1 compute-sanitizer --tool "$tool" \
        --report-api-errors no python tests/sanitizer_cases.py --tensor-core-backward-only
done
step variants 150 python benchmarks/backward_variants.py --head-dims 128 --seqlens 4096 \
    --stages 2 --dq-separate 0 1 --head-split 1 2 --out "$out/variants.json"
step kvariants 240 python benchmarks/backward_variants.py --kernel-variants --head-dims 128 \
    --dtypes float16 bfloat16 --seqlens 4096 16384 --out "$out/kernel-variants.json"
step bench 120 python benchmarks/bench_backward.py --out-dir "$out"
