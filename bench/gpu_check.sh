#!/usr/bin/env bash
# The planner's predictions against one local GPU, in at most five minutes.
#
#   bench/gpu_check.sh                       # on a machine with one NVIDIA GPU
#   GPU_CHECK_OUT=$OUT bench/gpu_check.sh    # keep the files in $OUT (the device machine)
#   bench/gpu_check.sh --dry-run             # the same steps on the CPU, tiny model (CI)
#
# Steps, each under a header and its own time limit (all of them within
# GPU_CHECK_BUDGET_S, default 270 s, then at most 15 s of summary):
#   (a) the device: nvidia-smi, torch's name for the GPU, its catalogue entry
#       (planner/data/devices.yaml; h100 stands in for a GPU it does not know)
#   (b) examples/gpt.py profiled analytic for that catalogue device (`planner profile
#       --device-type`), and its blocks timed on the GPU ([Note: measured on the GPU] in
#       bench/_gpu_measure.py): forward, backward and saved activations, block by block
#   (c) plans: pp 1 on the GPU; pp 2 on two CPU processes; pp 2 on two GPUs of this
#       type, predicted only ([Note: two processes cannot share one GPU])
#   (d) `planner run` of the two runnable plans; each prints predicted vs measured
#   (e) the summary: step, per-stage memory and profile totals, predicted against measured,
#       error = (predicted − measured) / measured (planner.plan.text.rel_error)
#
# Files in GPU_CHECK_OUT (default: a new temporary folder), seven, so that all of them come
# back from a machine that returns a few: gpu_check.log (everything printed), summary.json,
# profile-analytic.json, profile-measured.json, plan-pp1.yaml, plan-pp2.yaml,
# plan-pp2-gpu.yaml.
#
# The steps in Python are subcommands of bench/_gpu_check.py (python -m bench._gpu_check -h).
#
# Environment: GPU_CHECK_DEVICE=cpu is --dry-run; PYTHON (default python3) is the
# interpreter holding torch; GPU_CHECK_WHEELS is a folder of wheels installed (offline,
# --no-deps) when the planner's own dependencies (pulp, highspy, ...) are missing, else
# `pip install -e .` is tried; PLANNER_CACHE_DIR (default: a temporary folder).
#
# [Note: two processes cannot share one GPU]
# A two-stage plan runs as two processes, and with CUDA the runtime gives rank r the device
# cuda:LOCAL_RANK over NCCL (runtime/checks.py local_device): with one GPU visible, rank 1
# is refused ("LOCAL_RANK is 1 but only 1 CUDA device(s) are visible"). Pointing both ranks
# at cuda:0 would not help: NCCL since 2.5 refuses two ranks on one GPU ("Duplicate GPU
# detected", NVIDIA/nccl#418: not supported, its topology search assumes one rank per GPU),
# and a cluster file cannot map two devices to one GPU either (devices are counted, not
# addressed). So, without changing the runtime, the check splits the claim in two: the GPU
# is measured by a one-process plan (pp 1: step d-run-pp1), and the two-process pipeline by
# a pp 2 plan on two CPU processes over gloo (d-run-pp2) on the same machine. The pp 2 plan
# for two of this GPU is written and its prediction printed (c-plan-pp2-gpu), ready for a
# machine with two: `planner run examples/gpt.py --plan plan-pp2-gpu.yaml` there, with the
# same GPT_* settings (the log prints them).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

MODE=${GPU_CHECK_DEVICE:-cuda}
for arg in "$@"; do
    case $arg in
        --dry-run) MODE=cpu ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            echo "error: unknown argument $arg; use --dry-run or --help" >&2
            exit 2
            ;;
    esac
done
if [[ $MODE != cuda && $MODE != cpu ]]; then
    echo "error: GPU_CHECK_DEVICE=$MODE; use cuda (the default) or cpu (--dry-run)" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-scratch.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
