# shellcheck shell=bash
# Shared by the sbatch scripts in this directory (sourced, not run). Every setting is a variable
# with a default; nothing here names a site or a person. See docs/megatron_lm.md.
#
# Paths
#   OASES_ROOT        this repository (default: $SLURM_SUBMIT_DIR under sbatch, so submit from the
#                     repository root; the script's own checkout otherwise)
#   MEGATRON_LM_PATH  Megatron-LM checkout at the installed megatron-core's release (core_v0.16.1,
#                     core_v0.17.x ... core_v0.19.x; default: Megatron-LM next to OASES_ROOT); the
#                     stock variant runs its pretrain_gpt.py
#   PYTHON            python on the compute nodes (default: python); TORCHRUN (default: torchrun)
#   RESULTS_DIR       where logs go (default: $OASES_ROOT/results/<family>-<job id or time>)
# Cluster
#   NNODES            nodes (default: $SLURM_JOB_NUM_NODES, else 1)
#   GPUS_PER_NODE     ranks per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_ADDR       rendezvous host (default: first of `scontrol show hostnames $SLURM_JOB_NODELIST`)
#   MASTER_PORT       first rendezvous port; run k uses MASTER_PORT + k (default: 29500 + job id % 1000)
#   TOPOLOGY          cluster topology YAML for --atp-mesh auto and the planner (default: none;
#                     a path or a shipped example name, read once before anything runs)
# Run
#   TRAIN_ITERS (20)  LOG_INTERVAL (1)  TRANSFORMER_IMPL (local)  VOCAB_SIZE (50257)
#   EXTRA_ARGS        appended to every run's Megatron-LM arguments
#   VARIANTS          runs per case; names: stock, megatron, oases, oases-no-cross-pass,
#                     oases-no-fine-grained-recompute, atp-auto, atp-D1xD2[-cK], 3d
#   DRY_RUN=1         print the exact srun/torchrun command lines instead of running them
#   Counts and sizes (NNODES, GPUS_PER_NODE, TRAIN_ITERS, LOG_INTERVAL, SAVE_INTERVAL, MASTER_PORT
#   and each script's own) must be whole numbers >= 1: anything else, a malformed variant name or
#   a bad TOPOLOGY is one error line and exit 2 before anything runs.
# Preemption (docs/checkpoints.md#preemption-and-time-limits)
#   CKPT_DIR          checkpoint root (default: none, no checkpoints): each run saves to and
#                     resumes from CKPT_DIR/<case>/<variant> with Megatron-LM's --save = --load,
#                     --save-interval SAVE_INTERVAL (default TRAIN_ITERS) and --exit-signal-handler.
#                     Every sbatch asks for SIGTERM before its time limit (#SBATCH --signal=B:TERM@300);
#                     the trap below forwards it to the running srun, whose ranks finish the
#                     iteration, save and exit 0, and no further run starts. Resubmit the same
#                     command with the same CKPT_DIR (and RESULTS_DIR, to keep one log per run:
#                     a resumed run appends to its log): finished runs are skipped, the
#                     interrupted one resumes from its latest checkpoint, no flag changed.
#                     TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's wait before it SIGKILLs the ranks
#                     it forwarded SIGTERM to; default 30 s) is raised to 300 s for the save.
# NCCL (exported with these defaults; site-specific ones are passed through only when set)
#   NCCL_DEBUG=WARN, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, NCCL_IB_TIMEOUT=22;
#   NCCL_SOCKET_IFNAME (e.g. ib0), NCCL_IB_HCA (e.g. mlx5), NCCL_P2P_DISABLE=1 (PCIe-only runs,
#   ATP's IC1), NCCL_NVLS_ENABLE: set them in the environment of sbatch to use them.
#   CUDA_DEVICE_MAX_CONNECTIONS=1 always (Megatron-LM's TP overlap and our schedules need
#   kernels issued in launch order); OMP_NUM_THREADS=1 unless set.
# Every variable exported here goes through oases_export, so a dry run's "# env:" line and a
# real run's env.txt list them all (env_report), with any other NCCL_* / TORCH_NCCL_* set.

