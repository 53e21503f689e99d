"""--grad-compression (ddp_full.py): DDP's buckets all-reduced in bf16 or fp16 through torch's
communication hooks. A step sends half the bytes and, with accumulation, still all-reduces once per
optimizer step; 16 steps land next to uncompressed ones; a compressed run resumes bit for bit.

Bytes and all-reduces are counted in each process by tests/count_allreduces.py, whose counting hook
runs the script's own hook inside it: the sizes of the tensors torch's hooks all-reduce, exact.

Tolerance. As test_amp judges bf16 autocast, from a model past the plateau (test_amp's PRETRAINED):
16 optimizer steps of ddp_full.py on 2 processes x 4, compressed and not, and the distance of the
compressed run's weights from the uncompressed one's as a fraction of how far those steps moved them
(test_amp.drift). COMPRESSION_DRIFT_MAX = 0.05: measured 0.0085-0.0096 (bf16) and 0.0024-0.0025
(fp16) on three kernel paths of an AMD EPYC (default; ONEDNN_MAX_CPU_ISA=AVX2;
ATEN_CPU_CAPABILITY=default): 5x room; a run that took none of its steps is 1.0 by construction.
"""
import json

import pytest

from conftest import TINY, check, launch, weights
from test_amp import CONTINUE, drift, pretrained
from test_resume import assert_bitwise_equal

ACCUM = ["--batch-size", "8", "--accum-steps", "5"]  # 2 epochs x 3 optimizer steps on 2 processes
ACCUM_STEPS_PER_RUN = 6
COMPRESSION_DRIFT_MAX = 0.05


def counted(runs, compression):
    """ddp_full.py with ACCUM through the counting hook; the run's folder and its counts."""
    name = f"full_accum5_w2_{compression}_counted"
    counts = runs.root / f"{name}-counts"
    out_dir = runs.get(name, "tests/count_allreduces.py", [*ACCUM, "--grad-compression", compression],
                       nproc=2, env={"COUNT_SCRIPT": "ddp_full.py", "COUNT_DIR": str(counts)})
    return out_dir, [json.loads((counts / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_a_compressed_step_sends_half_the_bytes_and_still_all_reduces_once_per_optimizer_step(runs, compression):
    _, plain = counted(runs, "none")
    _, compressed = counted(runs, compression)
    for full, half in zip(plain, compressed):
        assert full["reductions"] == half["reductions"] == ACCUM_STEPS_PER_RUN
        assert full["bucket_calls"] == half["bucket_calls"]
        assert full["bytes_sent"] > 0 and half["bytes_sent"] * 2 == full["bytes_sent"]


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_16_compressed_steps_land_next_to_uncompressed_ones(runs, compression):
    start = pretrained(runs) / "model.pt"
    args = [*CONTINUE, "--batch-size", "4", "--init-from", str(start)]
    plain = runs.get("compression_none_w2", "ddp_full.py", args, nproc=2)
    compressed = runs.get(f"compression_{compression}_w2", "ddp_full.py", [*args, "--grad-compression", compression],
                          nproc=2)
    a, b = weights(compressed), weights(plain)
    assert any((a[k] != b[k]).any() for k in b)  # the hook ran: 16 bits rounded the sums
    assert drift(compressed, plain, start.parent) <= COMPRESSION_DRIFT_MAX


@pytest.mark.slow
def test_a_compressed_run_stopped_mid_epoch_resumes_bit_for_bit(runs, tmp_path):
    straight, _ = counted(runs, "bf16")  # the counting hook runs the same hook: the same arithmetic
    args = [*TINY, *ACCUM, "--grad-compression", "bf16", "--out-dir", str(tmp_path)]
    check(launch("ddp_full.py", [*args, "--max-steps", "2"], nproc=2))
    check(launch("ddp_full.py", args, nproc=2))
    assert_bitwise_equal(straight, tmp_path)
