#!/usr/bin/env bash
# The GPU benchmark set, one command; about 8 minutes on an H100 (most of it compiling).
#
#     bash bench/run_gpu.sh                 # JSON into bench/results/
#     bash bench/run_gpu.sh /tmp/h100       # JSON into /tmp/h100/
#
# Runs, most important first, each in its own process: Fp8Linear at the three headline
# shapes, a GPT training step at the gpt-1b preset, the optimizer step, then the shape
# sweep with the (K, N) grid for the layer-selection rule (written after every shape, so
# a sweep cut short keeps what it measured). A step that fails is reported and the next
# one still runs; the exit status is non-zero if any failed.
set -u

repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$repo/bench/results}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$repo"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's amp8
failed=()

run() {  # run NAME COMMAND...: time one step, remember a failure
    echo "== $1"
    local start=$SECONDS
    "${@:2}" || failed+=("$1")
    echo "== $1: $((SECONDS - start)) s"
}

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
run "linear, headline shapes" python bench/linear.py --device cuda --warmup 5 --repeats 20 --out "$out"
run "gpt, gpt-1b" python bench/gpt.py --device cuda --preset gpt-1b --batch-size 8 --steps 10 --out "$out"
# bench/optimizer.py has no output option: it writes bench/results/, copied from there.
run "optimizer" python bench/optimizer.py --device cuda --sizes 30 300
if [ "$out" != "$repo/bench/results" ]; then cp bench/results/optimizer-cuda.json "$out/" 2>/dev/null; fi
run "linear, sweep and grid" python bench/linear.py --device cuda --sweep --warmup 3 --repeats 10 --out "$out"

echo "results in $out"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
    exit 1
fi
