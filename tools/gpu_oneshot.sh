#!/usr/bin/env bash
# Everything devgraph needs from a lent CUDA GPU, in one command that ends before its deadline.
#
#   bash tools/gpu_oneshot.sh                  # the first call: ends within 9 minutes (--deadline 540)
#   bash tools/gpu_oneshot.sh --second         # the optional second call: what remains (--deadline 300)
#   bash tools/gpu_oneshot.sh --all            # both lists, one summary (nox -s tests-cuda; --deadline 3600)
#   bash tools/gpu_oneshot.sh --dry-run        # the same steps on --device cpu, smallest grids, seconds
#   bash tools/gpu_oneshot.sh --list           # the steps and their time limits; runs nothing
#   bash tools/gpu_oneshot.sh --steps env,decode_step   # only these steps of the list (its order)
#   bash tools/gpu_oneshot.sh --stamp          # here, before a run: the commit and tree state, for the copy
#
# Steps run in priority order, each under its own time limit (`timeout`: SIGABRT first, so every
# Python process writes its stacks to the step's log, then SIGKILL) and never past the global
# deadline; a step that fails or times out never stops the next. Everything lands in a run folder
# (ONESHOT_WORK/<mode>): summary.json, rewritten after every step (status, exit code, seconds, log,
# outputs, test counts), logs/, results/ (benchmarks write their JSON after every row), junit/ (and a
# JSON line per test as it ends, the stacks of a test that hangs past ONESHOT_TEST_TIMEOUT:
# tools/oneshot_pytest.py). After every step the run folder is packed into $OUT, as two files, because
# the lent machine returns at most 8 files from $OUT: <mode>-summary.json and <mode>.tar.gz.
# See docs/development.md.
#
# Every summary and every benchmark's JSON records the commit and whether the tree was clean
# ("checkout", tools/_provenance.py). A lent machine gets a copy of the tree without .git: run
# `bash tools/gpu_oneshot.sh --stamp` here first, which writes the git-ignored .oneshot-stamp.json
# (the commit, the changes, a digest of every file that travels), and carry it with the tree; a stamp
# whose files no longer match the tree is reported as stale, never as the commit.
#
# Uses the machine's own torch and installs nothing from the network: devgraph and its test packages
# are installed with pip --no-deps --no-build-isolation --no-index -e; where pip refuses, they are put
# on PYTHONPATH with generated .dist-info folders, so entry points (the toy backend's) are found too.
#
# Environment: OUT (default benchmarks/results/gpu_oneshot; a temporary folder for --dry-run),
# ONESHOT_WORK (where the run folder is built; default a temporary folder), PYTHON (default python3),
# ONESHOT_TEST_TIMEOUT (default 120 s per test), ONESHOT_LIMIT_<step> (seconds: one step's limit
# instead of its default; the tests of this script use it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }

ARGS="$*"
MODE=first DRY=0 DEVICE="" DEADLINE="" LIST=0 ONLY="" STAMP=0
while (($#)); do
    case $1 in
        --dry-run) DRY=1 ;;
        --second) MODE=second ;;
        --all) MODE=all ;;
        --list) LIST=1 ;;
        --stamp) STAMP=1 ;;
        --device) DEVICE=${2:?--device needs a value}; shift ;;
        --device=*) DEVICE=${1#*=} ;;
        --deadline) DEADLINE=${2:?--deadline needs seconds}; shift ;;
        --deadline=*) DEADLINE=${1#*=} ;;
        --steps) ONLY=${2:?--steps needs names}; shift ;;
        --steps=*) ONLY=${1#*=} ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_oneshot: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
if ((STAMP)); then exec "${PYTHON:-python3}" tools/_provenance.py stamp; fi
if ((DRY)); then DEVICE=${DEVICE:-cpu}; else DEVICE=${DEVICE:-cuda}; fi
case $MODE in first) DEADLINE=${DEADLINE:-540} ;; second) DEADLINE=${DEADLINE:-300} ;; all) DEADLINE=${DEADLINE:-3600} ;; esac
[[ $DEADLINE =~ ^[0-9]+$ ]] || { echo "gpu_oneshot: --deadline wants whole seconds, not $DEADLINE" >&2; exit 2; }

# name:limit in seconds, in priority order. The first call: what issue 43 needs most (the tests, the HF
# generate comparison, the decode step and the call's overhead side by side), then the rest as the
# deadline allows; the second: what remains. env and install open both (a second call may land on a
# fresh machine).
FIRST=(env:30 install:120 cuda_tests:210 any_device:180 hf_generate:150 decode_step:150 call_overhead:120
    host_overhead:120 smoke:60 failed_capture:60 bisect:150 replay_vs_eager:45 paged_attention:90)