LOG=$OUT_DIR/gpu_check.log
BUDGET_S=${GPU_CHECK_BUDGET_S:-270}
DEADLINE=$((SECONDS + BUDGET_S))

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # the checkout, installed or not
export PYTHONUNBUFFERED=1
export COLUMNS=160 # wide enough that no table hides a column
export PLANNER_CACHE_DIR=${PLANNER_CACHE_DIR:-$SCRATCH/cache}

# The model, sized per mode through examples/gpt.py's knobs. On the GPU: ~117 M parameters
# (8 × 1024 wide, 16 k vocabulary, 512 tokens), real work for the GPU in seconds. On two
# CPU processes, for the pipeline: ~4 M. The dry run: ~0.1 M, everywhere.
if [[ $MODE == cuda ]]; then
    MODEL=(GPT_LAYERS=8 GPT_DIM=1024 GPT_HEADS=16 GPT_SEQ=512 GPT_VOCAB=16384)
    MICRO_BATCH=8 GLOBAL_BATCH=16 GPU_STEPS=12
    CPU_MODEL=(GPT_LAYERS=4 GPT_DIM=256 GPT_HEADS=4 GPT_SEQ=128 GPT_VOCAB=4096)
    CPU_STEPS=8 WARMUP_STEPS=2
else
    export CUDA_VISIBLE_DEVICES="" # the dry run uses no GPU, even where there is one
    MODEL=(GPT_LAYERS=2 GPT_DIM=64 GPT_HEADS=2 GPT_SEQ=32 GPT_VOCAB=512)
    MICRO_BATCH=4 GLOBAL_BATCH=8 GPU_STEPS=4
    CPU_MODEL=("${MODEL[@]}")
    CPU_STEPS=4 WARMUP_STEPS=1
fi
EXAMPLE=examples/gpt.py
PLANNER=("$PY" -m planner)
GPU_CHECK=("$PY" -m bench._gpu_check) # the steps in Python: bench/_gpu_check.py

exec 3>&1 4>&2
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

declare -A RC=()   # step -> exit status ("skipped" when it did not run)
declare -A TOOK=() # step -> seconds
ORDER=()

say() { printf '%s\n' "$*"; }
header() { printf '\n== %s ==\n' "$*"; }

# step NAME LIMIT_S CAPTURE [--stdout FILE] COMMAND...: run COMMAND under `timeout`, its
# output shown and kept in CAPTURE (with --stdout, its standard output goes to FILE
# instead). The limit is cut to what is left of the budget. The script goes on whatever
# happens: the status is kept for the summary, and `ok NAME` asks for it.
step() {
    local name=$1 limit=$2 capture=$3 stdout=""
    shift 3
    if [[ $1 == --stdout ]]; then
        stdout=$2
        shift 2
    fi
    ORDER+=("$name")
    local left=$((DEADLINE - SECONDS))
    if ((left < 10)); then
        say "skipped: the budget of ${BUDGET_S} s is spent (GPU_CHECK_BUDGET_S)"
        RC[$name]=skipped TOOK[$name]=0
        return 0
    fi
    if ((limit > left)); then limit=$left; fi
    say "\$ $* (limit ${limit} s)"
    local t0=$SECONDS rc=0
    if [[ -n $stdout ]]; then
        timeout -k 5 "$limit" "$@" 2>&1 >"$stdout" | tee "$capture" || rc=$?
    else
        timeout -k 5 "$limit" "$@" 2>&1 | tee "$capture" || rc=$?
    fi
    RC[$name]=$rc TOOK[$name]=$((SECONDS - t0))
    if ((rc == 124 || rc == 137)); then
        say "step $name: stopped at its limit of ${limit} s"
    elif ((rc != 0)); then
        say "step $name: failed (exit status $rc)"
    fi
    return 0
}

ok() { [[ ${RC[$1]:-} == 0 ]]; }

