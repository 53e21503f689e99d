#!/usr/bin/env bash
# The prepared GPU check (about 7 minutes on one GPU): what CPU tests can only stand in for.
#   1. every ladder script for a few steps on CUDA: nccl, set_device, pinned memory, channels-last,
#      TF32 and cudnn.benchmark, fp16 with a GradScaler, bf16, --sync-bn, a torchvision model
#   2. ddp_full.py stopped after 4 steps and resumed (its random states restored on the GPU) ends
#      within 1e-3 of an uninterrupted run
#   3. resnet18's sharded validation (BatchNorm buffers) equals a one-process evaluation of model.pt
#   4. samples/s of ddp_full.py against the bare loop on resnet50, bf16, channels-last, and each
#      speed setting on and off; ddp_full.py with --compile (compile time, steady speed, peak memory)
#   5. fsdp.py: bf16 and fp16 policies (BatchNorm in float32 units) with accumulation and clipping
#      over nccl, --sync-bn, stopped and resumed within 1e-3, its validation against model.pt, and resnet50's
#      samples/s and peak memory beside ddp_full.py's
#   6. the README's test command, pinned to the CPU by the suite itself
# Writes gpu_results.md and each check's log into the folder given as $1 (default: docs/bench).
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
SMALL=(--model resnet18 --workers 2 --train-samples 2048 --val-samples 500 --epochs 1 --batch-size 128
       --log-interval 8)
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
check single_gpu         $PY single_gpu.py "${SMALL[@]}" --out-dir "$TMP/1"
check dataparallel       $PY dataparallel.py "${SMALL[@]}" --out-dir "$TMP/2"
check ddp_basic_nccl     "${TR[@]}" ddp_basic.py "${SMALL[@]}" --backend nccl --out-dir "$TMP/3"
check amp_fp16_scaler    "${TR[@]}" ddp_amp_accum.py "${SMALL[@]}" --amp fp16 --accum-steps 2 --clip-grad-norm 1 \
    --out-dir "$TMP/4"
check amp_bf16           "${TR[@]}" ddp_amp_accum.py "${SMALL[@]}" --amp bf16 --out-dir "$TMP/5"
check full_sync_bn       $PY ddp_full.py "${SMALL[@]}" --sync-bn --out-dir "$TMP/8"
check full_convnext      "${TR[@]}" ddp_full.py "${SMALL[@]}" --model convnext_tiny --amp bf16 --train-samples 512 \
    --out-dir "$TMP/9"
check full_stop          "${TR[@]}" ddp_full.py "${SMALL[@]}" --amp fp16 --max-steps 4 --out-dir "$TMP/6"
check full_resume        "${TR[@]}" ddp_full.py "${SMALL[@]}" --amp fp16 --out-dir "$TMP/6"
check full_uninterrupted "${TR[@]}" ddp_full.py "${SMALL[@]}" --amp fp16 --out-dir "$TMP/7"
# Stopped after 4 steps and resumed must end where the uninterrupted run ends. On CPU the tests demand
# bitwise equality; on a GPU cuDNN may pick kernels that sum in a varying order, so two runs differ
# by rounding, expected far below 1e-3 in 16 steps. A resume that loses momentum, the loss scale or the
# data order moves some weight by at least lr x a gradient, well over 1e-3.
check resume_matches     $PY -c "import torch,sys; a=torch.load(sys.argv[1]); b=torch.load(sys.argv[2]); \
d=max((a[k].float()-b[k].float()).abs().max().item() for k in a); print('max diff', d); sys.exit(d > 1e-3)" \
    "$TMP/6/model.pt" "$TMP/7/model.pt"
# The uninterrupted resnet18 run's sharded validation, against model.pt scored in one process here.
check validation_matches $PY bench/gpu_eval_check.py "$TMP/7" --val-samples 500
# fsdp.py: the same checks, its bf16 and fp16 policies gathering shards over nccl.
check fsdp_bf16          "${TR[@]}" fsdp.py "${SMALL[@]}" --amp bf16 --out-dir "$TMP/12"
check fsdp_fp16_accum    "${TR[@]}" fsdp.py "${SMALL[@]}" --amp fp16 --accum-steps 2 --clip-grad-norm 1 \
    --out-dir "$TMP/13"
