#!/usr/bin/env bash
# The GPU benchmark set in one command, most important first. Steps 1-4 are the
# essentials, about 12 minutes on an H200 (most of it compiling); each step runs in its
# own process under its own time limit, so one slow step cannot eat the rest.
#
#     bash bench/run_gpu.sh                          # JSON into bench/results/
#     bash bench/run_gpu.sh /tmp/h100                # JSON and the test log into /tmp/h100/
#     bash bench/run_gpu.sh --budget 450 /tmp/h100   # every step ends within 450 s in all
#     bash bench/run_gpu.sh --cpu-check /tmp/check   # every step on the CPU at tiny sizes,
#                                                    # limits and budget x3 (about 4 minutes)
#     bash bench/run_gpu.sh --cpu-check --quick /tmp/check   # no compiling but O1's optimizer
#                                                    # step, tests not collected (about 30 s)
#     bash bench/run_gpu.sh --steps optimizer,gpt /tmp/h100  # only the steps named, in the
#                                                    # script's order
#
# Steps, most important first (limit in seconds on the GPU, as an H200 with torch 2.11
# needed on 2026-11-28; steps 1-5 add up to 830, so the default budget cuts the tests):
#   1 optimizer  150  LowBitAdam O1/O2/O3 (fused) vs torch's fused AdamW over 1B, then 300M
#                     parameters of 1024 x 1024 layers
#   2 kernels     60  the optimizer step's kernels by name at 300M parameters, O1-O3 and
#                     torch's fused AdamW
#   3 static-shapes 120  amp8's compiled functions (the optimizer's update at 300M
#                     parameters, O2 and O3; the casts of a 2048 -> 8192 -> 2048 MLP on 8192
#                     tokens) as amp8 compiles them (dynamic shapes) and for static shapes,
#                     their kernels on the device clock; the generated code of both in
#                     OUT/kernel-sources.tar.gz
#   4 gpt        290  gpt-1b training step: BF16, torchao tensorwise, amp8 O1/O2/O3, compiled
#                     then eager (amp8 O1/O2 eager with compiled casts too), the optimizer
#                     timed apart
#   5 cuda-tests 240  the CUDA-only tests (pytest -m cuda), each failure printed as it
#                     happens; their output in OUT/cuda-tests.log
#   6 llama      150  the same step, compiled, on four layers of Llama-3-8B's shapes, in what
#                     is left of --budget
#   7 linear      90  Fp8Linear at 16 x 64 x 64 (what a layer costs the host: every mode's
#                     time there is launches and Python) and the three headline shapes:
#                     eager, eager with amp8's compiled casts, compiled, rowwise, torchao,
#                     against nn.Linear, in what is left of --budget
#   8 plain       90  the optimizer step over Llama-3.2-1B's tied table (128,256 x 2,048,
#                     float32 with low-bit moments) at O2, updated in place against copied
#                     through its group, in what is left of --budget
#   9 sweep      -    optional: the shape sweep and (K, N) grid, in whatever is left of
#                     --budget (default 600 s); cut short, it is not a failure
# Every benchmark rewrites its JSON after each row, so a step cut short keeps what it
# measured; the whole output goes to OUT/run_gpu.log too. torchao's rows run where
# torchao imports and are recorded as skipped elsewhere.
# --cpu-check runs each step with --device cpu at tiny sizes (the tests are only
# collected: they need an FP8 GPU), to try the whole script before a GPU run.
#
# Exit status: 0 when every step passed; else the sum of the failed steps' bits (1
# cuda-tests, 2 optimizer, 4 gpt, 8 llama, 16 linear, 32 kernels, 128 static-shapes, 256
# plain; a step
# that runs out of time fails); 64 for bad arguments or no CUDA device. The run writes
# about ten files into OUT: pack them into one where fewer can be carried back.
set -u

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