skip() {
    ORDER+=("$1")
    RC[$1]=skipped TOOK[$1]=0
    say "skipped: $2"
}

say "gpu_check: mode $MODE, output in $OUT_DIR, budget ${BUDGET_S} s, $(date -u +%FT%TZ)"
say "repository $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"

# ------------------------------------------------------------------------------ (a)
header "(a) the device"
if [[ $MODE == cuda ]]; then
    if command -v nvidia-smi >/dev/null; then
        step a-nvidia-smi 15 "$SCRATCH/a-smi.txt" nvidia-smi \
            --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    else
        skip a-nvidia-smi "nvidia-smi is not on the PATH"
    fi
else
    say "dry run: no GPU (CUDA_VISIBLE_DEVICES is empty); the CPU stands in for it"
fi

# The planner runs from this checkout (PYTHONPATH); its dependencies must be importable.
# highspy is optional: --solver auto falls back to PuLP's bundled CBC.
missing=$("$PY" -c 'import importlib.util as u
print(*[m for m in ("pulp", "yaml", "rich", "networkx") if u.find_spec(m) is None])')
if [[ -n $missing ]]; then
    say "the planner's dependencies missing for $PY: $missing"
    if [[ -n ${GPU_CHECK_WHEELS:-} ]]; then
        step a-install 60 "$SCRATCH/a-install.txt" "$PY" -m pip install -q --no-index \
            --no-deps --no-cache-dir --target "$SCRATCH/site" "$GPU_CHECK_WHEELS"/*.whl
        export PYTHONPATH="$PYTHONPATH:$SCRATCH/site"
    else
        step a-install 120 "$SCRATCH/a-install.txt" "$PY" -m pip install -q -e .
    fi
    if ! ok a-install; then
        say "could not install them; offline, carry their wheels (pulp, and highspy for HiGHS)" \
            "and set GPU_CHECK_WHEELS to their folder"
    fi
fi

step a-device 60 "$SCRATCH/a-device.txt" "${GPU_CHECK[@]}" device "$MODE"
if ! ok a-device; then
    say "gpu_check: no usable device or planner here (step a-device); stopping"
    exec 1>&3 2>&4
    wait "$TEE_PID" || true
    exit 1
fi
GPU_KEY=$(sed -n 's/^gpu-key=\([^ ]*\).*/\1/p' "$SCRATCH/a-device.txt")
if [[ $MODE == cpu ]]; then
    PROFILE_KEY=cpu WHERE=cpu ON_GPU=()
elif grep -q '^gpu-key=.* unknown' "$SCRATCH/a-device.txt"; then
    PROFILE_KEY=$GPU_KEY WHERE=cuda:0 ON_GPU=(--device-type "$GPU_KEY")
else
    PROFILE_KEY=$GPU_KEY WHERE=cuda:0 ON_GPU=() # `--gpus 1`: the local GPU, as the catalogue has it
fi

# ------------------------------------------------------------------------------ (b)
header "(b) profile: analytic for $PROFILE_KEY (planner profile --device-type $PROFILE_KEY)"
step b-analytic 60 "$SCRATCH/b-analytic.txt" --stdout "$OUT_DIR/profile-analytic.json" \
    env "${MODEL[@]}" "${PLANNER[@]}" profile "$EXAMPLE" --batch-size "$MICRO_BATCH" \
    --device-type "$PROFILE_KEY" --json

header "(b) profile: measured on $WHERE, block by block ([Note: measured on the GPU])"
if ok b-analytic; then
    step b-measured 90 "$SCRATCH/b-measured.txt" env "${MODEL[@]}" "${GPU_CHECK[@]}" measure \
        "$EXAMPLE" "$WHERE" "$MICRO_BATCH" "$OUT_DIR/profile-analytic.json" \
        "$OUT_DIR/profile-measured.json" "$SCRATCH/profile-compare.json"
else
    skip b-measured "the analytic profile (its split points) is missing"
fi

# ------------------------------------------------------------------------------ (c)
header "(c) plan pp 1 on $WHERE (one process)"
step c-plan-pp1 60 "$SCRATCH/c-plan-pp1.txt" env "${MODEL[@]}" "${PLANNER[@]}" plan \
    "$EXAMPLE" --gpus 1 "${ON_GPU[@]}" --pp 1 --micro-batches 1 --batch-size "$GLOBAL_BATCH" \
    --solver auto --out "$OUT_DIR/plan-pp1.yaml"

header "(c) plan pp 2 on two CPU processes (gloo; [Note: two processes cannot share one GPU])"
step c-plan-pp2 60 "$SCRATCH/c-plan-pp2.txt" env CUDA_VISIBLE_DEVICES= "${CPU_MODEL[@]}" \
    "${PLANNER[@]}" plan "$EXAMPLE" --gpus 2 --pp 2 --micro-batches 4 --batch-size 8 \
    --solver auto --out "$OUT_DIR/plan-pp2.yaml"

header "(c) plan pp 2 on two $GPU_KEY GPUs: predicted only (this machine has one)"
if ((DEADLINE - SECONDS >= 150)); then
    step c-plan-pp2-gpu 45 "$SCRATCH/c-plan-pp2-gpu.txt" env "${MODEL[@]}" "${PLANNER[@]}" \
        plan "$EXAMPLE" --gpus 2 --device-type "$GPU_KEY" --pp 2 --batch-size "$GLOBAL_BATCH" \
        --solver auto --out "$OUT_DIR/plan-pp2-gpu.yaml"
else
    skip c-plan-pp2-gpu "$((DEADLINE - SECONDS)) s left of the budget: kept for the runs of (d)"
fi

# ------------------------------------------------------------------------------ (d)
header "(d) run pp 1 on $WHERE: $GPU_STEPS steps"
if ok c-plan-pp1; then
    step d-run-pp1 90 "$SCRATCH/d-run-pp1.txt" env "${MODEL[@]}" "${PLANNER[@]}" run \
        "$EXAMPLE" --plan "$OUT_DIR/plan-pp1.yaml" --steps "$GPU_STEPS" \
        --warmup-steps "$WARMUP_STEPS"
else
    skip d-run-pp1 "no plan (step c-plan-pp1)"
fi

header "(d) run pp 2 on two CPU processes (gloo): $CPU_STEPS steps"
if ok c-plan-pp2; then
    step d-run-pp2 90 "$SCRATCH/d-run-pp2.txt" env CUDA_VISIBLE_DEVICES= "${CPU_MODEL[@]}" \
        "${PLANNER[@]}" run "$EXAMPLE" --plan "$OUT_DIR/plan-pp2.yaml" --steps "$CPU_STEPS" \
        --warmup-steps "$WARMUP_STEPS"
else
    skip d-run-pp2 "no plan (step c-plan-pp2)"
fi

# ------------------------------------------------------------------------------ (e)
header "(e) summary: predicted against measured"
STATUS=()
for name in "${ORDER[@]}"; do STATUS+=("$name=${RC[$name]}:${TOOK[$name]}"); done
DEADLINE=$((SECONDS + 30)) # the summary runs whatever is left of the budget
step e-summary 15 "$SCRATCH/e-summary.txt" "${GPU_CHECK[@]}" summary --mode "$MODE" \
    --where "$WHERE" --scratch "$SCRATCH" --out "$OUT_DIR/summary.json" --wall "$SECONDS" \
    "${STATUS[@]}"

FAILED=0
for name in "${ORDER[@]}"; do
    if ! ok "$name"; then FAILED=1; fi
done
say "gpu_check: $([[ $FAILED == 0 ]] && echo 'every step ran' || echo 'some steps failed'); \
wall $SECONDS s; files in $OUT_DIR (log: $LOG)"
exec 1>&3 2>&4
wait "$TEE_PID" || true
exit "$FAILED"
