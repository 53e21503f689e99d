#!/usr/bin/env bash
# Run the tests that launch DDP processes N times in a row, as the README runs the suite (-n 2),
# and count the runs that were not all green: a harness that flakes is a broken harness.
# Every run starts from nothing (its own pytest session: no launch is shared between runs).
# A failed run's output is kept; the loop goes on, so the tally covers all N runs.
#
#   bash tools/repeat_tests.sh [N]           # default 20: about 80 minutes on 2 cores
#   bash tools/repeat_tests.sh 5 tests/test_cluster.py    # other test files instead
set -u
cd "$(dirname "$0")/.."
N=${1:-20}
shift || true
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
    # Every test file that launches torchrun or a DDP script (test_static, test_ladder_diffs and
    # test_bench launch none).
    FILES=(tests/test_equivalence.py tests/test_amp.py tests/test_validation.py tests/test_resume.py
           tests/test_cluster.py tests/test_launch.py tests/test_data.py tests/test_bad_input.py)
fi
PY=${PYTHON:-.venv/bin/python}
OUT=$(mktemp -d)
failed=0
for i in $(seq 1 "$N"); do
    log="$OUT/run-$i.log"
    start=$SECONDS
    $PY -m pytest -n 2 -q -p no:cacheprovider "${FILES[@]}" > "$log" 2>&1
    status=$?
    summary=$(tail -1 "$log")
    if [ "$status" -ne 0 ]; then
        failed=$((failed + 1))
        echo "run $i of $N: FAILED (exit $status, $((SECONDS - start)) s): $summary -- $log"
    else
        echo "run $i of $N: $summary ($((SECONDS - start)) s)"
    fi
done
echo "$((N - failed)) of $N runs green, $failed failed (logs in $OUT)"
[ "$failed" -eq 0 ]
