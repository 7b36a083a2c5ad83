#!/usr/bin/env bash
# The first checks on a lent GPU, in one call (docs/gpu.md, "What a first GPU run should check").
#
#   bash scripts/gpu_check.sh            # OUT=<folder> (default /tmp/gpu_check), BUDGET_S=330, PYTHON=python3
#
# On a machine with one or more CUDA GPUs and torch there; megatron-core / pulp wheels in .whl/
# are installed first when present (the device machine has no package index), into a private
# mktemp folder removed on exit (WHEELS=0 skips that, WHEELS=1 forces it; default 1 on CUDA, 0
# with DEVICE=cpu): `bash scripts/gpu_wheels.sh` puts megatron-core 0.19.2 and pulp for Python
# 3.12 there.
# DEVICE=cpu with MFU_FLAGS, ATTN_ARGS, OVERLAP_FLAGS, LLAMA_SIZES, MOE_SIZES and FUSION_ARGS at small shapes
# runs env, attn, mfu, overlap, overlap-conn, overlap-summary, moe-standin, fusion, sim and compare on CPU (how the script is tested
# before a lease; the numbers then mean nothing; env records that there is no GPU; train is
# CUDA only): docs/gpu.md has the command.
# Steps, each under its own timeout, skipped once the budget is spent; every step's output goes
# to $OUT/check.log, one line per step to $OUT/summary.txt, JSON results into $OUT/results.tar.gz:
#   env       GPU, torch, megatron-core ("no GPU" with DEVICE=cpu)
#   attn      scripts/attention_parity.py: the fused (SDPA) core attention against Megatron's local
#             one on CUDA, fp32 and bf16, at hidden 4096, sequence 4096 (errors, kernel times)
#   mfu       the trainer at TP 1, hidden 4096, sequence 4096, 32 heads, 4 layers, bf16: stock and
#             Oases, each with --attention-backend auto (SDPA) and local; model-FLOPs utilisation
#             against the card's dense bf16 peak in the compare step
#   overlap   scripts/bench_gpu_overlap.py: rank 0 of a TP-2 layer on this GPU, every collective
#             replaced by a stand-in (sleep, copy and 16-block "channels" copy kernels) of a
#             duration matched to compute; one step of each traced (json/traces/): the compute
#             stream's idle time, while a stand-in ran vs with nothing running (OVERLAP_FLAGS:
#             the trainer flags, default the mfu model; OVERLAP_TP: the TP size, default 2;
#             OVERLAP_ARGS: more benchmark flags, e.g. "--steps 1 --warmup 0")
#   overlap-conn  the same with CUDA_DEVICE_MAX_CONNECTIONS=8 (the driver's default of 8
#             hardware queues instead of the 1 Megatron asks for; unset, the trainer sets 1):
#             does one queue serialise the stand-ins?
#   overlap-rc  the overlap step with full recompute (uniform, 1 layer): the Oases paper's
#             setting, where Oases' fine-grained recompute issues no collective and Megatron's
#             repeats the forward's; the link matched to stock's step as in overlap
#             (after any of the three: scripts/sim_vs_standin.py, the simulator's step, compute
#             and exposed communication beside the measured ones, as step "sim-standin")
#   overlap-summary  the benchmark with sleep and nccl stand-ins and comm-disabled, stock and Oases,
#             without and with full recompute, at SUMMARY_LINKS GB/s (default "24 150": PCIe-like,
#             NVLink-like) for two models: the mfu model at TP 2 (h4096) and one rank's shard of
#             Llama-2-70B layers at TP 8 (llama2-70b-tp8: GQA, SwiGLU, sequence 4096, 4 layers,
#             micro-batch 2; LLAMA_SIZES replaces its size flags); one run each (8 in all, about
#             5 minutes on an H100), then json/overlap_summary.json: one record per kind, recompute,
#             link and model (benchmarks/standin/summary.py)
#   moe-standin  the benchmark over MoE layers (issue 51; benchmarks/standin/moe.py): one rank's
#             shard of 4 Mixtral-8x7B layers (8 experts of SwiGLU FFN 14336, top-2, alltoall
#             dispatcher, aux loss 1e-2, GQA, sequence 4096, micro-batch 2, bf16; MOE_SIZES
#             replaces its size flags) as rank 0 of a TP x EP fake world, for each of MOE_LAYOUTS
#             (default "1x2 2x2": TP 1 x EP 2, TP 2 x EP 2 with sequence parallelism), the
#             expert-parallel all-to-alls stand-ins too; sleep and nccl, at MOE_LINKS GB/s
#             (default 24); then json/moe_summary.json (the overlap-summary records) and
#             json/sim_vs_standin_moe.json (scripts/sim_vs_standin.py)
#   fusion    scripts/gpu_fusion_bench.py: eager vs fused element-wise parts of the layer
#   tp1-*     the trainer on CUDA, one rank: stock and Oases (fp32, with full recompute), bf16,
#             and the same stock run on CPU; losses compared at the end
#   tp2-*     with 8 GPUs: stock vs Oases TP 2 (fp32), Oases with sequence parallelism, ATP (2,2)
#             vs stock TP 4, 3-D TP 8 (NCCL)
#   compare   every run's losses and step times; the largest relative loss difference of each
#             run against its reference (Oases vs stock, CPU vs CUDA, TP n vs TP 1, ...); runs
#             once, after every other step, wherever it stands in STEPS (the steps before it
#             leave it COMPARE_S=30 seconds of the budget)
#   measure   scripts/gpu_measure.py: GEMM shapes, dispatch cost and layer events vs the model
#   gemm      scripts/gpu_measure.py --what table: every shape of the simulator's measured GEMM
#             table (megatron_oases/pricing/gemm_table.json) in bf16 on this card, back to back
#             (json/gpu_table.json; scripts/gemm_table_build.py --gemms adds it to the table;
#             GEMM_ARGS: more flags, e.g. "--table-shapes 64x64x64 --reps 2" on CPU)
#   pytest    the Oases schedule tests (gloo ranks; the device machine's torch)
#   sim       the simulator on this GPU: `profile` a one-GPU trainer run (stock and Oases), train
#             it, and `sim --predict` its step from the profile (measured vs predicted)
#   sim-sizes the same at hidden 512, 1024, 2048 (sequence 2048), host-bound to GEMM-bound; before
#             each profile the SM and memory clocks are read as found, then after SETTLE_S
#             (default 5) seconds of GEMMs, under load (scripts/gpu_settle.py; summary.txt)
# STEPS picks steps (default: "env attn mfu overlap overlap-conn overlap-rc sim sim-sizes compare"; the others are
# "overlap-summary moe-standin fusion train measure gemm pytest"); MEASURE adds flags to gpu_measure.py, PYTESTS replaces the test
# files, SIM_MODEL the sim step's model flags (default: the mfu model), SIM_SCHEDULES its
# schedules, SIM_HIDDEN the sim-sizes list.
set -u
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-330}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT/json"
LOG=$OUT/check.log
SUMMARY=$OUT/summary.txt
: >"$LOG"; : >"$SUMMARY"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "${WHEELS:-$([ "$DEVICE" = cpu ] && echo 0 || echo 1)}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
  trap 'rm -rf "$SITE"' EXIT
  echo "=== wheels: $(ls .whl/*.whl) -> $SITE" >>"$LOG"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=$SITE
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