check fsdp_sync_bn       "${TR[@]}" fsdp.py "${SMALL[@]}" --sync-bn --out-dir "$TMP/16"
check fsdp_stop          "${TR[@]}" fsdp.py "${SMALL[@]}" --amp bf16 --max-steps 4 --out-dir "$TMP/14"
check fsdp_resume        "${TR[@]}" fsdp.py "${SMALL[@]}" --amp bf16 --out-dir "$TMP/14"
check fsdp_resume_matches $PY -c "import torch,sys; a=torch.load(sys.argv[1]); b=torch.load(sys.argv[2]); \
d=max((a[k].float()-b[k].float()).abs().max().item() for k in a); print('max diff', d); sys.exit(d > 1e-3)" \
    "$TMP/14/model.pt" "$TMP/12/model.pt"
check fsdp_validation_matches $PY bench/gpu_eval_check.py "$TMP/12" --val-samples 500
if [ -z "${DRY_RUN:-}" ]; then
    echo >> "$RESULTS"
    echo "Throughput, resnet50 at 224x224, batch 64 per GPU, bf16, channels-last: the bare loop with data already" >> "$RESULTS"
    echo "on the GPU (bench/bare.py), each speed setting off in turn, then ddp_full.py on the same model:" >> "$RESULTS"
    echo '```' >> "$RESULTS"
fi
BARE=($PY bench/bare.py --mode plain --model resnet50 --image-size 224 --batch-size 64 --steps 30 --warmup 10 --amp bf16)
check speed_bare         "${BARE[@]}"
check speed_no_tf32      "${BARE[@]}" --no-tf32
check speed_no_benchmark "${BARE[@]}" --no-cudnn-benchmark
check speed_no_channels_last "${BARE[@]}" --no-channels-last
check speed_bare_ddp     "${TR[@]}" bench/bare.py --mode ddp --model resnet50 --image-size 224 --batch-size 64 \
    --steps 30 --warmup 10 --amp bf16
# ddp_full.py on synthetic 224-pixel images (an image folder needs files; the bare loop's data is on the GPU).
check speed_ddp_full     "${TR[@]}" ddp_full.py --model resnet50 --image-size 224 --amp bf16 --batch-size 64 --epochs 2 \
    --train-samples 2560 --val-samples 64 --workers 4 --log-interval 20 --resume none --out-dir "$TMP/10"
# The same with --compile: its first epoch holds the compiling, its second the steady speed.
check speed_ddp_full_compile "${TR[@]}" ddp_full.py --model resnet50 --image-size 224 --amp bf16 --batch-size 64 \
    --epochs 2 --train-samples 2560 --val-samples 64 --workers 4 --log-interval 20 --resume none --compile \
    --out-dir "$TMP/11"
# fsdp.py on the same work: its peak memory beside ddp_full.py's (sharding pays as it grows with W).
check speed_fsdp         "${TR[@]}" fsdp.py --model resnet50 --image-size 224 --amp bf16 --batch-size 64 --epochs 2 \
    --train-samples 2560 --val-samples 64 --workers 4 --log-interval 20 --resume none --out-dir "$TMP/15"
if [ -z "${DRY_RUN:-}" ]; then
    grep -h BENCH "$OUT"/gpu_check_logs/speed_*.log >> "$RESULTS"
    for run in speed_ddp_full speed_ddp_full_compile speed_fsdp; do
        echo "$run: $(grep -h "^epoch .* train_loss" "$OUT/gpu_check_logs/$run.log" | tr '\n' ' ')" >> "$RESULTS"
        grep -h "peak memory" "$OUT/gpu_check_logs/$run.log" | tail -1 >> "$RESULTS"
    done
    echo '```' >> "$RESULTS"
fi
# The suite pins itself to the CPU: it must pass on this GPU machine as on a laptop.
check readme_tests       $PY -m pytest -n 8 -q tests
if [ -z "${DRY_RUN:-}" ]; then
    cat "$RESULTS"
fi
exit $(( FAILED > 0 ))  # non-zero when any check failed: the table says which
