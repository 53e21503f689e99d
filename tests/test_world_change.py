"""A run resumed on another number of processes goes on with the same run (ddp_full.py, fsdp.py).

The data goes on from the same sample of the epoch's order, the schedule from the same fraction of
the run. With --global-batch-size the global batch stays what it was (--accum-steps follows the
number of processes), so every optimizer step averages the same samples as in a run never stopped:
for the CNN (no batch statistics, no dropout) the weights end where that run's do, within the
equivalence tolerance (test_equivalence.py: only where float32 sums happen differs).
"""
import os
import shutil
import signal

import pytest

from conftest import IMAGEFOLDER, TINY, check, command, launch, metrics
from test_cluster import children, free_port, output, start, wait_for_checkpoint
from test_bad_input import assert_one_clear_error
from test_equivalence import WEIGHT_ATOL, assert_same_training

pytestmark = pytest.mark.slow  # second tier, as a whole: the part "global batch" and cluster scenarios

# 192 samples, a global batch of 32 = 8 per process x 2 processes x 2 micro-batches: 6 optimizer
# steps an epoch, 2 epochs. Step 3 is mid-epoch 1, step 6 its end. On 1 process it is 8 x 4, on 4
# processes 8 x 1: every micro-batch holds 8 samples on every world size.
GLOBAL = ["--batch-size", "8", "--global-batch-size", "32"]
STOPS = {"mid-epoch": "3", "epoch-end": "6"}


def run(script, out_dir, *extra, nproc):
    return check(launch(script, [*TINY, *GLOBAL, *extra, "--out-dir", str(out_dir)], nproc=nproc))


# Tolerance: test_equivalence.py's WEIGHT_ATOL (where float sums happen differs, about an ulp a step).
# Measured on this AMD EPYC, every case (ddp_full and fsdp, 2 -> 1 and 2 -> 4, mid-epoch and at the
# epoch's end) on its native kernels, ONEDNN_MAX_CPU_ISA=AVX2 with ATEN_CPU_CAPABILITY=default and
# AVX512_CORE with avx2: at most 2.05e-8, no tie event (which would allow TIE_WEIGHT_ATOL).
# ddp_full.py's cases are mid-epoch only (a resume at an epoch's end is the same arithmetic from
# another sample); fsdp.py's keep both.
CASES = [pytest.param(script, nproc, stop, id=f"{script.removesuffix('.py')}-2to{nproc}-{stop}")
         for script in ("ddp_full.py", "fsdp.py") for nproc in (1, 4) for stop in STOPS
         if script == "fsdp.py" or stop == "mid-epoch"]


@pytest.mark.parametrize("script, nproc, stop", CASES)
def test_a_resume_on_another_number_of_processes_with_global_batch_size_trains_as_a_run_never_stopped(
        script, nproc, stop, runs, tmp_path):
    name = script.removesuffix(".py")
    reference = runs.get(f"{name}_global32_w2", script, GLOBAL, nproc=2)
    # The stop on 2 processes, shared by the resumes on 1 and 4: each resumes a copy of it.
    stopped = runs.get(f"{name}_global32_w2_stop{STOPS[stop]}", script, [*GLOBAL, "--max-steps", STOPS[stop]], nproc=2)
    shutil.copytree(stopped, tmp_path, dirs_exist_ok=True)
    resumed = run(script, tmp_path, nproc=nproc)
    accum = 32 // (8 * nproc)
    assert f"global batch 32 = 8 per process x {nproc} processes x {accum} accumulation steps" in resumed.stdout
    assert f"written by 2 processes, resumed by {nproc}: global batch 32 -> 32;" in resumed.stdout
    assert_same_training(reference, tmp_path, atol=WEIGHT_ATOL)


def test_without_global_batch_size_a_resume_on_fewer_processes_goes_on_with_a_smaller_global_batch(tmp_path):
    # --accum-steps stays as given: the global batch is the new world's, and the resume line says so.
    args = ["--batch-size", "8", "--accum-steps", "2"]
    check(launch("ddp_full.py", [*TINY, *args, "--max-steps", "3", "--out-dir", str(tmp_path)], nproc=2))
    resumed = check(launch("ddp_full.py", [*TINY, *args, "--out-dir", str(tmp_path)], nproc=1))
    assert "written by 2 processes, resumed by 1: global batch 32 -> 16;" in resumed.stdout
    assert "fresh random states (dropout), rank 0's BatchNorm statistics" in resumed.stdout
    # Epoch 1 goes on from sample 96 of its order: 96 samples left, 6 steps of 16.
    assert "epoch 1/2 step 9/9" in resumed.stdout