want() { [[ " ${STEPS:-env attn mfu overlap overlap-conn overlap-rc sim sim-sizes compare} " == *" $1 "* ]]; }
# compare runs last: the steps before it leave it COMPARE_S seconds
RESERVE=0; want compare && RESERVE=${COMPARE_S:-30}
left() { echo $((BUDGET_S - ($(date +%s) - T0) - RESERVE)); }
step() {  # step NAME TIMEOUT_S CMD...: run unless the budget is spent; log; one summary line
  local name=$1 limit=$2; shift 2
  if [ "$(left)" -lt 15 ]; then echo "$name skipped (budget)" >>"$SUMMARY"; return 1; fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  echo "=== $name ($(date +%T), limit ${limit}s): $*" >>"$LOG"
  local s; s=$(date +%s)
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s" >>"$SUMMARY"
  return $rc
}

TRAIN=($PY -m megatron_oases.cli train --num-layers 2 --hidden-size 256 --num-attention-heads 8
  --seq-length 128 --max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 4
  --global-batch-size 8 --train-iters 4 --seed 1234 --dist-timeout 60)
train() {  # train NAME NPROC DEVICE FLAGS...
  local name=$1 n=$2 dev=$3; shift 3
  step "$name" 120 "${TRAIN[@]}" --nproc-per-node "$n" --device "$dev" --log-json "$OUT/json/run-$name.json" "$@"
}

