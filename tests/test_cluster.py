"""ddp_full.py survives what clusters do: a killed worker, preemption, torn checkpoints, several nodes.

Every test ends by comparing weights bitwise with a run that was never disturbed: resuming must
redo exactly the same arithmetic (see test_resume.py).
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import LAUNCH_TIMEOUT, ROOT, STARTED, TINY, base_env, check, command, end, launch, metrics, weights
from test_bad_input import assert_one_clear_error, call_main, snapshot
from test_resume import BATCHNORM, assert_bitwise_equal

# 512 samples, 2 processes x 8: 32 steps per epoch, 64 in all, a checkpoint every 10 steps. Long
# enough (seconds) for a signal to land after the first checkpoint and before the end.
LONG = [*TINY, "--train-samples", "512", "--batch-size", "8", "--ckpt-steps", "10"]
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def documented_restart_command():
    """The restart command exactly as docs/clusters.md gives it (the block after its restart-command marker)."""
    text = (ROOT / "docs" / "clusters.md").read_text()
    block = re.search(r"<!-- restart-command -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
    assert block, "docs/clusters.md has no restart command block"
    return block.group(1).strip()


def start(cmd, out_dir, env=None):
    full_env = base_env()
    full_env.update(env or {})
    log = open(out_dir.parent / f"{out_dir.name}.log", "w")
    process = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, **({"shell": True} if isinstance(cmd, str) else {}))
    STARTED.append(process)  # ended, with its workers, if the test ends before it
    return process


def wait_for_checkpoint(process, out_dir, timeout=120):
    deadline = time.monotonic() + timeout
    while not list((out_dir / "checkpoints").glob("step_*.pt")):
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.02)


def children(pid):
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def output(out_dir):
    return (out_dir.parent / f"{out_dir.name}.log").read_text()


def test_documented_restart_command_carries_the_reliable_restart_setting():
    restart = documented_restart_command()
    assert restart.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ")
    assert "--max-restarts=" in restart and restart.endswith("ddp_full.py")


@pytest.mark.slow
def test_killed_worker_is_restarted_and_the_run_ends_bitwise_as_if_never_killed(runs, tmp_path):
    reference = runs.get("full_long_w2", "ddp_full.py", LONG[len(TINY):], nproc=2)
    out_dir = tmp_path / "crash"
    # docs/clusters.md's command, with 2 processes instead of 4 and the test's settings appended.
    restart = documented_restart_command().replace("--nproc_per_node=4", "--nproc_per_node=2")
    venv_bin = os.path.dirname(command("x", [], 2)[0])
    cmd = f'PATH="{venv_bin}:$PATH" {restart} ' + " ".join([*LONG, "--out-dir", str(out_dir)])
    process = start(cmd, out_dir)
    wait_for_checkpoint(process, out_dir)
    agent = [pid for pid in children(process.pid)] or [process.pid]
    workers = [w for a in agent for w in children(a)]
    assert workers, "no worker process found"
    os.kill(workers[-1], signal.SIGKILL)  # from outside, as the OOM killer or a node fault would
    assert process.wait(timeout=240) == 0, output(out_dir)[-3000:]
    log = output(out_dir)
    assert "exitcode: -9" in log and "resumed from" in log, log[-3000:]
    assert_bitwise_equal(reference, out_dir)
    # A checkpoint every 10 steps over 64 steps, pruned to --keep-last's default of 3.
    kept = sorted(p.name for p in (out_dir / "checkpoints").glob("step_*.pt"))
    assert kept == ["step_000000050.pt", "step_000000060.pt", "step_000000064.pt"], kept


@pytest.mark.slow
def test_sigterm_through_torchrun_checkpoints_at_an_agreed_step_and_resume_is_bitwise(runs, tmp_path):
    reference = runs.get("full_long_w2", "ddp_full.py", LONG[len(TINY):], nproc=2)
    out_dir = tmp_path / "preempted"
    process = start(command("ddp_full.py", [*LONG, "--out-dir", str(out_dir)], nproc=2), out_dir)
    wait_for_checkpoint(process, out_dir)
    os.kill(process.pid, signal.SIGTERM)  # what SLURM or Kubernetes sends first
    process.wait(timeout=120)
    log = output(out_dir)
    stop = re.search(r"preempted at step (\d+): checkpoint written", log)
    assert stop, log[-3000:]
    assert (out_dir / "checkpoints" / f"step_{int(stop.group(1)):09d}.pt").exists()
    assert not (out_dir / "model.pt").exists()
    check(launch("ddp_full.py", [*LONG, "--out-dir", str(out_dir)], nproc=2))
    assert_bitwise_equal(reference, out_dir)


@pytest.mark.parametrize("ending", [[], ["--max-steps", "2"]], ids=["finished", "stopped"])
def test_a_run_gives_sigterm_back_and_leaves_no_process_group(ending, tmp_path, capsys):
    # The preemption handler holds its gloo group. Left installed after main() returns, both live
    # until the interpreter exits, where gloo's threads may still hold what they must free (a
    # finished run aborted so once in CI, exit -6), and a later SIGTERM is swallowed by a run
    # that is over.
    import gc

    def handler(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, handler)
    try:
        result = call_main("ddp_full.py", [*TINY, "--epochs", "1", "--batch-size", "64", *ending,
                                           "--out-dir", str(tmp_path)], capsys)
        assert result.returncode == 0, result.stderr
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not dist.is_initialized()
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o).__name__ == "Preemption"]


def test_sigterm_exits_with_status_75_after_its_checkpoint(tmp_path):
    # A world of one under plain python: its own exit status is what the shell or scheduler sees.
    process = start(command("ddp_full.py", [*LONG, "--out-dir", str(tmp_path / "run")]), tmp_path / "run")
    wait_for_checkpoint(process, tmp_path / "run")
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(timeout=120) == 75, output(tmp_path / "run")[-3000:]
    assert "preempted at step" in output(tmp_path / "run")


def test_auto_resume_skips_a_torn_checkpoint_and_falls_back_to_the_previous_one(runs, tmp_path):
    reference = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)
    import shutil
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / "step_000000024.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a checkpoint cut short, as by a non-atomic copy
    partial = tmp_path / "checkpoints" / ".step_000000030.pt.tmp4242"  # a writer killed mid-write
    partial.write_bytes(b"\x50\x4b\x03")
    result = check(launch("ddp_full.py", [*TINY, "--batch-size", "8", "--out-dir", str(tmp_path)], nproc=2))
    assert f"skipping: checkpoint {newest} cannot be read" in result.stdout
    assert "step_000000012.pt: step 0 of epoch 2" in result.stdout
    assert_bitwise_equal(reference, tmp_path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_of_two_processes_train_as_one_node_of_four_and_only_global_rank_0_writes(runs, tmp_path):
    one_node = runs.get("basic_w4", "ddp_basic.py", ["--batch-size", "4"], nproc=4)
    port, processes = free_port(), []
    for node in (0, 1):
        out_dir = tmp_path / f"node{node}"  # each "node" its own disk: node 1 must write nothing
        cmd = command("ddp_full.py", [*TINY, "--batch-size", "4", "--out-dir", str(out_dir)])
        cmd[1:2] = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", cmd[1]]
        processes.append(start(cmd, out_dir))
    for process in processes:
        assert process.wait(timeout=240) == 0, output(tmp_path / "node0")[-3000:]
    assert not (tmp_path / "node1").exists()
    assert "global batch 16 = 4 per process x 4 processes" in output(tmp_path / "node0")
    # ddp_full with its defaults trains exactly as ddp_basic: the same weights, bit for bit.
    a, b = weights(one_node), weights(tmp_path / "node0")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Validation differs only in summation order (rank 0 alone vs two shards): the tolerance of test_validation.
    for a, b in zip(metrics(one_node), metrics(tmp_path / "node0"), strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * a["val_loss"] and a["val_samples"] == b["val_samples"]


@pytest.mark.slow
def test_two_identical_runs_are_bitwise_identical_even_through_the_legacy_launcher(runs, tmp_path):
    # The second run goes through torch.distributed.launch (deprecated, still shipped), which appends
    # --local-rank=N to the script's arguments: a script that did not accept it would stop at argparse.
    reference = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)
    legacy = subprocess.run([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2",
                             str(ROOT / "ddp_full.py"), *TINY, "--batch-size", "8", "--out-dir", str(tmp_path)],
                            cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    check(legacy)
    assert_bitwise_equal(reference, tmp_path)


def test_slurm_script_parses_and_its_dry_run_prints_the_reliable_launch_line():
    script = ROOT / "slurm" / "ddp_full.sbatch"
    check(subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True))
    env = dict(os.environ, DRY_RUN="1", HEAD_NODE="node17", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242",
               SLURM_GPUS_ON_NODE="4")
    result = check(subprocess.run(["bash", str(script), "--model", "resnet18"], capture_output=True, text=True,
                                  env=env, cwd=ROOT))
    line = result.stdout.strip()
    assert line.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 srun torchrun "), line
    for part in ("--nnodes=2", "--nproc_per_node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node17:29500",
                 "--rdzv-id=4242", "--max-restarts=3", "ddp_full.py", "--model resnet18"):
        assert part in line, (part, line)


# 97 validation samples on 2 processes: shards of 49 and 48, 7 and 6 batches of 8 -- rank 1 has
# nothing to score in the last round, and must still agree on a stop there.
IN_VALIDATION = ["--batch-size", "8", "--val-samples", "97"]


@pytest.mark.slow
def test_sigterm_during_validation_stops_within_two_batches_and_resume_is_bitwise(runs, tmp_path):
    # SIGTERM reaches rank 0 as it loads its 6th validation batch of epoch 1 (of 7; rank 1 has 6).
    # Every process reads the flag of a batch after the next one, so all stop together after the
    # 7th round, in which rank 1 scores nothing: the run checkpoints with epoch 1 trained and its
    # validation still to come. Acted on only at the epoch's end, it would first finish validation
    # and write epoch 1's metrics.
    reference = runs.get("full_val97_w2", "ddp_full.py", IN_VALIDATION, nproc=2)
    stopped = launch("tests/sigterm_at_sample.py", ["ddp_full.py", *TINY, *IN_VALIDATION, "--out-dir", str(tmp_path)],
                     nproc=2, env={"SIGTERM_IN": "val", "SIGTERM_RANK": "0", "SIGTERM_AT_SAMPLE": "40"})
    # (Its exit status, 75, is tested without torchrun below: here the first process to exit with
    # it makes torchrun stop the other, as it stops a group after any failure.)
    assert "preempted at step 12: checkpoint written" in stopped.stdout, stopped.stdout + stopped.stderr
    assert metrics(tmp_path) == []  # epoch 1's validation did not finish: no record yet
    checkpoint = torch.load(tmp_path / "checkpoints" / "step_000000012.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["step_in_epoch"], checkpoint["history"]) == (0, 12, [])
    resumed = check(launch("ddp_full.py", [*TINY, *IN_VALIDATION, "--out-dir", str(tmp_path)], nproc=2))
    assert "step_000000012.pt: step 12 of epoch 1" in resumed.stdout
    assert_bitwise_equal(reference, tmp_path)


# SIGTERM reaches rank 0 as it loads micro-batch 0 or 1 of its 3 (test_resume's resnet18 run:
# steps of 2 and 1 a process per epoch); all agree a batch later, at micro-batch 1 or 2, whose
# forward has moved BatchNorm's running statistics. Stopped before the step, the checkpoint would
# hold the step before with those statistics, and the resume would move them again. The stop
# comes after the step: step 1, mid-epoch, or step 2, the epoch's last (validation to come).
PREEMPTED_AT = {"0": 1, "8": 2}


@pytest.mark.slow  # resnet18, three runs a case
@pytest.mark.parametrize("sample", PREEMPTED_AT)
@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_sigterm_stops_after_the_optimizer_step_and_a_batchnorm_model_resumes_bitwise(script, sample, runs,
                                                                                       tmp_path):
    reference = runs.get(f"{script[:-3]}_bn_accum_w2", script, BATCHNORM, nproc=2)
    stopped = launch("tests/sigterm_at_sample.py", [script, *TINY, *BATCHNORM, "--out-dir", str(tmp_path)],
                     nproc=2, env={"SIGTERM_IN": "train", "SIGTERM_RANK": "0", "SIGTERM_AT_SAMPLE": sample})
    step = PREEMPTED_AT[sample]
    assert f"preempted at step {step}: checkpoint written" in stopped.stdout, stopped.stdout + stopped.stderr
    resumed = check(launch(script, [*TINY, *BATCHNORM, "--out-dir", str(tmp_path)], nproc=2))
    assert f"step {step} of epoch 1" in resumed.stdout, resumed.stdout
    assert_bitwise_equal(reference, tmp_path)


@pytest.mark.slow
def test_nodes_that_see_different_checkpoints_stop_with_one_line_and_write_nothing(runs, tmp_path):
    # Node 0's disk holds a checkpoint of a 4-process run; node 1's (no shared file system) holds
    # none. Without agreement node 1's processes start afresh while node 0's resume, and the run
    # hangs or fails at a later collective. With it, every process stops at start, exit status 2.
    finished = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)
    checkpoint = torch.load(finished / "checkpoints" / "step_000000024.pt", weights_only=True)
    checkpoint["world_size"], checkpoint["rank_states"] = 4, checkpoint["rank_states"] * 2
    checkpoint["config"]["batch_size"] = 4  # as if written by 4 processes x 4
    (tmp_path / "node0" / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint, tmp_path / "node0" / "checkpoints" / "step_000000024.pt")
    before = snapshot(tmp_path / "node0")
    port, processes = free_port(), []
    for node in (0, 1):
        cmd = command("ddp_full.py", [*TINY, "--batch-size", "4", "--out-dir", str(tmp_path / f"node{node}")])
        cmd[1:2] = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=disagree", cmd[1]]
        processes.append(subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
    results = []
    for process in processes:
        try:
            results.append(subprocess.CompletedProcess(process.args, None, *process.communicate(
                timeout=LAUNCH_TIMEOUT)))
        except subprocess.TimeoutExpired:
            end(processes)  # both agents, with their workers
            raise AssertionError(f"the nodes hung for {LAUNCH_TIMEOUT} s instead of stopping") from None
        results[-1].returncode = process.returncode
    assert_one_clear_error(results[0], "ddp_full.py", "processes disagree on the checkpoint to resume from: "
                           "rank 0 finds step_000000024.pt (step 24), rank 2 finds none")
    assert results[1].returncode != 0 and "error:" not in results[1].stderr  # rank 0 speaks for all
    assert "exitcode: 2" in results[0].stderr + results[1].stderr
    assert snapshot(tmp_path / "node0") == before
    assert not (tmp_path / "node1").exists()


# A data preparation that records who ran it (a download, say): the first process to find no
# data writes it, taking a second, in which a process that came too would write as well.
PREPARATION = '''    prepared = Path(args.data_dir) / "prepared"
    if not prepared.exists():
        with open(Path(args.data_dir) / "writers.txt", "a") as f:
            f.write(f"{os.environ['RANK']} {os.environ['LOCAL_RANK']}\\n")
        time.sleep(1)
        prepared.write_text("done")
    if args.data == "synthetic":
'''


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["a-directory-per-node", "one-shared-directory"])
def test_data_preparation_runs_once_per_node_directory_on_the_first_process_of_the_node(shared, tmp_path):
    # Two "nodes" of 2 processes (static ranks: node 0 holds ranks 0 and 1). rank0_first runs the
    # preparation on rank 0, then on the first process of each other node, then on the rest: one
    # writer per directory, rank 0 alone where the directory is shared. Before, the other nodes'
    # processes all prepared at once (2 writers in node 1's directory).
    script = tmp_path / "ddp_basic.py"
    text = (ROOT / "ddp_basic.py").read_text()
    assert text.count('    if args.data == "synthetic":\n') == 1
    script.write_text(text.replace('    if args.data == "synthetic":\n', PREPARATION))
    port, processes, dirs = free_port(), [], []
    for node in (0, 1):
        data_dir = tmp_path / ("data" if shared else f"data{node}")
        data_dir.mkdir(exist_ok=True)
        dirs.append(data_dir)
        cmd = command(str(script), [*TINY, "--epochs", "1", "--batch-size", "8", "--data-dir", str(data_dir),
                                    "--out-dir", str(tmp_path / f"run{node}")])
        cmd[1:2] = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", f"--node-rank={node}",
                    "--master-addr=127.0.0.1", f"--master-port={port}", cmd[1]]
        processes.append(start(cmd, tmp_path / f"run{node}"))
    for process in processes:
        assert process.wait(timeout=240) == 0, output(tmp_path / "run0")[-3000:]
    writers = {str(d): (d / "writers.txt").read_text().split("\n")[:-1] for d in dict.fromkeys(dirs)}
    expected = {str(dirs[0]): ["0 0"]} if shared else {str(dirs[0]): ["0 0"], str(dirs[1]): ["2 0"]}
    assert writers == expected, writers
