#!/usr/bin/env bash
# Launch each DDP script N times in a row (2 processes, gloo, tiny settings) and count failures,
# including the gloo teardown abort ("terminate called without an active exception").
#
#   bash tools/stress_launches.sh [N]        # default 20: 60 launches, about 10 minutes on 2 cores
set -u
cd "$(dirname "$0")/.."
N=${1:-20}
PY=${PYTHON:-.venv/bin/python}
OUT=$(mktemp -d)
export OMP_NUM_THREADS=1
failures=0
for i in $(seq 1 "$N"); do
    for script in ddp_basic ddp_amp_accum ddp_full; do
        log="$OUT/$script-$i.log"
        $PY -m torch.distributed.run --standalone --nproc_per_node=2 "$script.py" --model cnn --workers 0 \
            --train-samples 192 --val-samples 103 --epochs 2 --batch-size 8 --log-interval 1000 \
            --out-dir "$OUT/$script-$i" > "$log" 2>&1
        status=$?
        if [ "$status" -ne 0 ] || grep -q "terminate called" "$log"; then
            failures=$((failures + 1))
            echo "round $i $script FAILED (exit $status): $log"
        fi
    done
    echo "round $i of $N: $failures failures so far"
done
echo "$failures failures in $((N * 3)) launches"
[ "$failures" -eq 0 ]