if [ "$DEVICE" = cpu ]; then  # no GPU asked for: say so, and what runs instead
  want env && step env 30 bash -c "echo 'no GPU used (DEVICE=cpu)'; $PY -c 'import torch, megatron.core as mc; import sys; print(sys.version.split()[0], torch.__version__, \"cuda available:\", torch.cuda.is_available(), mc.__version__)'"
else
  want env && step env 30 bash -c "nvidia-smi -L; $PY -c 'import torch, megatron.core as mc; import sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count(), mc.__version__)'"
fi

# The issue-34 model: TP 1, hidden 4096, sequence 4096, bf16, 4 layers (micro-batch 2: Oases
# splits it in two sub-batches). MFU_FLAGS replaces its model flags (DEVICE=cpu: small shapes, see the header).
# MFU_ITERS: the trainer runs' iterations (the overlap benchmark runs its own steps).
if [ -n "${MFU_FLAGS:-}" ]; then read -r -a MFU_MODEL <<<"$MFU_FLAGS"; else
MFU_MODEL=(--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096
  --max-position-embeddings 4096 --vocab-size 32000 --micro-batch-size 2 --global-batch-size 4
  --bf16); fi
MFU_ITERS=(--train-iters "${MFU_ITERS:-6}")
want attn && step attn 60 $PY scripts/attention_parity.py --device "$DEVICE" ${ATTN_ARGS:---hidden 4096 --seq 4096 --heads 32} --out "$OUT/json/attention_parity.json"
if want mfu; then
  for sched in default oases; do
    for backend in auto local; do
      train "mfu-$sched-$backend" 1 "$DEVICE" "${MFU_MODEL[@]}" "${MFU_ITERS[@]}" --schedule "$sched" --attention-backend "$backend"
    done
  done
fi
if want overlap || want overlap-conn || want overlap-rc; then  # the mfu model at TP 2 (OVERLAP_FLAGS: other model flags of the trainer)
  if [ -n "${OVERLAP_FLAGS:-}" ]; then read -r -a OVF <<<"$OVERLAP_FLAGS"; else OVF=("${MFU_MODEL[@]}"); fi
  OVB=($PY scripts/bench_gpu_overlap.py --tp "${OVERLAP_TP:-2}" ${OVERLAP_ARGS:-})
  want overlap && step overlap 150 "${OVB[@]}" --kinds sleep,copy,channels --trace "$OUT/json/traces" \
    --out "$OUT/json/overlap_standin.json" -- --device "$DEVICE" "${OVF[@]}"
  want overlap-conn && step overlap-conn 120 env CUDA_DEVICE_MAX_CONNECTIONS=8 "${OVB[@]}" --kinds sleep,channels \
    --trace "$OUT/json/traces-conn8" --out "$OUT/json/overlap_standin_conn8.json" -- --device "$DEVICE" "${OVF[@]}"
  want overlap-rc && step overlap-rc 150 "${OVB[@]}" --kinds sleep,copy,channels --trace "$OUT/json/traces-rc" \
    --out "$OUT/json/overlap_standin_rc.json" -- --device "$DEVICE" "${OVF[@]}" \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  if ls "$OUT"/json/overlap_standin*.json >/dev/null 2>&1; then
    step sim-standin 30 $PY scripts/sim_vs_standin.py "$OUT"/json/overlap_standin*.json --out "$OUT/json/sim_vs_standin.json"
  fi