# oases_setup FAMILY [MAX_NODES]: settings, exports and checks of one job; MAX_NODES: the most
# nodes the family's script runs on (single_node: 1).
oases_setup() {
    FAMILY="$1"
    OASES_ROOT="${OASES_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
    MEGATRON_LM_PATH="${MEGATRON_LM_PATH:-$(dirname "$OASES_ROOT")/Megatron-LM}"
    PYTHON="${PYTHON:-python}"
    TORCHRUN="${TORCHRUN:-torchrun}"
    NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
    TRAIN_ITERS="${TRAIN_ITERS:-20}"
    LOG_INTERVAL="${LOG_INTERVAL:-1}"
    SAVE_INTERVAL="${SAVE_INTERVAL:-$TRAIN_ITERS}"
    require_positive_int NNODES GPUS_PER_NODE TRAIN_ITERS LOG_INTERVAL SAVE_INTERVAL
    if [[ -n "${2:-}" ]] && (( NNODES > $2 )); then
        echo "error: NNODES=$NNODES: $FAMILY runs on $2 node(s); set NNODES=$2" \
             "(sbatch --nodes=$2), or use scripts/slurm/multi_node.sbatch for $NNODES nodes" >&2
        exit 2
    fi
    WORLD=$((NNODES * GPUS_PER_NODE))
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
            MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
        else
            MASTER_ADDR="$(hostname)"
        fi
    fi
    MASTER_PORT="${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}"
    require_positive_int MASTER_PORT
    RESULTS_DIR="${RESULTS_DIR:-$OASES_ROOT/results/$FAMILY-${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}}"
    TRANSFORMER_IMPL="${TRANSFORMER_IMPL:-local}"
    VOCAB_SIZE="${VOCAB_SIZE:-50257}"
    EXTRA_ARGS="${EXTRA_ARGS:-}"
    TOPOLOGY="${TOPOLOGY:-}"
    DRY_RUN="${DRY_RUN:-0}"
    CKPT_DIR="${CKPT_DIR:-}"
    RUN_INDEX=0
    STOPPING=0
    RUN_PID=
    SIGNAL_REQUEST="$(grep -m 1 '^#SBATCH --signal=' "$0" 2>/dev/null | cut -c 9-)"
    OASES_EXPORTED=()
    [[ -n "$CKPT_DIR" ]] && oases_export TORCH_ELASTIC_SHUTDOWN_TIMEOUT "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
    trap on_preemption TERM

    oases_export CUDA_DEVICE_MAX_CONNECTIONS 1
    oases_export NCCL_DEBUG "${NCCL_DEBUG:-WARN}"
    oases_export TORCH_NCCL_ASYNC_ERROR_HANDLING "${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    oases_export NCCL_IB_TIMEOUT "${NCCL_IB_TIMEOUT:-22}"
    oases_export PYTHONPATH "$OASES_ROOT:$MEGATRON_LM_PATH${PYTHONPATH:+:$PYTHONPATH}"
    oases_export MEGATRON_LM_PATH "$MEGATRON_LM_PATH"
    oases_export OMP_NUM_THREADS "${OMP_NUM_THREADS:-1}"

    check_topology
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "# DRY_RUN=1 $FAMILY: $NNODES node(s) x $GPUS_PER_NODE GPUs, results in $RESULTS_DIR"
        local -a report; mapfile -t report < <(env_report)
        echo "# env: $(shell_words "${report[@]}")"
        local saves="no CKPT_DIR: nothing is saved"
        [[ -n "$CKPT_DIR" ]] && saves="checkpoints in $CKPT_DIR/<case>/<variant> (--save = --load: a resubmitted job resumes)"
        echo "# preemption: #SBATCH ${SIGNAL_REQUEST:-(no --signal request)}: SIGTERM before the time limit; $saves"
        [[ -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ]] ||
            echo "# note: MEGATRON_LM_PATH=$MEGATRON_LM_PATH has no pretrain_gpt.py: a real run stops here (set it)"
    else
        [[ -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ]] || {
            echo "error: MEGATRON_LM_PATH=$MEGATRON_LM_PATH has no pretrain_gpt.py; set it to a" \
                 "Megatron-LM checkout of the installed megatron-core's release (e.g. core_v0.19.0)" >&2; exit 2; }
        # PYTHONPATH finds the code, not its dependencies: check them once, before any srun
        "$PYTHON" -c "import megatron_oases, six, einops, pydantic, regex" 2>/dev/null || {
            echo "error: $PYTHON cannot import megatron_oases and what Megatron-LM's" \
                 "megatron.training needs; in the compute nodes' environment run" \
                 "pip install -e \"$OASES_ROOT[megatron-lm]\" (docs/megatron_lm.md)" >&2; exit 2; }
        mkdir -p "$RESULTS_DIR"
        {
            echo "family=$FAMILY nodes=$NNODES gpus_per_node=$GPUS_PER_NODE job=${SLURM_JOB_ID:-none}"
            echo "oases=$(git -C "$OASES_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
            echo "megatron_lm=$(git -C "$MEGATRON_LM_PATH" describe --tags --always 2>/dev/null || echo unknown)"
            env_report
        } > "$RESULTS_DIR/env.txt"
    fi
}