SECOND=(env:30 install:120 breakable:90 piecewise:150 decode_step_compile:200 cpu_subset:240)
case $MODE in
    first) STEPS=("${FIRST[@]}") ;;
    second) STEPS=("${SECOND[@]}") ;;
    all) STEPS=("${FIRST[@]}" "${SECOND[@]:2}") ;;
esac
if [[ -n $ONLY ]]; then
    chosen=()
    for spec in "${STEPS[@]}"; do [[ ,$ONLY, == *,${spec%%:*},* ]] && chosen+=("$spec"); done
    for name in ${ONLY//,/ }; do
        printf '%s\n' "${STEPS[@]%%:*}" | grep -qx "$name" ||
            { echo "gpu_oneshot: no step $name in the $MODE list: ${STEPS[*]%%:*}" >&2; exit 2; }
    done
    STEPS=("${chosen[@]}")
fi
if ((LIST)); then
    echo "mode $MODE, device $DEVICE, deadline ${DEADLINE}s:"
    printf '  %s s\n' "${STEPS[@]/:/  }"
    exit 0
fi

PY=${PYTHON:-python3}
if [[ -z ${OUT:-} ]]; then
    if ((DRY)); then OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_oneshot.XXXXXX"); else OUT=$ROOT/benchmarks/results/gpu_oneshot; fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${ONESHOT_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_oneshot_work.XXXXXX")}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