fi
if want overlap-summary; then  # docs/gpu.md, "The next GPU call"
  if [ -n "${OVERLAP_FLAGS:-}" ]; then read -r -a OVF <<<"$OVERLAP_FLAGS"; else OVF=("${MFU_MODEL[@]}"); fi
  if [ -n "${LLAMA_SIZES:-}" ]; then read -r -a L70 <<<"$LLAMA_SIZES"; else
  L70=(--num-layers 4 --hidden-size 8192 --num-attention-heads 64 --num-query-groups 8 --ffn-hidden-size 28672
    --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000 --micro-batch-size 2 --bf16); fi
  L70+=(--group-query-attention --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
    --untie-embeddings-and-output-weights)
  mkdir -p "$OUT/json/summary"
  for model in h4096 llama2-70b-tp8; do
    if [ "$model" = h4096 ]; then tp=2; flags=("${OVF[@]}"); else tp=8; flags=("${L70[@]}"); fi
    for rc in none full; do
      rcf=(); [ "$rc" = full ] && rcf=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
      for gbps in ${SUMMARY_LINKS:-24 150}; do
        step "summary-$model-$rc-$gbps" 90 $PY scripts/bench_gpu_overlap.py --tp "$tp" --kinds sleep,nccl \
          --link-gbps "$gbps" --label "$model" ${OVERLAP_ARGS:-} --out "$OUT/json/summary/overlap-$model-$rc-$gbps.json" \
          -- --device "$DEVICE" "${flags[@]}" ${rcf[@]+"${rcf[@]}"}
      done
    done
  done
  if ls "$OUT"/json/summary/overlap-*.json >/dev/null 2>&1; then
    step overlap-summary 30 $PY -m benchmarks.standin.summary "$OUT"/json/summary/overlap-*.json \
      --out "$OUT/json/overlap_summary.json"
  fi