mode=gpu
quick=0
budget=""
out=""
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-check) mode=cpu ;;
        --quick) quick=1 ;;
        --budget)
            if [[ $# -lt 2 || ! "$2" =~ ^[0-9]+$ ]]; then
                echo "--budget takes whole seconds, e.g. --budget 540" >&2; exit 64
            fi
            budget=$2; shift ;;
        --steps)
            if [[ $# -lt 2 || ! "$2" =~ ^[a-z,-]+$ ]]; then
                echo "--steps takes step names joined by commas, e.g. --steps optimizer,gpt" >&2; exit 64
            fi
            only=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "unknown option $1; see bash $0 --help" >&2; exit 64 ;;
        *) out=$1 ;;
    esac
    shift
done

if [ "$quick" = 1 ] && [ "$mode" != cpu ]; then
    echo "--quick goes with --cpu-check: bash $0 --cpu-check --quick OUT" >&2; exit 64
fi
if [ "$mode" = cpu ]; then
    scale=3  # limits and budget x3: compiling on a small CPU is slower than on a GPU machine
else
    scale=1
fi
budget=${budget:-$((600 * scale))}
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${out:-$repo/bench/results}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$repo"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's amp8
export PYTHONUNBUFFERED=1  # a step's output is in the log when its time runs out
start_all=$SECONDS
failed=0
exec > >(tee "$out/run_gpu.log") 2>&1  # the whole run's output, kept beside the JSON

# Step arguments: the GPU sizes, or tiny ones that take the same code paths on the CPU.
if [ "$mode" = gpu ]; then
    python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 64
    device=cuda
    tests=(-m cuda -n 12 -v --tb=short --continue-on-collection-errors tests)  # -v: each result named as it ends
    optimizer=(--sizes 1000 300 --widths 1024 --repeats 3)  # the targets' size first
    # torchao rowwise (measured 2026-11-28) and amp8 O2 with compiled slots (2026-11-30)
    # each compile the model once more, which the budget spends better on the tests
    gpt=(--preset gpt-1b --batch-size 8 --warmup 2 --steps 5 --runs baseline torchao "amp8 O1" "amp8 O2"
         "amp8 O3" "amp8 O1 compiled casts" "amp8 O2 compiled casts")
    llama=(--preset llama3-8b-layers --batch-size 1 --warmup 2 --steps 5 --modes compiled)
    linear=(--shapes 16,64,64 1024,2048,1024 4096,8192,16384 8192,8192,8192 --warmup 5 --repeats 20)
    kernels=(--millions 300)
    static_shapes=(--tokens 8192 --width 2048 --mlp 4 --millions 300 --levels O2 O3 --repeats 5)
    sweep=(--sweep --warmup 3 --repeats 10)
    plain=(--vocab 128256 --width 2048 --batch 4 --tokens 512 --levels O2 --repeats 5)
else
    echo "CPU check: every step with --device cpu at tiny sizes; the numbers check the script, not FP8's speed"
    echo "cuda-tests: collected, not run: they need a CUDA GPU with FP8 (sm_89+)"
    device=cpu
    tests=(-q -m cuda -n 0 --collect-only tests)
    optimizer=(--sizes 1 --widths 256 --repeats 1)
    gpt=(--preset tiny --batch-size 2 --warmup 1 --steps 1)
    llama=(--preset llama-tiny --batch-size 2 --warmup 1 --steps 1 --modes compiled)
    linear=(--shapes 64,128,64 --warmup 1 --repeats 1)
    kernels=(--millions 1 --width 256 --levels O1 --warmup 1 --steps 1)
    static_shapes=(--tokens 32 --width 32 --mlp 2 --millions 1 --levels O2 --repeats 1)
    sweep=(--sweep --shapes 64,128,64 --sweep-m 64 --grid 64 128 --warmup 0 --repeats 1 --no-compile)
    plain=(--vocab 512 --width 32 --blocks 1 --levels O2 --steps eager --repeats 1 --in-place-elements 4096)
    if [ "$quick" = 1 ]; then
        echo "quick: the models run eagerly, the optimizer at O1 alone, the tests are not collected"
        tests=()
        optimizer+=(--levels O1)
        gpt+=(--modes eager)
        llama+=(--modes eager)
        linear+=(--no-compile)
        static_shapes=()
    fi
fi
python -c "import sys; sys.path.insert(0, 'bench'); from common import torchao_float8; print('torchao:', torchao_float8()[1])"

asked() {  # asked NAME: whether --steps (or its absence) asks for the step NAME
    [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]
}

step() {  # step BIT NAME SECONDS LOG COMMAND...: run COMMAND within SECONDS and the budget left,
          # its output also in the file LOG (- for none); a failure sets BIT in the exit status
    local bit=$1 name=$2 limit=$(($3 * scale)) log=$4
    shift 4
    if ! asked "$name"; then
        echo "== $name: not asked for (--steps $only)"
        return
    fi
    local left=$((budget - (SECONDS - start_all)))
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$limit" -le 0 ]; then
        echo "== $name: not run, the --budget of $budget s is spent"
        failed=$((failed | bit))
        return
    fi
    echo "== $name (limit $limit s)"
    local start=$SECONDS rc status=ok
    if [ "$log" = - ]; then
        timeout --kill-after=10 "$limit" "$@"
        rc=$?
    else
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="ran out of its $limit s (what it wrote is kept)"
        failed=$((failed | bit))
    elif [ $rc -ne 0 ]; then
        status="failed (exit $rc)"
        failed=$((failed | bit))
    fi
    echo "== $name: $((SECONDS - start)) s, $status"
}

step 2 optimizer 150 - python bench/optimizer.py --device $device "${optimizer[@]}" --fused-only --no-memory --out "$out"
step 32 kernels 60 - python bench/optimizer_kernels.py --device $device "${kernels[@]}" --out "$out"
if [ ${#static_shapes[@]} -gt 0 ] && asked static-shapes; then
    # Inductor's code for both variants, in a cache of this step's own, packed for reading.
    sources="$out/kernel-sources"
    rm -rf "$sources" && mkdir -p "$sources"
    step 128 static-shapes 120 - env TORCHINDUCTOR_CACHE_DIR="$sources" \
        python bench/static_shapes.py --device $device "${static_shapes[@]}" --out "$out"
    (cd "$sources" && grep -rl --include='*.py' async_compile . | tar czf "$out/kernel-sources.tar.gz" -T -)
    rm -rf "$sources"
elif asked static-shapes; then
    echo "== static-shapes: skipped (--quick: it compiles)"
else
    echo "== static-shapes: not asked for (--steps $only)"
fi
step 4 gpt 290 - python bench/gpt.py --device $device "${gpt[@]}" --out "$out"
if [ ${#tests[@]} -gt 0 ]; then
    # Each failure's traceback as its test ends: a run cut off at its limit still says why.
    step 1 cuda-tests 240 "$out/cuda-tests.log" env AMP8_SHOW_FAILURES_AT_ONCE=1 \
        python -m pytest -p no:cacheprovider "${tests[@]}"
elif asked cuda-tests; then
    echo "== cuda-tests: skipped (--quick)"
else
    echo "== cuda-tests: not asked for (--steps $only)"
fi
step 8 llama 150 - python bench/gpt.py --device $device "${llama[@]}" --out "$out"
step 16 linear 90 - python bench/linear.py --device $device "${linear[@]}" --out "$out"
step 256 plain 90 - python bench/plain_in_place.py --device $device "${plain[@]}" --out "$out"
step 0 sweep "$budget" - python bench/linear.py --device $device "${sweep[@]}" --out "$out"

echo "== all steps: $((SECONDS - start_all)) s; results in $out"
exit $failed
