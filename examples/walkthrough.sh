#!/usr/bin/env bash
# megatron_oases end to end on CPU (2 gloo ranks, a tiny GPT, a few iterations):
#   mesh -> plan -> profile -> sim -> train stock / oases / oases + plan -> compare.py
# Usage: bash examples/walkthrough.sh [OUT_DIR]        (default: results/walkthrough, git-ignored)
# Needs megatron_oases installed (bash scripts/setup.sh); uses .venv/bin when it exists.
# Expected output and what each file holds: examples/README.md. About 2 minutes on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-results/walkthrough}"
if [[ -x "$ROOT/.venv/bin/megatron-oases" ]]; then BIN="$ROOT/.venv/bin"; else BIN="$(dirname "$(command -v megatron-oases)")"; fi
OASES="${OASES:-$BIN/megatron-oases}"
PYTHON="${PYTHON:-$BIN/python}"
[[ -x "$OASES" ]] || { echo "error: megatron-oases not found; run bash scripts/setup.sh (or set OASES=...)" >&2; exit 2; }
mkdir -p "$OUT/results/tiny"
OUT="$(cd "$OUT" && pwd)"
TOPO="$ROOT/examples/topologies/cpu-pair.yaml"
MODEL="$ROOT/examples/models/walkthrough-tiny.yaml"
ITERS="${ITERS:-5}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"  # Megatron's CPU warnings (no Apex, ...) stay out of the logs
START=$SECONDS
step() { echo; echo "== [$((SECONDS - START))s] $*"; }

# The tiny model, as the flags of each tool (examples/model_flags.py reads the YAML).
mapfile -t MESH_FLAGS < <("$PYTHON" "$ROOT/examples/model_flags.py" "$MODEL" --for mesh)
mapfile -t TRAIN_FLAGS < <("$PYTHON" "$ROOT/examples/model_flags.py" "$MODEL" --for train)
mapfile -t SIM_FLAGS < <("$PYTHON" "$ROOT/examples/model_flags.py" "$MODEL" --for sim)
TRAIN=(--nproc-per-node 2 "${TRAIN_FLAGS[@]}" --global-batch-size 8
       --recompute-granularity full --recompute-method uniform --train-iters "$ITERS")

step "1. ATP mesh for TP 2 on $TOPO"
"$OASES" mesh --topology "$TOPO" "${MESH_FLAGS[@]}" --json "$OUT/mesh.json" | tee "$OUT/mesh.txt"

step "2. Oases planner: a TP degree per layer (analytical RTX 3090 prices; a demonstration, not this CPU)"
"$OASES" plan --model "$MODEL" --topology "$TOPO" --gpu rtx-3090 --global-batch-size 8 \
    --nproc-per-node 2 --schedule oases --out "$OUT/plan.json" --rewrite-cmd "megatron-oases train --nproc-per-node 2 --tensor-model-parallel-size 2" \
    | tee "$OUT/plan.txt"

step "3. profile the Oases run's events on this machine (2 ranks)"
"$OASES" profile --out "$OUT/profile.json" --warmup 1 --reps 3 -- "${TRAIN[@]}" --schedule oases 2>&1 | tail -n 1 | tee "$OUT/profile.txt"

step "4. simulate: stock and Oases on the topology (analytical), the Oases run from the profile"
"$OASES" sim --topology "$TOPO" --gpu rtx-3090 "${SIM_FLAGS[@]}" --num-microbatches 2 --recompute \
    --schedule default | tee "$OUT/sim_stock.txt"
"$OASES" sim --topology "$TOPO" --gpu rtx-3090 "${SIM_FLAGS[@]}" --num-microbatches 2 --recompute \
    --schedule oases | tee "$OUT/sim_oases.txt"
"$OASES" sim --predict --profile "$OUT/profile.json" -- "${TRAIN[@]}" --schedule oases | tee "$OUT/predict_oases.txt"

# One run: its --log-json into results/tiny/<name>.jsonl, its stdout into <name>.out, and its
# command line into <name>.args.json (compare.py reads the arguments from there).
train() {
    local name="$1"; shift
    local -a argv=("${TRAIN[@]}" "$@")
    "$PYTHON" -c 'import json, sys; json.dump(sys.argv[2:], open(sys.argv[1], "w"))' \
        "$OUT/results/tiny/$name.args.json" "${argv[@]}"
    "$OASES" train "${argv[@]}" --log-json "$OUT/results/tiny/$name.jsonl" > "$OUT/results/tiny/$name.out" 2>&1 \
        || { echo "error: train $name failed, see $OUT/results/tiny/$name.out" >&2; tail -n 20 "$OUT/results/tiny/$name.out" >&2; exit 1; }
    tail -n 1 "$OUT/results/tiny/$name.out"
}
step "5. train stock Megatron TP 2 ($ITERS iterations)"
train stock
step "6. train with the Oases schedule"
train oases --schedule oases
step "7. train with the Oases schedule and the plan's per-layer degrees"
train oases-plan --schedule oases --oases-plan "$OUT/plan.json"

step "8. compare"
"$PYTHON" "$ROOT/scripts/compare.py" "$OUT/results" --baseline stock --csv "$OUT/speedup.csv" \
    --png "$OUT/speedup.png" --title "walk-through (CPU, TP 2)" | tee "$OUT/speedup.txt"
echo
echo "walk-through done in $((SECONDS - START)) s; outputs in $OUT"