# oases_export NAME VALUE: export NAME=VALUE and list NAME in OASES_EXPORTED (env_report).
oases_export() {
    export "$1=$2"
    OASES_EXPORTED+=("$1")
}

# NAME=VALUE lines: every variable oases_export set, then any other NCCL_* / TORCH_NCCL_* of the
# environment (the site-specific ones passed through).
env_report() {
    local name
    for name in "${OASES_EXPORTED[@]}"; do echo "$name=${!name}"; done
    env | grep -E '^(NCCL_|TORCH_NCCL_)' | sort | while IFS= read -r line; do
        [[ " ${OASES_EXPORTED[*]} " == *" ${line%%=*} "* ]] || echo "$line"
    done
}

# require_positive_int NAME...: each variable a whole number >= 1, else one line and exit 2
# (before its value reaches $((...)), srun or torchrun).
require_positive_int() {
    local name
    for name in "$@"; do
        [[ "${!name}" =~ ^[1-9][0-9]*$ ]] ||
            { echo "error: $name=${!name} must be a whole number >= 1; set it to one" >&2; exit 2; }
    done
}

# TOPOLOGY (when set) is read by megatron_oases.topology's own loader, as every run will read it:
# a missing file, an unknown example name or a bad field is one line here, not one per run.
check_topology() {
    [[ -n "$TOPOLOGY" ]] || return 0
    local problem
    problem="$("$PYTHON" -c 'import sys
try:
    from megatron_oases.topology import TopologyError, load_topology
except ImportError:
    sys.exit(0)  # the pre-flight import check below names the install
try:
    load_topology(sys.argv[1])
except TopologyError as e:
    print(e)' "$TOPOLOGY" 2>/dev/null)"
    [[ -z "$problem" ]] || { echo "error: TOPOLOGY: $problem" >&2; exit 2; }
}

# SIGTERM (#SBATCH --signal=B:TERM@...): forward it to the running srun, which passes it to its
# tasks (Megatron-LM's --exit-signal-handler saves and exits 0 with CKPT_DIR), and start no
# further run.
on_preemption() {
    STOPPING=1
    echo "[$(date +%T)] SIGTERM: ${RUN_PID:+the running run ${CKPT_DIR:+saves and }stops; }no further runs start" >&2
    [[ -n "$RUN_PID" ]] && kill -TERM "$RUN_PID" 2>/dev/null
    return 0
}

# Our flags for a variant name (empty for stock and megatron).
variant_flags() {
    local v="$1"
    case "$v" in
        stock|megatron) ;;
        oases) echo "--schedule oases" ;;
        oases-no-cross-pass) echo "--schedule oases --no-oases-cross-pass" ;;
        oases-no-fine-grained-recompute) echo "--schedule oases --no-oases-fine-grained-recompute" ;;
        atp-auto)
            [[ -n "$TOPOLOGY" ]] || { echo "error: variant atp-auto needs TOPOLOGY=FILE" >&2; return 2; }
            echo "--tp-backend atp --atp-mesh auto --topology $TOPOLOGY" ;;
        atp-*x*)
            [[ "$v" =~ ^atp-[1-9][0-9]*x[1-9][0-9]*(-c[1-9][0-9]*)?$ ]] || {
                echo "error: variant '$v' is not atp-D1xD2 or atp-D1xD2-cK (whole numbers >= 1, e.g. atp-4x2-c2)" >&2
                return 2; }
            local mesh="${v#atp-}" chunks=1
            if [[ "$mesh" == *-c* ]]; then chunks="${mesh##*-c}"; mesh="${mesh%-c*}"; fi
            echo "--tp-backend atp --atp-mesh ${mesh%x*},${mesh#*x} --atp-chunks $chunks" ;;
        3d) echo "--tp-backend 3d" ;;
        *) echo "error: unknown variant '$v' (see scripts/slurm/common.sh)" >&2; return 2 ;;
    esac
}

