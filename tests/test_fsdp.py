"""fsdp.py, step 6: the ddp_full.py trainer fully sharded trains the same model, and survives the same.

Tolerances are the harness's own (test_equivalence.py, test_validation.py, test_amp.py), for the
same reason: FSDP reduce-scatters where DDP all-reduces and sums micro-batches in its shards, which
changes where float32 sums round, not what is summed. Measured on this machine after the 24
optimizer steps below: fsdp.py on 2 and 4 processes with 2 micro-batches against single_gpu.py on
the global batch, max |weight difference| 7.3e-8 and 6.7e-8; against ddp_full.py, clipping every
step, 1.5e-8. WEIGHT_ATOL = 1e-5 (test_equivalence.py) leaves more than 100x. bf16 (FSDP's policy:
float32 shards, bf16 compute, float32 reduction) on test_amp.py's learning run: validation loss
2.30 -> 1.96 against float32's 2.30 -> 1.70, the same as autocast's on this machine.

The probe (tests/fsdp_probe.py) runs fsdp.py's own main() and records what the outputs do not
show: the samples each process trains on, the sizes of its shards, and the state a resume restored.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from conftest import IMAGEFOLDER, ROOT, TINY, TRAIN_SAMPLES, check, command, launch, metrics, weights
from test_amp import BF16_DRIFT_MAX, MIN_LOSS_DROP, continued, drift, pretrained
from test_bad_input import assert_one_clear_error, call_main, reads_values_as_it_is_built
from test_cluster import RESTART_ENV, children, documented_restart_command, free_port, output, start
from test_equivalence import GLOBAL_BATCH, assert_same_training
from test_resume import TIMING_KEYS, assert_bitwise_equal
from test_validation import (BATCHNORM, VAL_LOSS_RTOL, assert_counts_correct, assert_matches_reference,
                             load_script, reference_logits)

# 2 micro-batches per optimizer step: the global batch of 16 is 2 processes x 4 x 2, or 4 x 2 x 2.
ACCUM = ["--accum-steps", "2"]
# Gradient norms here are 0.2 to 0.6: clipping at 0.1 clips every step, by the global norm.
CLIP = ["--clip-grad-norm", "0.1"]
# A collective left waiting fails the run within a minute, not gloo's default 30.
QUICK_TIMEOUT = ["--timeout-min", "1"]


def per_process(nproc):
    return ["--batch-size", str(GLOBAL_BATCH // nproc // 2), *ACCUM]


def probe(out_dir, args, nproc, probe_dir, **kwargs):
    probe_dir.mkdir(exist_ok=True)
    return launch("tests/fsdp_probe.py", [*TINY, *args, "--out-dir", str(out_dir)], nproc=nproc,
                  env={"PROBE_DIR": str(probe_dir)}, **kwargs)


def test_fsdp_on_2_processes_with_accumulation_trains_what_one_process_trains(runs):
    single = runs.get("single16", "single_gpu.py", ["--batch-size", str(GLOBAL_BATCH)])
    fsdp = runs.get("fsdp_accum_w2", "fsdp.py", per_process(2), nproc=2)
    assert_same_training(single, fsdp)


@pytest.mark.slow
def test_fsdp_on_4_processes_with_accumulation_trains_what_one_process_trains(runs):
    single = runs.get("single16", "single_gpu.py", ["--batch-size", str(GLOBAL_BATCH)])
    fsdp = runs.get("fsdp_accum_w4", "fsdp.py", per_process(4), nproc=4)
    assert_same_training(single, fsdp)


@pytest.mark.slow
def test_fsdp_clips_by_the_global_norm_as_ddp_full_does(runs):
    # Clipping every step: a process that clipped its shard by the shard's own norm would scale
    # its part of the gradient by another factor than the others.
    ddp = runs.get("full_accum_clip_w2", "ddp_full.py", [*per_process(2), *CLIP], nproc=2)
    fsdp = runs.get("fsdp_accum_clip_w2", "fsdp.py", [*per_process(2), *CLIP], nproc=2)
    assert_same_training(ddp, fsdp)


@pytest.mark.slow
def test_fsdp_bf16_policy_follows_float32_and_learns(runs):
    # test_amp.py's continuation, with FSDP's bf16 policy in place of autocast on 2 processes: float32
    # shards, bf16 compute, float32 reduction (measured: bitwise ddp_full.py's autocast on 2).
    fp32, bf16 = continued(runs, "ddp_full.py", "none"), continued(runs, "fsdp.py", "bf16", nproc=2)
    distance = drift(bf16, fp32, pretrained(runs))
    assert distance <= BF16_DRIFT_MAX, f"bf16 is {distance:.3g} of float32's way from its, over {BF16_DRIFT_MAX}"
    before, after = metrics(pretrained(runs))[-1]["val_loss"], metrics(bf16)[-1]["val_loss"]
    assert before - after >= MIN_LOSS_DROP, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_fsdp_low_precision_trains_resnet18_as_ddp_full_with_no_cast_around_batchnorm(runs, amp, tmp_path):
    # A model with BatchNorm keeps float32 parameters in every unit (param_dtype=None) and runs
    # under autocast: the arithmetic of ddp_full.py's autocast (measured here: bitwise, bf16 and
    # fp16; the harness's FSDP-against-DDP tolerances), BatchNorm fed --amp's precision. With a
    # float32 cast of each layer's input and a cast back of its output, as once, BatchNorm was fed
    # float32 and the weights ended 0.10 from ddp_full's.
    ddp = runs.get(f"ddp_full_bn_{amp}_w2", "ddp_full.py", [*BATCHNORM, "--amp", amp], nproc=2, tiny=False)
    probe_dir, out_dir = tmp_path / "probe", tmp_path / "run"
    probe_dir.mkdir()
    check(launch("tests/fsdp_probe.py", [*BATCHNORM, "--amp", amp, "--out-dir", str(out_dir)], nproc=2,
                 env={"PROBE_DIR": str(probe_dir), "PROBE_OPS": "1"}))
    assert_same_training(ddp, out_dir)
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[amp]
    for rank in (0, 1):
        ops = json.loads((probe_dir / f"ops_w2_r{rank}.json").read_text())
        assert ops["batch_norm_inputs"] == {dtype: 20 * 3}, ops  # resnet18's 20 layers, 3 micro-batches


@pytest.mark.slow
def test_fsdp_fp16_overflow_in_one_process_shard_skips_the_step_on_every_process(tmp_path):
    # A gradient that overflows lands, after the reduce-scatter, in one process's shard: the plain
    # GradScaler must skip the step and halve the scale on every process (DTensor reduces its found-inf
    # flag), or the processes' shards would step apart and their loss scales differ from then on.
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    check(launch("tests/fsdp_probe.py", [*TINY, "--batch-size", "8", "--amp", "fp16", "--max-steps", "2",
                                         "--out-dir", str(tmp_path / "run")], nproc=2,
                 env={"PROBE_DIR": str(probe_dir), "PROBE_OVERFLOW": "1"}))
    steps = {r: json.loads((probe_dir / f"scales_w2_r{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):  # 2**16 is GradScaler's first scale; it halves on an overflow, else holds
        assert steps[rank] == [{"scale": 2.0**15, "changed": False}, {"scale": 2.0**15, "changed": True}], steps


@pytest.mark.slow
def test_fsdp_sharded_validation_with_uneven_shards_equals_one_process_evaluation(runs):
    # 103 samples on 4 processes in batches of 5: shards of 26, 26, 26 and 25, 6 batches on three
    # processes and 5 on the fourth, which must still run a sixth forward (every forward gathers
    # parameters from all), or the others wait in it until the timeout.
    out_dir = runs.get("fsdp_val_w4", "fsdp.py", ["--batch-size", "5", "--epochs", "1", *QUICK_TIMEOUT],
                       nproc=4)
    assert_matches_reference("fsdp.py", out_dir)


@pytest.mark.slow
def test_fsdp_sharded_validation_with_batchnorm_scores_the_saved_model(runs):
    import torchvision

    out_dir = runs.get("fsdp_bn_w3", "fsdp.py", BATCHNORM, nproc=3, tiny=False)
    images, labels = load_script("fsdp.py").make_synthetic(23, 0, "val", 32).tensors
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(weights(out_dir))  # model.pt: the plain model's keys, all of them
    model.eval()
    with torch.no_grad():
        logits = model(images).double()
    [record] = metrics(out_dir)
    assert record["val_samples"] == 23
    assert_counts_correct(record["val_acc"], logits, labels)
    loss = F.cross_entropy(logits, labels, reduction="sum").item() / 23
    assert record["val_loss"] == pytest.approx(loss, rel=VAL_LOSS_RTOL), record


# AdamW (two moments and a step count per parameter), fp16 with its GradScaler (whose scale moves
# during the run), 2 micro-batches, clipping: 6 optimizer steps per epoch of 192 samples on 2
# processes x 8.
RESUME = ["--batch-size", "8", "--optimizer", "adamw", "--amp", "fp16", *ACCUM, *CLIP]


@pytest.mark.slow
def test_fsdp_resume_mid_epoch_and_at_an_epoch_boundary_is_bitwise(runs, tmp_path):
    reference = runs.get("fsdp_resume_ref_w2", "fsdp.py", RESUME, nproc=2)
    check(launch("fsdp.py", [*TINY, *RESUME, "--max-steps", "4", "--out-dir", str(tmp_path)], nproc=2))
    check(launch("fsdp.py", [*TINY, *RESUME, "--max-steps", "6", "--out-dir", str(tmp_path)], nproc=2))
    third = check(launch("fsdp.py", [*TINY, *RESUME, "--out-dir", str(tmp_path)], nproc=2))
    assert "step_000000006: step 0 of epoch 2" in third.stdout
    assert_bitwise_equal(reference, tmp_path)


@pytest.mark.slow
def test_fsdp_resume_with_augmenting_workers_is_bitwise(runs, image_tree, tmp_path):
    # The image tree with random crops and flips, 2 workers per process (each run starts new ones):
    # 3 optimizer steps an epoch, stopped mid-epoch 1.
    args = [*IMAGEFOLDER, "--data-dir", str(image_tree), "--workers", "2"]
    reference = runs.get("fsdp_imagefolder_w2_workers2", "fsdp.py", args, nproc=2, tiny=False)
    check(launch("fsdp.py", [*args, "--max-steps", "2", "--out-dir", str(tmp_path)], nproc=2))
    resumed = check(launch("fsdp.py", [*args, "--out-dir", str(tmp_path)], nproc=2))
    assert "step_000000002: step 2 of epoch 1" in resumed.stdout
    assert_bitwise_equal(reference, tmp_path)


@pytest.mark.slow
def test_fsdp_auto_resume_passes_over_a_torn_checkpoint(runs, tmp_path):
    reference = runs.get("fsdp_resume_ref_w2", "fsdp.py", RESUME, nproc=2)
    check(launch("fsdp.py", [*TINY, *RESUME, "--max-steps", "5", "--ckpt-steps", "2",
                             "--out-dir", str(tmp_path)], nproc=2))
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000000002", "step_000000004",
                                                              "step_000000005"]
    # The newest lost the end of one process's shards (a disk full, a node gone mid-write), and a
    # write cut short left its temporary directory: neither is resumed from.
    shard = checkpoints / "step_000000005" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    shutil.copytree(checkpoints / "step_000000004", checkpoints / ".step_000000006.tmp")
    resumed = check(launch("fsdp.py", [*TINY, *RESUME, "--out-dir", str(tmp_path)], nproc=2))
    assert "skipping: checkpoint" in resumed.stdout and "__1_0.distcp is cut short" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step_000000004: step 4 of epoch 1" in resumed.stdout
    assert_bitwise_equal(reference, tmp_path)


def samples_seen(probe_dir, epoch):
    seen = Counter()
    for path in probe_dir.glob("samples_*.txt"):
        for line in path.read_text().splitlines():
            e, index = map(int, line.split())
            if e == epoch:
                seen[index] += 1
    return seen


def read_dcp(checkpoint_dir, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{checkpoint_dir.name}.pt"
    dcp_to_torch_save(checkpoint_dir, target)  # one process, no process group: the whole tensors
    return torch.load(target, weights_only=False)


def assert_states_equal(restored, saved):
    assert restored.keys() == saved.keys()
    for key, value in restored.items():
        if isinstance(value, dict):
            assert_states_equal(value, saved[key])
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, saved[key]), key


@pytest.mark.slow
def test_fsdp_resumes_on_4_then_3_processes_resharded_at_the_same_sample(tmp_path):
    # 192 samples, 8 per process, 2 micro-batches: stopped on 2 processes after 3 steps (96
    # samples), on 4 after 1 more (64), finished on 3.
    args = ["--batch-size", "8", "--optimizer", "adamw", "--accum-steps", "2", "--log-interval", "1"]
    probe_dir, out_dir = tmp_path / "probe", tmp_path / "run"
    saved = {}
    check(probe(out_dir, [*args, "--max-steps", "3"], 2, probe_dir))
    saved[4] = read_dcp(out_dir / "checkpoints" / "step_000000003", tmp_path)  # what 4 processes load
    check(probe(out_dir, [*args, "--max-steps", "4"], 4, probe_dir))
    saved[3] = read_dcp(out_dir / "checkpoints" / "step_000000004", tmp_path)
    last = check(probe(out_dir, args, 3, probe_dir))
    assert "step_000000004: step 4 of epoch 1" in last.stdout
    # Every sample of the epoch once, across the three runs; the last pads its 32 to 33, repeating
    # one sample (as DistributedSampler pads), at most world size - 1 in all.
    seen = samples_seen(probe_dir, epoch=0)
    assert set(seen) == set(range(TRAIN_SAMPLES))
    assert sum(seen.values()) - TRAIN_SAMPLES == -(TRAIN_SAMPLES - 96 - 64) % 3
    assert Counter(samples_seen(probe_dir, epoch=1).values()) == {1: TRAIN_SAMPLES}
    # Each resume restored the model and AdamW's state exactly as saved, resharded.
    for nproc in (4, 3):
        restored = torch.load(probe_dir / f"restored_w{nproc}.pt", weights_only=False)
        assert_states_equal(restored["model"], saved[nproc]["model"])
        assert_states_equal(restored["optimizer"]["state"], saved[nproc]["optimizer"]["state"])
    # The epoch's training loss is over all its samples, trained on 2, 4 and 3 processes; the run
    # learns on (the second epoch, on 3 processes, ends below the first).
    first, second = metrics(out_dir)
    assert second["train_loss"] < first["train_loss"], (first, second)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_fsdp_shards_times_world_size_are_the_whole_model(tmp_path, nproc):
    # resnet18 (BatchNorm, 11.7 M parameters): each process holds its 1/W slice of every parameter,
    # and AdamW's two moments of that slice alone; the slices together are the model, exactly.
    probe_dir = tmp_path / "probe"
    check(probe(tmp_path / "run", [*BATCHNORM, "--optimizer", "adamw", "--max-steps", "1"], nproc,
                probe_dir))
    records = [json.loads((probe_dir / f"shards_w{nproc}_r{r}.json").read_text()) for r in range(nproc)]
    whole = records[0]["whole"]
    for name, size in whole.items():
        assert sum(r["params"][name] for r in records) == size, name
        assert sum(r["optimizer"][name] for r in records) == 2 * size, name
    total = sum(whole.values())
    for record in records:  # about 1/W each: the first dimension splits in near-equal chunks
        assert abs(sum(record["params"].values()) - total / nproc) <= 0.01 * total / nproc


@pytest.mark.slow
def test_hsdp_2_replicas_of_2_processes_trains_what_fsdp_over_4_trains(runs):
    # HSDP reduce-scatters each gradient within a pair, then all-reduces the halves across the
    # pairs: other float32 sums than one reduce-scatter over 4, the same sum (WEIGHT_ATOL).
    fsdp = runs.get("fsdp_accum_w4", "fsdp.py", per_process(4), nproc=4)
    hsdp = runs.get("hsdp_accum_2x2", "fsdp.py", [*per_process(4), "--replicas", "2"], nproc=4)
    assert_same_training(fsdp, hsdp)


@pytest.mark.slow
def test_hsdp_all_reduces_across_replicas_once_a_step_with_accumulation(runs, tmp_path):
    # Each micro-batch reduce-scatters within its replica; the all-reduce across replicas (across
    # nodes) carries the sum of the group's micro-batches, once per unit and optimizer step, not
    # once per micro-batch (twice as many here), and trains what FSDP over 4 trains.
    counts, out_dir = tmp_path / "counts", tmp_path / "run"
    result = check(launch("tests/count_allreduces.py", [*TINY, *per_process(4), "--replicas", "2",
                                                        "--out-dir", str(out_dir)], nproc=4,
                          env={"COUNT_SCRIPT": str(ROOT / "fsdp.py"), "COUNT_DIR": str(counts)}))
    units = int(re.search(r"FSDP: (\d+) units", result.stdout).group(1))  # the root's included
    assert "span nodes" not in result.stdout  # one node of 4: groups of 2 stay within it
    steps = 2 * TRAIN_SAMPLES // GLOBAL_BATCH  # 2 epochs
    for rank in range(4):
        assert json.loads((counts / f"rank{rank}.json").read_text())["fsdp_all_reduces"] == units * steps
    assert_same_training(runs.get("fsdp_accum_w4", "fsdp.py", per_process(4), nproc=4), out_dir)


@pytest.mark.slow
def test_hsdp_checkpoints_resume_in_another_layout_and_on_another_number_of_processes(tmp_path):
    # Stopped after 2 steps as 2 replicas of 2 processes, after 1 more as FSDP over 4, finished as
    # 2 replicas of 1 process each (every process the whole model): each resume restored exactly
    # what was saved, and every sample of the epoch was trained on once.
    args = ["--batch-size", "8", "--optimizer", "adamw", "--log-interval", "1"]
    probe_dir, out_dir = tmp_path / "probe", tmp_path / "run"
    check(probe(out_dir, [*args, "--replicas", "2", "--max-steps", "2"], 4, probe_dir))
    holds = json.loads((probe_dir / "shards_w4_r3.json").read_text())
    assert sum(holds["params"].values()) == pytest.approx(sum(holds["whole"].values()) / 2, rel=0.01)
    saved = {4: read_dcp(out_dir / "checkpoints" / "step_000000002", tmp_path)}
    check(probe(out_dir, [*args, "--max-steps", "3"], 4, probe_dir))
    saved[2] = read_dcp(out_dir / "checkpoints" / "step_000000003", tmp_path)
    last = check(probe(out_dir, [*args, "--replicas", "2"], 2, probe_dir))
    assert "step_000000003: step 3 of epoch 1" in last.stdout
    for nproc in (4, 2):
        restored = torch.load(probe_dir / f"restored_w{nproc}.pt", weights_only=False)
        assert_states_equal(restored["model"], saved[nproc]["model"])
        assert_states_equal(restored["optimizer"]["state"], saved[nproc]["optimizer"]["state"])
    assert Counter(samples_seen(probe_dir, epoch=0).values()) == {1: TRAIN_SAMPLES}


def test_hsdp_replicas_that_do_not_divide_the_processes_are_one_clear_line(tmp_path, capsys):
    result = call_main("fsdp.py", [*TINY, "--replicas", "2", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, "fsdp.py", "--replicas 2 must divide the 1 processes")


def test_fsdp_resume_from_a_missing_checkpoint_directory_is_one_clear_line(tmp_path, capsys):
    # A checkpoint is a directory here, not a file.
    result = call_main("fsdp.py", [*TINY, "--resume", str(tmp_path / "nope"), "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, "fsdp.py", f"checkpoint {tmp_path / 'nope'} cannot be read: FileNotFoundError")


@pytest.mark.slow
def test_fsdp_killed_worker_is_restarted_and_the_run_ends_bitwise_as_if_never_killed(runs, tmp_path):
    long = ["--train-samples", "512", "--batch-size", "8", "--ckpt-steps", "10"]
    reference = runs.get("fsdp_long_w2", "fsdp.py", long, nproc=2)
    out_dir = tmp_path / "crash"
    restart = documented_restart_command().replace("--nproc_per_node=4", "--nproc_per_node=2")
    restart = restart.removesuffix("ddp_full.py") + "fsdp.py"
    venv_bin = os.path.dirname(command("x", [], 2)[0])
    cmd = f'PATH="{venv_bin}:$PATH" {restart} ' + " ".join([*TINY, *long, "--out-dir", str(out_dir)])
    process = start(cmd, out_dir, env=RESTART_ENV)
    deadline = time.monotonic() + 120
    while not [p for p in (out_dir / "checkpoints").glob("step_*") if p.is_dir()]:
        assert process.poll() is None and time.monotonic() < deadline, output(out_dir)[-3000:]
        time.sleep(0.02)
    workers = [w for a in children(process.pid) or [process.pid] for w in children(a)]
    assert workers, "no worker process found"
    os.kill(workers[-1], signal.SIGKILL)
    assert process.wait(timeout=240) == 0, output(out_dir)[-3000:]
    log = output(out_dir)
    assert "exitcode: -9" in log and "resumed from" in log, log[-3000:]
    assert_bitwise_equal(reference, out_dir)


@pytest.mark.slow
def test_fsdp_sigterm_through_torchrun_checkpoints_at_an_agreed_step_and_resume_is_bitwise(runs, tmp_path):
    long = ["--train-samples", "512", "--batch-size", "8", "--ckpt-steps", "10"]
    reference = runs.get("fsdp_long_w2", "fsdp.py", long, nproc=2)
    out_dir = tmp_path / "preempted"
    process = start(command("fsdp.py", [*TINY, *long, "--out-dir", str(out_dir)], nproc=2), out_dir)
    deadline = time.monotonic() + 120
    while not [p for p in (out_dir / "checkpoints").glob("step_*") if p.is_dir()]:
        assert process.poll() is None and time.monotonic() < deadline, output(out_dir)[-3000:]
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGTERM)  # what SLURM or Kubernetes sends first
    process.wait(timeout=120)
    stop = re.search(r"preempted at step (\d+): checkpoint written", output(out_dir))
    assert stop, output(out_dir)[-3000:]
    assert (out_dir / "checkpoints" / f"step_{int(stop.group(1)):09d}" / ".metadata").exists()
    assert not (out_dir / "model.pt").exists()
    check(launch("fsdp.py", [*TINY, *long, "--out-dir", str(out_dir)], nproc=2))
    assert_bitwise_equal(reference, out_dir)


def two_nodes(tmp_path, out_dirs, args, nproc_per_node=2):
    port, processes = free_port(), []
    for node, out_dir in enumerate(out_dirs):
        cmd = command("fsdp.py", [*TINY, *args, "--out-dir", str(out_dir)])
        cmd[1:2] = ["-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc_per_node}",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fsdp-two-nodes", cmd[1]]
        processes.append(start(cmd, tmp_path / f"node{node}"))
    return [process.wait(timeout=240) for process in processes]


@pytest.mark.slow
def test_fsdp_two_nodes_of_two_processes_on_one_file_system_train_as_one_node_of_four(runs, tmp_path):
    one_node = runs.get("fsdp_w4_b4", "fsdp.py", ["--batch-size", "4"], nproc=4)
    shared = tmp_path / "shared"  # every process writes its shards here: one file system for all
    assert two_nodes(tmp_path, [shared, shared], ["--batch-size", "4"]) == [0, 0], output(tmp_path / "node0")[-3000:]
    assert "global batch 16 = 4 per process x 4 processes" in output(tmp_path / "node0")
    assert sorted(p.name for p in (shared / "checkpoints" / "step_000000024").glob("*.distcp")) == \
        [f"__{rank}_0.distcp" for rank in range(4)]
    assert_bitwise_equal(one_node, shared)


@pytest.mark.slow
def test_hsdp_groups_that_span_nodes_are_named_in_one_line_with_the_replicas_that_keep_them_within(tmp_path):
    # 2 nodes of 3 processes as 3 replicas of 2: ranks 2 and 3, one group, sit on two nodes.
    shared = tmp_path / "shared"
    statuses = two_nodes(tmp_path, [shared, shared], ["--batch-size", "4", "--epochs", "1", "--replicas", "3"],
                         nproc_per_node=3)
    assert statuses == [0, 0], output(tmp_path / "node0")[-3000:]
    assert output(tmp_path / "node0").count("HSDP: groups of 2 processes span nodes of 3: their all-gathers and "
                                            "reduce-scatters cross nodes; --replicas 2 keeps each within a node") == 1


@pytest.mark.slow
def test_fsdp_nodes_that_write_to_different_disks_stop_at_the_first_checkpoint_with_one_line(tmp_path):
    # Each node its own disk: node 1's processes write their shards where rank 0 cannot see them.
    statuses = two_nodes(tmp_path, [tmp_path / "disk0", tmp_path / "disk1"], ["--batch-size", "4"])
    assert statuses == [1, 1], statuses  # torchrun reports its workers' exit 2 as 1
    log = output(tmp_path / "node0")
    errors = [line for line in log.splitlines() if "fsdp.py: error:" in line]
    assert len(errors) == 1, log[-3000:]
    assert "every node must write to the same --out-dir" in errors[0], errors[0]
    assert not list((tmp_path / "disk0" / "checkpoints").glob("step_*")), "a checkpoint without all its shards"


# --- models too big for one process: one host copy, activation checkpointing, empty shards ------

@pytest.mark.slow
def test_fsdp_builds_the_models_values_on_rank_0_alone_and_the_others_only_its_shapes(tmp_path):
    # A copy of the whole model per process would not fit a node's host memory with a large model:
    # rank 0 builds it, the others build it on the meta device, and the shards are filled from rank 0's.
    probe_dir = tmp_path / "probe"
    check(probe(tmp_path / "run", ["--batch-size", "8", "--max-steps", "1"], 2, probe_dir))
    built = {r: (probe_dir / f"built_w2_r{r}.txt").read_text().split() for r in (0, 1)}
    assert [line for line in built[0] if line != "meta"] == ["cpu"], built
    assert set(built[1]) == {"meta"}, built


@pytest.mark.slow
def test_fsdp_starts_from_an_init_from_file_that_rank_0_reads_without_building_the_model(runs, tmp_path):
    # Starting afresh from a file: rank 0 reads it, memory-mapped, into the shards; no process
    # builds the model's values at random first. The values arrive whole: the first validation
    # scores the weights as single_gpu.py scored them, the same count and the loss up to summation order.
    single = runs.get("single16", "single_gpu.py", ["--batch-size", str(GLOBAL_BATCH)])
    probe_dir = tmp_path / "probe"
    check(probe(tmp_path / "run", ["--batch-size", "8", "--max-steps", "1", "--init-from",
                                   str(single / "model.pt")], 2, probe_dir))
    built = {r: (probe_dir / f"built_w2_r{r}.txt").read_text().split() for r in (0, 1)}
    assert [line for line in built[0] if line != "meta"] == ["init_weights_from"], built
    assert set(built[1]) == {"meta"}, built
    start, last_single = metrics(tmp_path / "run")[0], metrics(single)[-1]
    assert start["epoch"] == 0, start
    assert_counts_correct(start["val_acc"], *reference_logits("fsdp.py", single / "model.pt"))
    assert start["val_loss"] == pytest.approx(last_single["val_loss"], rel=1e-6)


# A section's init_weights: every layer's own initialisation, run by each process on its own shards.
OWN_INIT = """def init_weights(model):
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
"""


@pytest.mark.slow
def test_fsdp_with_a_sections_init_weights_builds_nothing_whole_and_each_process_draws_its_own_shards(tmp_path):
    # Nothing whole on any process: every build is on the meta device. On a CPU, where DTensor
    # cannot draw a shard as its slice of one random tensor, each process draws from a seed of its
    # own: the same seed everywhere would give every shard the same numbers (rows 0-15 of the first
    # convolution equal to rows 16-31, measured). The model so started learns.
    copy = tmp_path / "fsdp.py"
    copy.write_text((ROOT / "fsdp.py").read_text().replace("\ninit_weights = None\n", "\n" + OWN_INIT, 1))
    assert OWN_INIT in copy.read_text()
    probe_dir, out_dir = tmp_path / "probe", tmp_path / "run"
    probe_dir.mkdir()
    check(launch("tests/fsdp_probe.py", [*TINY, "--batch-size", "8", "--out-dir", str(out_dir)], nproc=2,
                 env={"PROBE_DIR": str(probe_dir), "PROBE_SCRIPT": str(copy), "PROBE_INITIAL": "1"}))
    built = {r: (probe_dir / f"built_w2_r{r}.txt").read_text().split() for r in (0, 1)}
    assert set(built[0]) == set(built[1]) == {"meta"}, built
    initial = torch.load(probe_dir / "initial_w2.pt")["features.0.weight"]  # 32 channels, 16 a process
    assert not torch.equal(initial[:16], initial[16:])
    records = metrics(out_dir)
    assert records[-1]["train_loss"] < records[0]["train_loss"], records


@pytest.mark.slow
def test_fsdp_starts_from_resnet18_weights_and_first_scores_them_with_their_batchnorm_statistics(runs, tmp_path):
    # BatchNorm's running statistics are buffers, which reach the other processes by a broadcast of
    # their own: the first validation on 2 processes scores model.pt (of a run on 3) as the plain
    # model scores it.
    import torchvision

    saved = runs.get("fsdp_bn_w3", "fsdp.py", BATCHNORM, nproc=3, tiny=False)
    out_dir = tmp_path / "run"
    check(launch("fsdp.py", [*BATCHNORM, "--init-from", str(saved / "model.pt"), "--max-steps", "1",
                             "--out-dir", str(out_dir)], nproc=2))
    images, labels = load_script("fsdp.py").make_synthetic(23, 0, "val", 32).tensors
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(weights(saved))
    model.eval()
    with torch.no_grad():
        logits = model(images).double()
    start = metrics(out_dir)[0]
    assert start["epoch"] == 0 and start["val_samples"] == 23
    assert_counts_correct(start["val_acc"], logits, labels)
    loss = F.cross_entropy(logits, labels, reduction="sum").item() / 23
    assert start["val_loss"] == pytest.approx(loss, rel=VAL_LOSS_RTOL), start


@pytest.mark.slow
@pytest.mark.parametrize("model, extra", [("resnet18", ["--amp", "bf16"]), ("efficientnet_b0", [])],
                         ids=["resnet18-bf16", "efficientnet_b0"])
def test_fsdp_activation_checkpointing_trains_bitwise_the_same_model(runs, model, extra):
    # Recomputing a block's forward in its backward repeats the same arithmetic on this machine:
    # the same weights, bit for bit. BatchNorm's running statistics included, which a second
    # forward would update twice (resnet18; under bf16, the BatchNorm layers inside each block
    # another unit's, gathered once for all of them), and efficientnet_b0's stochastic depth, random in every block, which must drop the
    # same rows twice.
    args = [*BATCHNORM, "--model", model, *extra]
    name = f"fsdp_{model}_{'_'.join(extra) or 'fp32'}_w2"
    plain = runs.get(name, "fsdp.py", args, nproc=2, tiny=False)
    checkpointed = (recomputed_resnet18_bf16(runs)[0] if (model, extra) == ("resnet18", ["--amp", "bf16"]) else
                    runs.get(f"{name}_ac", "fsdp.py", [*args, "--activation-checkpointing"], nproc=2, tiny=False))
    expected, got = weights(plain), weights(checkpointed)
    assert expected.keys() == got.keys()
    assert [key for key in expected if not torch.equal(expected[key], got[key])] == []
    untimed = [[{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in metrics(d)]
               for d in (plain, checkpointed)]
    assert untimed[0] == untimed[1]


def recomputed_resnet18_bf16(runs):
    """(run, probe directory) of fsdp.py's resnet18 in bf16 with --activation-checkpointing, through
    tests/fsdp_probe.py recording FSDP's forward root (a record: the arithmetic is the script's),
    shared by the two tests that read it."""
    probe_dir = runs.root / "fsdp_resnet18_bf16_ac_probe"
    probe_dir.mkdir(exist_ok=True)
    return runs.get("fsdp_resnet18_bf16_ac_root_w2", "tests/fsdp_probe.py",
                    [*BATCHNORM, "--model", "resnet18", "--amp", "bf16", "--activation-checkpointing"], nproc=2,
                    tiny=False, env={"PROBE_DIR": str(probe_dir), "PROBE_ROOT": "1"}), probe_dir


@pytest.mark.slow
def test_activation_checkpointing_leaves_fsdps_forward_root_free_for_every_forward(runs):
    # Every training forward must find FSDP's forward root free and claim it with the model's own
    # unit: that claim is where, on a GPU, the all-gathers wait for the optimizer's last writes to
    # the shards. A recomputed block runs its modules' FSDP hooks inside the backward; a BatchNorm
    # unit there claimed the root, and torch 2.11 never freed it (2.14 does at the backward's end):
    # from the second step on every forward skipped that wait, a silent race on CUDA. Run on 2.11
    # and 2.14.1 (tests/README.md).
    _, probe_dir = recomputed_resnet18_bf16(runs)
    for rank in (0, 1):
        record = json.loads((probe_dir / f"root_w2_r{rank}.json").read_text())
        forwards = record["forwards"]
        assert len(forwards) == 3, record  # 48 samples, 2 processes x 8: 3 steps
        assert [(f["free"], f["claimed_by"][:1]) for f in forwards] == [(True, ["root"])] * 3, record
        # No unit's hook runs in a recomputed block (BatchNorm has no unit of its own): none claims.
        assert record["claims_in_backward"] == [], record


def test_fsdp_compile_with_activation_checkpointing_is_one_clear_line(tmp_path, capsys):
    # torch.compile cannot trace the recompute's context_fn (measured with torch 2.14: an
    # InternalTorchDynamoError at the first forward, from every process).
    result = call_main("fsdp.py", [*TINY, "--compile", "--activation-checkpointing", "--out-dir", str(tmp_path)],
                       capsys)
    assert_one_clear_error(result, "fsdp.py", "--compile cannot trace --activation-checkpointing's recompute")


def test_fsdp_on_a_torch_without_public_fully_shard_is_one_clear_line(monkeypatch, capsys):
    # torch 2.4 and 2.5 have no fully_shard in torch.distributed.fsdp (measured with torch 2.4.1:
    # an ImportError traceback from every process before this line existed). A stand-in: this
    # torch with the two names taken away while the script is imported.
    import torch.distributed.fsdp

    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    monkeypatch.delattr(torch.distributed.fsdp, "MixedPrecisionPolicy")
    result = call_main("fsdp.py", [*TINY], capsys)
    assert_one_clear_error(result, "fsdp.py", f"needs torch 2.6 or later (fully_shard in torch.distributed.fsdp); "
                                              f"this is torch {torch.__version__}")


@pytest.mark.slow
def test_fsdp_over_gloo_on_a_torch_that_sums_the_gradients_is_one_clear_line(tmp_path):
    # torch 2.7 and 2.8 over gloo: fully_shard's gradients were the sum over processes, not the
    # mean (pytorch#162338; measured with 2.7.1 and 2.8.0, twice the mean on 2 processes, and
    # fsdp.py's weights 0.05 from one process's; 2.9.0 and 2.9.1 average). A stand-in: this
    # torch, its version string set to 2.8.0 before the script runs, on 2 processes.
    stand_in = tmp_path / "torch_2_8.py"
    stand_in.write_text(
        "import runpy, sys, torch\n"
        "from torch.torch_version import TorchVersion\n"
        "torch.__version__ = TorchVersion('2.8.0')\n"
        f"sys.argv[0] = {str(ROOT / 'fsdp.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = launch(str(stand_in), [*TINY, "--out-dir", str(tmp_path / "run")], nproc=2)
    assert_one_clear_error(result, "fsdp.py", "over gloo (CPU) needs torch 2.9 or later, where FSDP averages "
                                              "the gradients (pytorch#162338); this is torch 2.8.0")
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_fsdp_teardown_passes_over_private_names_a_torch_lacks(monkeypatch):
    # The caches emptied at the end are DTensor's private ones; a torch that renamed one must not
    # turn a finished run into a traceback, and the caches it does have are still emptied.
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import debug

    emptied = []
    # raising=False: the test runs on a torch that lacks either name too (2.9 has neither).
    monkeypatch.delattr(debug, "_clear_sharding_prop_cache", raising=False)
    monkeypatch.setattr(redistribute, "clear_redistribute_planner_cache", lambda: emptied.append("planner"),
                        raising=False)
    load_script("fsdp.py").release_device_meshes()
    assert emptied == ["planner"]


@pytest.mark.slow
def test_fsdp_with_empty_shards_on_some_processes_trains_checkpoints_and_resumes_on_fewer(tmp_path):
    # The CNN's classifier has 10 rows: in chunks of 2 over 6 processes, rank 5's shard of it is
    # empty (and so is its AdamW state). Stopped after 2 steps on 6 processes, finished on 2.
    args = ["--batch-size", "8", "--optimizer", "adamw", "--log-interval", "1"]
    probe_dir, out_dir = tmp_path / "probe", tmp_path / "run"
    check(probe(out_dir, [*args, "--max-steps", "2", *QUICK_TIMEOUT], 6, probe_dir))
    last = json.loads((probe_dir / "shards_w6_r5.json").read_text())
    assert last["params"]["classifier.weight"] == 0 and last["optimizer"]["classifier.weight"] == 0, last
    saved = read_dcp(out_dir / "checkpoints" / "step_000000002", tmp_path)
    finished = check(probe(out_dir, args, 2, probe_dir))
    assert "step_000000002: step 2 of epoch 1" in finished.stdout
    restored = torch.load(probe_dir / "restored_w2.pt", weights_only=False)
    assert_states_equal(restored["model"], saved["model"])
    assert_states_equal(restored["optimizer"]["state"], saved["optimizer"]["state"])
    model = load_script("fsdp.py").SmallCNN(10)
    model.load_state_dict(weights(out_dir))  # model.pt: whole, every key


def test_fsdp_a_model_that_reads_values_as_it_is_built_is_one_clear_line(tmp_path, capsys):
    # Every process builds the model on the meta device, where a tensor has no value to read.
    module = load_script("fsdp.py")
    module.build_model = reads_values_as_it_is_built
    status = module.main([*TINY, "--out-dir", str(tmp_path)])
    result = subprocess.CompletedProcess(["fsdp.py"], status, *capsys.readouterr())
    assert_one_clear_error(result, "fsdp.py", "the model cannot be built on the meta device, where every process "
                                              "builds its shapes: Tensor.item() cannot be called on meta tensors")