fi
if want moe-standin; then  # docs/gpu.md, "Oases over MoE on one GPU"
  if [ -n "${MOE_SIZES:-}" ]; then read -r -a MOE <<<"$MOE_SIZES"; else
  MOE=(--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 14336
    --num-experts 8 --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000 --micro-batch-size 2 --bf16); fi
  MOE+=(--group-query-attention --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
    --untie-embeddings-and-output-weights --moe-router-topk 2 --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2)
  mkdir -p "$OUT/json/moe"
  for layout in ${MOE_LAYOUTS:-1x2 2x2}; do
    tp=${layout%x*}; ep=${layout#*x}; sp=(); [ "$tp" -gt 1 ] && sp=(--sequence-parallel)
    for gbps in ${MOE_LINKS:-24}; do
      name="mixtral-8x7b-tp${tp}ep${ep}"
      step "moe-$name-$gbps" 120 $PY scripts/bench_gpu_overlap.py --tp "$tp" --ep "$ep" --kinds sleep,nccl \
        --link-gbps "$gbps" --label "$name" ${OVERLAP_ARGS:-} --out "$OUT/json/moe/overlap-$name-$gbps.json" \
        -- --device "$DEVICE" "${MOE[@]}" ${sp[@]+"${sp[@]}"}
    done
  done
  if ls "$OUT"/json/moe/overlap-*.json >/dev/null 2>&1; then
    step moe-summary 30 $PY -m benchmarks.standin.summary "$OUT"/json/moe/overlap-*.json --out "$OUT/json/moe_summary.json"
    step sim-standin-moe 60 $PY scripts/sim_vs_standin.py "$OUT"/json/moe/overlap-*.json --out "$OUT/json/sim_vs_standin_moe.json"
  fi
fi
want fusion && step fusion 90 $PY scripts/gpu_fusion_bench.py --device "$DEVICE" ${FUSION_ARGS:---hidden 4096 --seq 4096} --out "$OUT/json/fusion.json"

RECOMP=(--recompute-granularity full --recompute-method uniform)
if want train; then
train tp1-stock 1 cuda "${RECOMP[@]}"
train tp1-oases 1 cuda --schedule oases "${RECOMP[@]}"
train tp1-stock-cpu 1 cpu "${RECOMP[@]}"
train tp1-oases-bf16 1 cuda --schedule oases --bf16
train tp1-stock-bf16 1 cuda --bf16

# Multi-rank steps need a GPU per rank: NCCL 2.28 refuses two ranks on one GPU ("invalid usage",
# seen on an H200 on 2026-11-26).
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" -ge 8 ]; then
  train tp2-stock 2 cuda --tensor-model-parallel-size 2
  train tp2-oases 2 cuda --tensor-model-parallel-size 2 --schedule oases "${RECOMP[@]}"
  train tp2-oases-sp 2 cuda --tensor-model-parallel-size 2 --schedule oases --sequence-parallel
  train tp4-stock 4 cuda --tensor-model-parallel-size 4
  train tp4-atp22 4 cuda --tensor-model-parallel-size 4 --tp-backend atp --atp-mesh 2,2 --atp-chunks 2
  train tp8-3d 8 cuda --tensor-model-parallel-size 8 --tp-backend 3d
fi
fi

want measure && step measure 150 $PY scripts/gpu_measure.py --out "$OUT/json" --limit-s 40 ${MEASURE:-}
want gemm && step gemm 150 $PY scripts/gpu_measure.py --out "$OUT/json" --what table --device "$DEVICE" --reps 20 --limit-s 100 ${GEMM_ARGS:-}
want pytest && step pytest 150 $PY -m pytest -q -x -p no:cacheprovider ${PYTESTS:-tests/test_oases_schedule.py tests/test_gpu_twins.py}
sim_model() {  # sim_model NAME SCHEDULES FLAGS...: profile the model's events, train it, predict its step
  local name=$1 scheds=$2; shift 2
  local f=("$@" --attention-backend auto --seed 1234 --nproc-per-node 1 --device "${SIM_DEVICE:-$DEVICE}")
  for sched in $scheds; do
    # the clocks as found, then after SETTLE_S seconds of GEMMs, read under load
    $PY scripts/gpu_settle.py --seconds "${SETTLE_S:-5}" --label "sim-$name-$sched" >>"$SUMMARY" 2>>"$LOG"
    step "sim-profile-$name-$sched" 120 $PY -m megatron_oases.cli profile --out "$OUT/json/prof-$name-$sched.json" --reps 10 -- "${f[@]}" --schedule "$sched"
    if [ "$name" != mfu ] || [ ! -s "$OUT/json/run-mfu-$sched-auto.json" ]; then
      step "sim-train-$name-$sched" 120 $PY -m megatron_oases.cli train "${f[@]}" --schedule "$sched" --log-json "$OUT/json/run-sim-$name-$sched.json"
    fi
    step "sim-predict-$name-$sched" 60 $PY -m megatron_oases.cli sim --predict --profile "$OUT/json/prof-$name-$sched.json" -- "${f[@]}" --schedule "$sched"
    sed -n "/=== sim-predict-$name-$sched/,\$p" "$LOG" | grep -m1 "predicted step time" | sed "s/^/$name $sched: /" >>"$SUMMARY"
  done
}
# The simulator against this card (issue 35): the mfu model (GEMM-bound), then smaller ones down
# to host-bound; SIM_MODEL replaces the list with one model's flags.
if want sim; then
  if [ -n "${SIM_MODEL:-}" ]; then read -r -a SIMF <<<"$SIM_MODEL"; sim_model custom "${SIM_SCHEDULES:-default oases}" "${SIMF[@]}"
  else sim_model mfu "${SIM_SCHEDULES:-default oases}" "${MFU_MODEL[@]}" "${MFU_ITERS[@]}"; fi
fi
if want sim-sizes; then
  for h in ${SIM_HIDDEN:-512 1024 2048}; do
    sim_model "h$h" "${SIM_SCHEDULES:-default oases}" --num-layers 4 --hidden-size "$h" --num-attention-heads $((h / 128 > 4 ? h / 128 : 4)) \
      --seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 --micro-batch-size 2 --global-batch-size 4 --bf16 --train-iters 8
  done
fi
RESERVE=0  # the compare step's share of the budget is its own now
want compare && step compare 30 $PY scripts/gpu_compare.py "$OUT/json"
tar -czf "$OUT/results.tar.gz" -C "$OUT" json && rm -rf "$OUT/json"
echo "--- summary (elapsed $(( $(date +%s) - T0 ))s)"; cat "$SUMMARY"
sed -n '/^=== compare/,$p' "$LOG" | tail -n 60
