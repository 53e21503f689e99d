#!/usr/bin/env bash
# One prepared GPU check (under 8 minutes on one GPU): every ladder script for a few steps on CUDA
# (nccl, set_device, pin_memory, fp16 with GradScaler, bf16, a checkpoint save and resume), then
# the bare-loop throughput of resnet50 at 224x224 on synthetic data already on the GPU. Writes gpu_results.md into
# the folder given as $1 (default: docs/bench).
#
#   bash bench/gpu_check.sh [OUT_DIR]          # needs CUDA; DRY_RUN=1 prints the commands only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench}
PY=${PYTHON:-python3}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ -z "${DRY_RUN:-}" ] && [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: no CUDA device visible" >&2
    exit 2
fi
NPROC=$(( NGPU < 2 ? 1 : 2 ))
TMP=$(mktemp -d)  # the runs' checkpoints and outputs, removed at exit
trap 'rm -rf "$TMP"' EXIT
SMALL=(--model resnet18 --workers 2 --train-samples 2048 --val-samples 500 --epochs 1 --batch-size 128 --log-interval 8)
if [ -n "${DRY_RUN:-}" ]; then
    RESULTS=/dev/null  # a dry run leaves no results file behind
else
    mkdir -p "$OUT/gpu_check_logs"  # each check's output, kept beside the table
    RESULTS="$OUT/gpu_results.md"
fi
{
    echo "# GPU check"
    echo
    echo "Run by \`bench/gpu_check.sh\` on $(date -u +%F): $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), "| torch", torch.__version__)' 2>/dev/null)"
    echo
    echo "| check | result | seconds |"
    echo "| --- | --- | --- |"
} > "$RESULTS"

FAILED=0
check() {  # check NAME COMMAND...: run it, record ok/FAILED and the time
    local name=$1; shift
    if [ -n "${DRY_RUN:-}" ]; then echo "$*"; return; fi
    local start=$SECONDS
    local log="$OUT/gpu_check_logs/$name.log"
    if "$@" > "$log" 2>&1; then result=ok; else
        result="FAILED (gpu_check_logs/$name.log)"; FAILED=$((FAILED + 1)); tail -20 "$log"; fi
    echo "| $name | $result | $((SECONDS - start)) |" >> "$RESULTS"
}

TR=($PY -m torch.distributed.run --standalone --nproc_per_node=$NPROC)
check single_gpu        $PY single_gpu.py "${SMALL[@]}" --out-dir "$TMP/1"
check dataparallel      $PY dataparallel.py "${SMALL[@]}" --out-dir "$TMP/2"
check ddp_basic_nccl    "${TR[@]}" ddp_basic.py "${SMALL[@]}" --backend nccl --out-dir "$TMP/3"
check amp_fp16_scaler   "${TR[@]}" ddp_amp_accum.py "${SMALL[@]}" --amp fp16 --accum-steps 2 --clip-grad-norm 1 --out-dir "$TMP/4"
check amp_bf16          "${TR[@]}" ddp_amp_accum.py "${SMALL[@]}" --amp bf16 --out-dir "$TMP/5"
check full_stop         "${TR[@]}" ddp_full.py "${SMALL[@]}" --amp fp16 --max-steps 4 --out-dir "$TMP/6"
check full_resume       "${TR[@]}" ddp_full.py "${SMALL[@]}" --amp fp16 --out-dir "$TMP/6"
check full_uninterrupted "${TR[@]}" ddp_full.py "${SMALL[@]}" --amp fp16 --out-dir "$TMP/7"
# Stopped after 4 steps and resumed must end where the uninterrupted run ends. On CPU the tests demand
# bitwise equality; on a GPU cuDNN may pick kernels that sum in a varying order, so two runs differ
# by rounding, expected far below 1e-3 in 16 steps. A resume that loses momentum, the loss scale or the
# data order moves some weight by at least lr x a gradient, well over 1e-3.
check resume_matches    $PY -c "import torch,sys; a=torch.load(sys.argv[1]); b=torch.load(sys.argv[2]); \
d=max((a[k].float()-b[k].float()).abs().max().item() for k in a); print('max diff', d); sys.exit(d > 1e-3)" \
    "$TMP/6/model.pt" "$TMP/7/model.pt"
if [ -z "${DRY_RUN:-}" ]; then
    echo >> "$RESULTS"
    echo "Throughput, resnet50 at 224x224, batch 64, data already on the GPU (bench/bare.py; plain, then DDP):" >> "$RESULTS"
    echo '```' >> "$RESULTS"
    # A throughput run that fails counts as a failed check too (its output stays in the log).
    $PY bench/bare.py --mode plain --model resnet50 --image-size 224 --batch-size 64 --steps 40 --warmup 10 \
        > "$OUT/gpu_check_logs/throughput_plain.log" 2>&1 || FAILED=$((FAILED + 1))
    "${TR[@]}" bench/bare.py --mode ddp --model resnet50 --image-size 224 --batch-size 64 --steps 40 --warmup 10 \
        > "$OUT/gpu_check_logs/throughput_ddp.log" 2>&1 || FAILED=$((FAILED + 1))
    grep -h BENCH "$OUT/gpu_check_logs/throughput_plain.log" "$OUT/gpu_check_logs/throughput_ddp.log" >> "$RESULTS"
    echo '```' >> "$RESULTS"
    cat "$RESULTS"
fi
exit $(( FAILED > 0 ))  # non-zero when any check failed: the table says which