def test_an_elastic_run_that_loses_a_node_finishes_on_the_node_left(runs, tmp_path):
    # Two torchrun agents on loopback, --nnodes=1:2, a process each. After a checkpoint the agent
    # that does not host the rendezvous is SIGKILLed with its worker, as a node that fails; the
    # other's worker fails in its next collective, and its agent restarts it alone: a world of one
    # that resumes from the checkpoint and ends where the run of two never stopped ends.
    long = [*TINY, "--train-samples", "512", "--epochs", "1", "--ckpt-steps", "2", *GLOBAL]
    reference = runs.get("full_long_global32_w2", "ddp_full.py", long[len(TINY):], nproc=2)
    port, out_dir, agents = free_port(), tmp_path / "run", []
    for node in (0, 1):
        cmd = command("ddp_full.py", [*long, "--out-dir", str(out_dir)])
        cmd[1:2] = ["-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
                    # Agent 0 hosts the rendezvous store (is_host), whichever agent starts first.
                    f"--rdzv-conf=last_call_timeout=5,is_host={node == 0}", "--monitor-interval=0.2", cmd[1]]
        agents.append(start(cmd, tmp_path / f"node{node}", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}))
    wait_for_checkpoint(agents[0], out_dir)
    lost = agents[1]
    for pid in [*children(lost.pid), lost.pid]:
        os.kill(pid, signal.SIGKILL)
    assert agents[0].wait(timeout=300) == 0, output(tmp_path / "node0")[-4000:]
    log = output(tmp_path / "node0")
    assert "written by 2 processes, resumed by 1: global batch 32 -> 32;" in log, log[-4000:]
    assert_same_training(reference, out_dir, atol=WEIGHT_ATOL)


def test_global_batch_size_given_first_on_a_resume_keeps_the_global_batch_of_the_run(runs, tmp_path):
    # The run had --accum-steps 2 on 2 processes (32 a step); its resume on 1 adds --global-batch-size 32.
    reference = runs.get("ddp_full_global32_w2", "ddp_full.py", GLOBAL, nproc=2)
    args = [*TINY, "--batch-size", "8", "--out-dir", str(tmp_path)]
    check(launch("ddp_full.py", [*args, "--accum-steps", "2", "--max-steps", "3"], nproc=2))
    resumed = check(launch("ddp_full.py", [*args, "--global-batch-size", "32"], nproc=1))
    assert "written by 2 processes, resumed by 1: global batch 32 -> 32;" in resumed.stdout
    assert_same_training(reference, tmp_path, atol=WEIGHT_ATOL)
    # Another global batch than the run's is another training: refused, in one line.
    refused = launch("ddp_full.py", [*args, "--global-batch-size", "64", "--resume", str(tmp_path / "checkpoints"
                                                                                        / "step_000000003.pt")],
                     nproc=1)
    assert_one_clear_error(refused, "ddp_full.py", "is from a run with --accum-steps 2, this run has 8")


def test_resnet18_with_augmenting_workers_resumes_on_another_number_of_processes(image_tree, tmp_path):
    # BatchNorm (rank 0's statistics go on) and augmenting workers (each sample's draws keyed by
    # (seed, epoch, index)) across a world change: 24 images, 8 a step, stopped after step 1 of 3 on
    # 2 processes, finished on 1. The batch statistics of another split differ, so no weight
    # comparison: the run goes on from the same step, and every validation image counts once.
    args = [*IMAGEFOLDER, "--data-dir", str(image_tree), "--workers", "2", "--model", "resnet18",
            "--batch-size", "4", "--global-batch-size", "8", "--out-dir", str(tmp_path)]
    check(launch("ddp_full.py", [*TINY, *args, "--max-steps", "1"], nproc=2))
    resumed = check(launch("ddp_full.py", [*TINY, *args], nproc=1))
    assert "written by 2 processes, resumed by 1: global batch 8 -> 8;" in resumed.stdout
    assert "epoch 1/2 step 3/3" in resumed.stdout and "epoch 2/2 step 3/3" in resumed.stdout
    assert [record["val_samples"] for record in metrics(tmp_path)] == [9, 9]