# Words as one shell line, quoted only where needed (copy-pasteable).
shell_words() {
    local out="" w
    for w in "$@"; do
        if [[ "$w" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out+="$w "; else out+="$(printf '%q' "$w") "; fi
    done
    echo "${out% }"
}

# The launcher for one run: srun (one task per node) + torchrun.
launcher() {
    local port="$1"
    local -a srun=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1)
    if [[ "$NNODES" == 1 ]]; then
        LAUNCH=("${srun[@]}" "$TORCHRUN" --standalone --nnodes=1 --nproc-per-node="$GPUS_PER_NODE")
    else
        LAUNCH=("${srun[@]}" "$TORCHRUN" --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
                --rdzv-id="${SLURM_JOB_ID:-0}-$port" --rdzv-backend=c10d
                --rdzv-endpoint="$MASTER_ADDR:$port")
    fi
}

# run_variant CASE VARIANT MODEL_ARGS...: one training run into $RESULTS_DIR/CASE/VARIANT.log.
run_variant() {
    local case_name="$1" variant="$2"; shift 2
    local flags; flags="$(variant_flags "$variant")" || return 0
    [[ "$STOPPING" == 1 ]] && { echo "skip $case_name/$variant: stopping after SIGTERM" >&2; return 0; }
    local port=$((MASTER_PORT + RUN_INDEX)); RUN_INDEX=$((RUN_INDEX + 1))
    local -a ckpt=() redirect=(">")
    if [[ -n "$CKPT_DIR" ]]; then
        local dir="$CKPT_DIR/$case_name/$variant"
        local done_iter; done_iter="$(cat "$dir/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
        if [[ "$done_iter" =~ ^[0-9]+$ ]] && (( done_iter >= TRAIN_ITERS )); then
            echo "skip $case_name/$variant: finished in an earlier job ($dir at iteration $done_iter)" >&2
            return 0
        fi
        # Megatron-LM's resume-if-present: --load of a directory without a checkpoint starts fresh.
        ckpt=(--save "$dir" --load "$dir" --save-interval "$SAVE_INTERVAL" --exit-signal-handler)
        redirect=(">>")
    fi
    launcher "$port"
    local -a entry
    if [[ "$variant" == stock ]]; then
        entry=("$MEGATRON_LM_PATH/pretrain_gpt.py")       # the checkout's own script, untouched flags
    else
        entry=(-m megatron_oases.pretrain_gpt)            # our entry, same Megatron-LM arguments
    fi
    # shellcheck disable=SC2206  # flags and EXTRA_ARGS are word lists by design
    local -a cmd=("${LAUNCH[@]}" "${entry[@]}" "$@"
                  --train-iters "$TRAIN_ITERS" --log-interval "$LOG_INTERVAL" --log-throughput
                  --eval-iters 0 --mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE"
                  --lr 1e-4 --lr-decay-style constant --weight-decay 0.01 --clip-grad 1.0
                  --transformer-impl "$TRANSFORMER_IMPL" --distributed-backend nccl
                  $EXTRA_ARGS $flags "${ckpt[@]}")
    local log="$RESULTS_DIR/$case_name/$variant.log"
    local line; line="$(shell_words "${cmd[@]}") ${redirect[0]} $(shell_words "$log") 2>&1"
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "$line"
        return 0
    fi
    mkdir -p "$RESULTS_DIR/$case_name"
    echo "$line" >> "$RESULTS_DIR/commands.sh"
    echo "[$(date +%T)] $case_name/$variant"
    # In the background: bash runs a trap only between commands, so a foreground srun would
    # keep the SIGTERM from being forwarded until it ended.
    if [[ -n "$CKPT_DIR" ]]; then "${cmd[@]}" >> "$log" 2>&1 & else "${cmd[@]}" > "$log" 2>&1 & fi
    RUN_PID=$!
    local rc
    wait "$RUN_PID"; rc=$?
    while (( rc > 128 )) && kill -0 "$RUN_PID" 2>/dev/null; do wait "$RUN_PID"; rc=$?; done
    RUN_PID=
    local note=""; [[ "$STOPPING" == 1 ]] && note=" (stopped by SIGTERM${CKPT_DIR:+; resumes when resubmitted})"
    echo "$case_name $variant exit=$rc$note" >> "$RESULTS_DIR/status.txt"
    [[ $rc == 0 ]] || echo "[$(date +%T)] $case_name/$variant failed (exit $rc), see $log" >&2
    return 0
}

# Speedup table, CSV and chart of everything in RESULTS_DIR (scripts/compare.py).
oases_finish() {
    local -a cmd=("$PYTHON" "$OASES_ROOT/scripts/compare.py" "$RESULTS_DIR" --baseline stock
                  --csv "$RESULTS_DIR/speedup.csv" --png "$RESULTS_DIR/speedup.png" --title "$FAMILY")
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "# then: ${cmd[*]} | tee $RESULTS_DIR/speedup.txt"
        return 0
    fi
    "${cmd[@]}" | tee "$RESULTS_DIR/speedup.txt"
}

# Refuse unknown variant names before anything runs (exit 2).
check_variants() {
    local v
    for v in $VARIANTS; do variant_flags "$v" > /dev/null || exit 2; done
}

# global_batch WANTED TP MICRO: WANTED rounded up to a multiple of MICRO x data-parallel size.
global_batch() {
    local want="$1" tp="$2" micro="$3" dp=$((WORLD / $2))
    local step=$((micro * dp))
    echo $(( (want + step - 1) / step * step ))
}