case $WORK/ in "$OUT"/*) echo "gpu_oneshot: ONESHOT_WORK must lie outside OUT (only two files per mode go there)" >&2; exit 2 ;; esac
RUN=$WORK/$MODE
rm -rf "$RUN"
mkdir -p "$RUN/logs" "$RUN/results" "$RUN/junit"
SUMMARY=$RUN/summary.json

START=$(date +%s)
END_AT=$((START + DEADLINE - 12)) # room for a SIGKILL's grace (10 s) and the last summary
MIN_STEP_S=15
STEP_NO=0
ulimit -c 0 # SIGABRT at a time limit must not write a core of a CUDA process
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 # as the test suite: an NPU-less torch_npu must not break imports
export ROOT RUN PY DRY DEVICE
export ONESHOT_TEST_TIMEOUT=${ONESHOT_TEST_TIMEOUT:-120}
if ((DRY)); then export OMP_NUM_THREADS=1 DEVGRAPH_TEST_THREADS=1; fi

summary() { "$PY" "$ROOT/tools/_oneshot.py" "$@" >/dev/null; }

# $OUT/<mode>-summary.json and $OUT/<mode>.tar.gz (the run folder), each replaced whole. Files over
# 4 MiB stay out of the archive (named in excluded.txt inside it): a returned file may hold 16 MiB.
pack() {
    cp "$SUMMARY" "$OUT/.$MODE-summary.json.tmp" && mv -f "$OUT/.$MODE-summary.json.tmp" "$OUT/$MODE-summary.json"
    local big=() exclude=() f
    mapfile -t big < <(cd "$WORK" && find "$MODE" -type f -size +4M | sort)
    printf '%s\n' "${big[@]}" >"$RUN/excluded.txt"
    for f in "${big[@]}"; do exclude+=(--exclude="$f"); done
    tar -C "$WORK" -czf "$OUT/.$MODE.tar.gz.tmp" "${exclude[@]}" "$MODE" &&
        mv -f "$OUT/.$MODE.tar.gz.tmp" "$OUT/$MODE.tar.gz"
}

# -- the steps (each runs in its own bash, under `timeout`) ---------------------------------------------

step_env() {
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$PY" "$ROOT/tools/_oneshot.py" env "$RUN/results/env.json"
}

step_install() {
    local rc=1
    if ((DRY)); then
        echo "dry run: pip is not run (it would change this environment); the PYTHONPATH fallback is exercised instead"
    else
        "$PY" -m pip install --no-deps --no-build-isolation --no-index \
            -e . -e tests/sim -e tests/plugins/devgraph_toy_backend
        rc=$?
    fi
    if ((rc == 0)); then
        echo pip >"$RUN/install.method"
    else
        ((DRY)) || echo "pip refused (exit $rc): falling back to PYTHONPATH"
        # Built-in backends (cuda among them) need no entry point: devgraph registers them directly
        # (devgraph/_plugins.py). The toy backend's entry point comes from the generated .dist-info.
        "$PY" "$ROOT/tools/_oneshot.py" dist-info "$RUN/pythonpath" "$ROOT" || return 1
        echo "export PYTHONPATH=$ROOT:$ROOT/tests/sim:$ROOT/tests/plugins/devgraph_toy_backend:$RUN/pythonpath\${PYTHONPATH:+:\$PYTHONPATH}" >"$RUN/install.env"
        echo pythonpath >"$RUN/install.method"
        # shellcheck source=/dev/null
        source "$RUN/install.env"
    fi
    echo "PYTHONPATH=${PYTHONPATH:-}"
    "$PY" - <<EOF
import devgraph, devgraph_sim, devgraph_toy_backend
rows = {b.name: b for b in devgraph.list_backends()}
for row in rows.values():
    print(f"{row.name:<12} {'available' if row.available else 'unavailable':<12} {row.plugin:<40} {row.reason}")
assert "toy" in rows, "the toy backend's entry point was not found"
print("devgraph.device('$DEVICE'):", devgraph.device("$DEVICE"))
EOF
}

step_smoke() {
    "$PY" tools/gpu_smoke.py --device "$DEVICE" --out "$RUN/results/smoke.json"
}

# pytest NAME ARGS...: junit XML, a JSON line per test, a hard limit per test with its stacks kept.
# In a dry run the cuda steps run for real (their GPU tests skip on cpu, the rest take seconds).
run_pytest() {
    local name=$1
    shift
    local workers=0
    if ! ((DRY)) && "$PY" -c "import xdist" 2>/dev/null; then workers=${ONESHOT_WORKERS:-4}; fi
    local extra=()
    ((workers > 0)) && extra+=(-n "$workers") || extra+=(-p no:xdist)
    ONESHOT_TEST_LOG=$RUN/results/tests-$name.jsonl ONESHOT_DUMP_DIR=$RUN/logs \
        PYTHONPATH=$ROOT/tools${PYTHONPATH:+:$PYTHONPATH} \
        "$PY" -m pytest -p oneshot_pytest -p no:cacheprovider -v -rfEs \
        --junitxml="$RUN/junit/$name.xml" "${extra[@]}" "$@"
}

# The tests whose captures fail on purpose run in their own process (failed_capture): on torch 2.11
# a capture CUDA invalidated can leave the caching allocator broken for the rest of its process.
FAILED_CAPTURE_TESTS="test_failed_capture_end_leaves_graph_uncaptured or test_cuda_refusal_inside_capture_is_a_capture_error"
FAILED_CAPTURE_TESTS+=" or check_capture_error_on_host_sync or test_reseeding_inside_a_cuda_capture_is_a_capture_error"

step_cuda_tests() {
    local files
    mapfile -t files < <(grep -rl --include='test_*.py' 'pytest\.mark\.cuda' tests | sort)
    echo "files with cuda tests: ${files[*]}"
    run_pytest cuda_tests -m cuda -k "not ($FAILED_CAPTURE_TESTS)" "${files[@]}"
}

# Every test that takes the any_device fixture, on its cuda parameter (tests/conftest.py adds it
# where a GPU is visible): the breakable capture, the bisect, the runner and the conformance checks
# on the GPU, the same tests CI runs on the CPU reference and the NPU simulator.
step_any_device() {
    local files
    mapfile -t files < <(grep -rl --include='test_*.py' 'any_device' tests | sort)
    echo "files taking any_device: ${files[*]}"
    ONESHOT_WORKERS=${ONESHOT_ANY_WORKERS:-8} run_pytest any_device -m cuda "${files[@]}"
    local rc=$?
    # A dry run has no GPU: every test is deselected (pytest's exit 5), which is what it should see.
    ((DRY && rc == 5)) && return 0
    return $rc
}

# `devgraph bisect demo` on the device: the tiny decoder's step served by a padded bucket, against
# eager now (fp32: does the padded GEMM round a row as the unpadded one does?), report and tensors saved.
step_bisect() {
    local rc=0 code batch bucket dir
    for pair in 1:8 3:4 5:32; do
        batch=${pair%%:*} bucket=${pair##*:} dir=$RUN/results/bisect_b${batch}_in_${bucket}
        echo "== devgraph bisect demo --batch $batch --bucket $bucket"
        "$PY" -m devgraph bisect demo --device "$DEVICE" --batch "$batch" --bucket "$bucket" --save "$dir"
        code=$?
        # 0: no op differs, 1: an op differs (both reports); anything else, or no report, failed.
        if ((code > 1)) || [[ ! -d $dir ]]; then echo "bisect failed (exit $code)"; rc=1; fi
    done
    return $rc
}

step_failed_capture() {
    ONESHOT_WORKERS=0 run_pytest failed_capture -k "$FAILED_CAPTURE_TESTS or test_cuda_failed_capture" \
        tests/backends/cuda/test_cuda_backend.py tests/backends/cuda/test_cuda_failed_capture.py \
        tests/backends/cpu/test_reference_refusals.py
}

step_replay_vs_eager() {
    local args=()
    ((DRY)) && args=(--iters 3 --warmup 1 --hidden 16 --steps 2)
    "$PY" benchmarks/replay_vs_eager.py --device "$DEVICE" --out "$RUN/results" "${args[@]}"
}

step_paged_attention() {
    local args=()
    ((DRY)) && args=(--iters 1 --warmup 0)
    "$PY" benchmarks/paged_attention.py --device "$DEVICE" --reduced --out "$RUN/results" "${args[@]}"
}

step_decode_step() {
    local args=(--models llama paged --batches 1 8 32 --iters 200)
    # The dry run leaves out llama (importing transformers alone takes seconds; test_benchmarks runs it).
    ((DRY)) && args=(--models paged --batches 1 --quick --iters 2 --warmup 0)
    "$PY" benchmarks/decode_step.py --device "$DEVICE" --no-compile --out "$RUN/results" "${args[@]}"
}

# Tiny random transformers models of six architectures: graphed generate() against eager (fp32
# tokens and logits at batch 1 and 3 rows in a bucket of 4; bf16 differences), then a small bf16 Llama's
# decode speed at batch 1 against eager and the memory-bandwidth floor.
step_hf_generate() {
    local args=()
    ((DRY)) && args=(--quick)
    "$PY" benchmarks/hf_generate.py --device "$DEVICE" --out "$RUN/results" "${args[@]}"
}

# The decode call against a hand-written graph with the same copies, interleaved in one loop, with a
# profiler's count of what each launches (kernels, memcpys, runtime calls) and a split of the call's
# host time by stage.
step_call_overhead() {
    local args=(--models paged llama --batches 1 8 32)
    ((DRY)) && args=(--models paged --batches 1 --quick --iters 3 --warmup 1 --profile-calls 2 --stage-iters 20)
    "$PY" benchmarks/call_overhead.py --device "$DEVICE" --out "$RUN/results" "${args[@]}"
}

step_breakable() {
    local args=()
    ((DRY)) && args=(--quick --iters 3 --warmup 0)
    "$PY" benchmarks/breakable.py --device "$DEVICE" --out "$RUN/results" "${args[@]}"
}

step_host_overhead() {
    local args=()
    ((DRY)) && args=(--quick --iters 5 --repeats 1 --modes full)
    "$PY" benchmarks/host_overhead.py --device "$DEVICE" --out "$RUN/results" "${args[@]}"
}

step_piecewise() {
    local args=(--prefill-sizes 64,512,2048 --decode-sizes 1,8,32)
    ((DRY)) && args=(--prefill-sizes 16 --decode-sizes 1 --iters 1 --warmup 0)
    "$PY" benchmarks/piecewise.py --device "$DEVICE" --out "$RUN/results" "${args[@]}"
}

step_decode_step_compile() {
    local args=(--models llama paged --batches 1 8 --iters 200)
    ((DRY)) && args=(--models paged --batches 1 --quick --iters 2 --warmup 0)
    "$PY" benchmarks/decode_step.py --device "$DEVICE" --out "$RUN/results/with_compile" "${args[@]}"
}

step_cpu_subset() {
    local ignore=()
    if ! "$PY" -c "import hypothesis" 2>/dev/null; then
        echo "hypothesis is not installed: its test modules are left out"
        ignore=(--ignore=tests/compile/test_compile_planner.py --ignore=tests/runner/test_buckets.py
            --ignore=tests/runner/test_padding.py)
    fi
    # The GPU hidden: the CPU reference and the simulators under this machine's torch (CI has 2.13).
    # A dry run only collects them (running them is CI's test suite: minutes).
    ((DRY)) && ignore+=(--collect-only -q)
    CUDA_VISIBLE_DEVICES="" ONESHOT_WORKERS=${ONESHOT_CPU_WORKERS:-8} DEVGRAPH_TEST_THREADS=1 run_pytest cpu_subset \
        tests/graph tests/backends/cpu tests/backends/npu tests/backends/accelerator tests/runner \
        tests/compile tests/testing tests/test_plugins.py "${ignore[@]}"
}

export -f run_pytest step_env step_install step_smoke step_cuda_tests step_failed_capture step_any_device step_bisect \
    step_replay_vs_eager step_breakable step_paged_attention step_decode_step step_host_overhead step_piecewise \
    step_decode_step_compile step_cpu_subset step_hf_generate step_call_overhead
export FAILED_CAPTURE_TESTS

# -- the driver ------------------------------------------------------------------------------------

run_step() {
    local name=${1%%:*} cap=${1##*:} override=ONESHOT_LIMIT_${1%%:*}
    cap=${!override:-$cap} # ONESHOT_LIMIT_<step>=seconds: a step's own limit, for testing this script
    STEP_NO=$((STEP_NO + 1))
    local log
    log=logs/$(printf %02d "$STEP_NO")-$name.log
    local left=$((END_AT - $(date +%s)))
    if ((left < MIN_STEP_S)); then
        summary step "$SUMMARY" "$name" --status skipped --note "not started: ${left} s left before the deadline"
        pack
        printf '%-20s skipped (deadline)\n' "$name"
        return
    fi
    local limit=$((cap < left ? cap : left))
    summary step "$SUMMARY" "$name" --status running --limit-s "$limit" --log "$log"
    pack
    local marker=$RUN/.step-start t0 ms seconds rc status note=""
    touch "$marker"
    t0=$(date +%s%N)
    timeout -s ABRT -k 10 "$limit" bash -c "step_$name" >"$RUN/$log" 2>&1 </dev/null
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    seconds=$((ms / 1000)).$(printf %03d $((ms % 1000)))
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout note="killed at its ${limit} s limit" ;;
        *) status=failed ;;
    esac
    if [[ $name == install && -f $RUN/install.env ]]; then
        # shellcheck source=/dev/null
        source "$RUN/install.env"
        export PYTHONPATH
        note="pip refused or was not run: devgraph, tests/sim and the toy backend are on PYTHONPATH; their entry points come only from the .dist-info folders generated in pythonpath/ (the built-in backends, cuda among them, need none)"
    fi
    local outputs=()
    mapfile -t outputs < <(cd "$RUN" && find results junit logs -type f -newer "$marker" ! -name '.*' ! -path 'logs/[0-9]*' | sort)
    local hangs
    hangs=$(printf '%s\n' "${outputs[@]}" | grep -c 'hang-' || true)
    ((hangs > 0)) && note="${note:+$note; }$hangs hung test(s): stacks in logs/hang-*.txt"
    local method=()
    [[ $name == install && -f $RUN/install.method ]] && method=(--install "$(cat "$RUN/install.method")")
    local tests=()
    [[ -f $RUN/results/tests-$name.jsonl ]] && tests=(--tests "$RUN/results/tests-$name.jsonl")
    summary step "$SUMMARY" "$name" --status "$status" --rc "$rc" --limit-s "$limit" --log "$log" \
        --seconds "$seconds" ${note:+--note "$note"} "${method[@]}" "${tests[@]}" \
        --outputs "${outputs[@]}"
    pack
    printf '%-20s %-8s rc %-3s %8s s  (limit %s s, log %s)\n' "$name" "$status" "$rc" "$seconds" "$limit" "$log"
    [[ $status == ok ]] || tail -n 15 "$RUN/$log" | sed 's/^/    | /'
}

names=$(IFS=,; echo "${STEPS[*]}")
dry=()
((DRY)) && dry=(--dry-run)
summary init "$SUMMARY" --mode "$MODE" --device "$DEVICE" --deadline "$DEADLINE" --steps "$names" \
    --command "bash tools/gpu_oneshot.sh $ARGS" "${dry[@]}" || { echo "gpu_oneshot: cannot write $SUMMARY" >&2; exit 2; }
pack
echo "gpu_oneshot $MODE on $DEVICE$( ((DRY)) && echo ' (dry run)'): deadline ${DEADLINE} s, run folder $RUN, packed into $OUT"
for spec in "${STEPS[@]}"; do
    run_step "$spec"
done
"$PY" "$ROOT/tools/_oneshot.py" finish "$SUMMARY"
pack
"$PY" - "$SUMMARY" <<'EOF'
import json, sys
steps = json.load(open(sys.argv[1]))["steps"]
sys.exit(0 if all(s["status"] == "ok" for s in steps) else 1)
EOF
