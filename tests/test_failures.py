"""What goes wrong midway says so in one line: a full disk, an error only some processes meet, and a
section "your data and model" without a name the rest of the script uses (ddp_full.py and fsdp.py,
where the machinery of long runs enters).

The full disk is a real one: a tmpfs of a chosen size, mounted for one launch in a mount namespace
of its own (`unshare --user --map-root-user --mount`: no root needed where user namespaces are
allowed, and nothing left mounted after). What the launch left on it is copied out before the
namespace goes. The sizes come from the checkpoints these settings write (CNN, TINY, batch 8 on 2
processes): ddp_full.py's 481 KiB, fsdp.py's 572 KiB: a disk of 800 (900) KiB holds the first
checkpoint and not the second.

The GPU count is stood in for on the CPU by tests/fewer_gpus.py: torch.cuda reports one device, so
of 2 processes the one of local rank 1 meets the check, the other does not.
"""
import ast
import re
import shutil
import subprocess

import pytest

from conftest import IMAGEFOLDER, ROOT, TINY, check, launch, script_traceback
from test_bad_input import call_main
from test_resume import assert_bitwise_equal

SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]
DDP_SCRIPTS = SCRIPTS[2:]
EXIT_WRITE_FAILED = 74  # EX_IOERR: the scripts' status for a write that failed

SMALL_DISK = '''options=$1 disk=$2 left=$3; shift 3
mount -t tmpfs -o "$options" tmpfs "$disk" || exit 99
"$@"; status=$?
cp -a "$disk/." "$left/"
exit $status
'''


@pytest.fixture(scope="session")
def can_mount(tmp_path_factory):
    probe = tmp_path_factory.mktemp("mount-probe")
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                             f"mount -t tmpfs -o size=64k tmpfs {probe}"], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"a small file system needs a private mount namespace, refused here: {result.stderr.strip()}")


def on_small_disk(tmp_path, size_kib, script, args, nproc=None, inodes=None):
    """Launch with --out-dir on a file system of size_kib KiB (and as many files and directories as
    `inodes` says, the root among them); return (result, the out-dir as it was left)."""
    disk, left = tmp_path / "disk", tmp_path / "left"
    disk.mkdir()
    left.mkdir()
    options = f"size={size_kib}k" + (f",nr_inodes={inodes}" if inodes else "")
    wrap = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", SMALL_DISK, "sh", options,
            str(disk), str(left)]
    result = launch(script, [*args, "--out-dir", str(disk / "run")], nproc=nproc, wrap=wrap)
    assert result.returncode != 99, result.stderr
    return result, left / "run"


def error_lines(result, script):
    return [line for line in result.stderr.splitlines() if f"{script}: error:" in line]


def stopped_together(result, status):
    """Every worker that torchrun reports exited with `status`, or with the SIGTERM that torchrun sends
    the others once the first has exited (a peer that crashed on a closed connection would exit 1)."""
    codes = [int(code) for code in re.findall(r"exitcode\s*: (-?\d+)", result.stderr)]
    return status in codes and set(codes) <= {status, -15}


def hidden_files(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".*"))


# --- a full disk ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_is_one_line_exit_74_and_the_run_resumes_from_the_last_one(
        runs, can_mount, tmp_path):
    straight = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)  # checkpoints at 12, 24
    result, left = on_small_disk(tmp_path, 800, "ddp_full.py", [*TINY, "--batch-size", "8"], nproc=2)
    disk = tmp_path / "disk" / "run"
    lines = error_lines(result, "ddp_full.py")  # from rank 0, the writer; the others say nothing
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert (f"cannot write {disk}/checkpoints/step_000000024.pt: No space left on device" in line
            and "MiB free there); the files already in --out-dir are whole; the newest complete checkpoint is "
                f"{disk}/checkpoints/step_000000012.pt: fix that, then run the same command again" in line), line
    assert not script_traceback(result, "ddp_full.py"), result.stderr
    assert stopped_together(result, EXIT_WRITE_FAILED), result.stderr
    assert [p.name for p in (left / "checkpoints").iterdir()] == ["step_000000012.pt"]
    assert hidden_files(left) == []  # no temporary file left behind
    # What the user does next: give it space (here: the same files on a roomier disk), run the same command.
    moved = tmp_path / "moved"
    shutil.copytree(left, moved)
    resumed = check(launch("ddp_full.py", [*TINY, "--batch-size", "8", "--out-dir", str(moved)], nproc=2))
    assert "step_000000012.pt: step 0 of epoch 2" in resumed.stdout
    assert_bitwise_equal(straight, moved)


@pytest.mark.slow
def test_a_full_disk_at_a_sharded_checkpoint_leaves_no_partial_directory_and_resumes(runs, can_mount, tmp_path):
    straight = runs.get("fsdp_w2_b8", "fsdp.py", ["--batch-size", "8"], nproc=2)
    result, left = on_small_disk(tmp_path, 900, "fsdp.py", [*TINY, "--batch-size", "8"], nproc=2)
    disk = tmp_path / "disk" / "run"
    lines = error_lines(result, "fsdp.py")
    # Each process writes its own shard: each one that met the full disk says so, naming its rank.
    assert 1 <= len(lines) <= 2 and len({line.split(":")[2] for line in lines}) == len(lines), lines
    for line in lines:
        assert re.search(rf"rank \d: cannot write its shards of {disk}/checkpoints/step_000000024: ", line), line
        assert (f"the newest complete checkpoint is {disk}/checkpoints/step_000000012: fix that, then run "
                "the same command again" in line), line
    assert not script_traceback(result, "fsdp.py"), result.stderr
    assert stopped_together(result, EXIT_WRITE_FAILED), result.stderr
    assert [p.name for p in (left / "checkpoints").iterdir()] == ["step_000000012"]
    assert hidden_files(left) == ["checkpoints/step_000000012/.metadata"]  # dcp's own; no .step_*.tmp
    moved = tmp_path / "moved"
    shutil.copytree(left, moved)
    resumed = check(launch("fsdp.py", [*TINY, "--batch-size", "8", "--out-dir", str(moved)], nproc=2))
    assert "step_000000012: step 0 of epoch 2" in resumed.stdout
    assert_bitwise_equal(straight, moved)


@pytest.mark.slow
def test_a_sharded_checkpoint_directory_that_cannot_be_made_is_one_line_per_process_exit_74(can_mount, tmp_path):
    # 4 inodes: the disk's root, run/, metrics.jsonl and checkpoints/; the checkpoint's directory is
    # the fifth, which dcp.save makes on every process (a full disk refuses a directory as a file).
    result, left = on_small_disk(tmp_path, 20 * 1024, "fsdp.py", [*TINY, "--batch-size", "8"], nproc=2, inodes=4)
    disk = tmp_path / "disk" / "run"
    lines = error_lines(result, "fsdp.py")
    assert len(lines) == 2, result.stderr
    for line in lines:
        assert re.search(rf"rank \d: cannot write its shards of {disk}/checkpoints/step_000000012: No space left on "
                         "device", line), line
    assert not script_traceback(result, "fsdp.py"), result.stderr
    assert stopped_together(result, EXIT_WRITE_FAILED), result.stderr
    assert hidden_files(left) == []


# --- an error that only some processes meet ------------------------------------------------------

# The first tier runs the script users copy; the second tier the other three.
@pytest.mark.parametrize("script", [pytest.param(s, marks=[] if s == "ddp_full.py" else pytest.mark.slow)
                                    for s in DDP_SCRIPTS])
def test_more_processes_than_gpus_is_a_line_from_each_process_that_has_no_gpu(script, tmp_path):
    # Rank 1 meets the check; rank 0 meets nothing and says nothing. (With more processes than that,
    # the first to exit makes torchrun stop the others, some perhaps before they reach the check.)
    result = launch("tests/fewer_gpus.py", [str(ROOT / script), *TINY, "--backend", "gloo",
                                            "--out-dir", str(tmp_path)], nproc=2, env={"FEWER_GPUS": "1"})
    assert error_lines(result, script) == [f"{script}: error: rank 1: local rank 1 but only 1 GPUs are visible: "
                                           f"start at most one process per GPU"], result.stderr
    assert not script_traceback(result, script), result.stderr
    assert stopped_together(result, 2), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_basic.py", "fsdp.py"])
def test_data_that_one_process_cannot_see_is_a_line_from_that_process(script, image_tree, tmp_path):
    # Rank 0 reads the data first (rank0_first), then the others: rank 1 finds no train/ directory.
    result = launch("tests/missing_on_one_rank.py", [str(ROOT / script), *IMAGEFOLDER, "--data-dir", str(image_tree),
                                                     "--out-dir", str(tmp_path)],
                    nproc=2, env={"MISSING_RANK": "1", "MISSING_DIR": str(image_tree / "train")})
    lines = error_lines(result, script)
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: rank 1: no imagefolder data in "), \
        result.stderr
    assert not script_traceback(result, script), result.stderr
    assert stopped_together(result, 2), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_a_resume_checkpoint_that_one_process_cannot_see_is_a_line_naming_that_process(script, tmp_path):
    # --resume names a checkpoint on node 0's disk alone. Checked before the process group existed,
    # rank 1's error was its own and unsaid (rank 0 speaks for bad input that all meet); read
    # where the processes agree on the checkpoint, it is said once, naming rank 1.
    args = [*TINY, "--batch-size", "8", "--max-steps", "2"]
    check(launch(script, [*args, "--out-dir", str(tmp_path / "first")], nproc=2))
    saved = next((tmp_path / "first" / "checkpoints").glob("step_*"))
    result = launch("tests/missing_on_one_rank.py", [str(ROOT / script), *args, "--resume", str(saved),
                                                     "--out-dir", str(tmp_path / "second")],
                    nproc=2, env={"MISSING_RANK": "1", "MISSING_DIR": str(saved.parent)})
    lines = error_lines(result, script)
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: on rank 1: checkpoint {saved} cannot be "
                                                   "read: FileNotFoundError"), result.stderr
    assert not script_traceback(result, script), result.stderr
    assert stopped_together(result, 2), result.stderr


@pytest.mark.slow  # fsdp: the first tier keeps ddp_basic's case above
def test_an_out_dir_one_process_cannot_write_stops_fsdp_at_start_with_a_line_from_that_process(tmp_path):
    # Every process of fsdp.py writes its shards there (under DDP rank 0 alone writes): each checks.
    out_dir = tmp_path / "out"
    result = launch("tests/missing_on_one_rank.py", [str(ROOT / "fsdp.py"), *TINY, "--out-dir", str(out_dir)],
                    nproc=2, env={"MISSING_RANK": "1", "MISSING_DIR": str(out_dir)})
    lines = error_lines(result, "fsdp.py")
    assert len(lines) == 1 and lines[0].startswith(f"fsdp.py: error: rank 1: cannot write to --out-dir {out_dir}"), \
        result.stderr
    assert not script_traceback(result, "fsdp.py"), result.stderr
    assert stopped_together(result, 2), result.stderr
    assert not (out_dir / "metrics.jsonl").exists()  # stopped before any work


# --- the section "your data and model" -----------------------------------------------------------

MAPPED = ["ddp_full.py", "fsdp.py"]  # the scripts with the machinery of long runs, check_task among it
HOOKS = ["build_datasets", "build_model", "batch_loss", "evaluate_batch", "EVAL_METRICS",
         "add_task_arguments", "pretrained_weights", "RESUME_MAY_CHANGE_TASK"]


def without(text, name):
    """The script with the top-level definition of `name` inside its section "your data and model"
    removed, and any statement extending it (`name += ...`, as an optional part does)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# --- your data and model"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# --- "))
    found = []
    for node in ast.parse(text).body:
        targets = getattr(node, "targets", []) + [getattr(node, "target", None)]
        names = [node.name] if hasattr(node, "name") else [t.id for t in targets
                                                            if isinstance(t, ast.Name)]
        if name in names and start < node.lineno <= end:
            found.append(node)
    assert found, f"{name} is not defined in the section"
    for node in reversed(found):
        lines[node.lineno - 1:node.end_lineno] = []
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("script,hook", [(script, hook) for script in MAPPED
                                         for hook in HOOKS + ["shard_units"] * (script == "fsdp.py")])
def test_a_section_without_a_name_the_script_uses_stops_before_any_work_naming_it(script, hook, tmp_path,
                                                                                   capsys):
    # Without the check, the missing name is a NameError from every process, midway for some
    # (pretrained_weights at --init-from pretrained, RESUME_MAY_CHANGE_TASK at a resume).
    copy = tmp_path / script
    copy.write_text(without((ROOT / script).read_text(), hook))
    result = call_main(str(copy), [*TINY, "--out-dir", str(tmp_path / "out")], capsys)
    assert result.returncode == 2
    lines = error_lines(result, script)
    assert len(lines) == 1, result.stderr
    assert f'{script}: error: the section "your data and model" has no {hook}: ' in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # before any work


# --- a restore that fails in a process, not in the checkpoint ------------------------------------

class RaisingModel:
    """A model whose load_state_dict raises what a failing process or group would."""

    def __init__(self, error):
        self.error = error

    def load_state_dict(self, state):
        raise self.error


@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_a_restore_that_fails_in_a_collective_is_that_process_failing_not_a_checkpoint_that_does_not_fit(
        script, monkeypatch):
    # nccl's failures are DistBackendError, a RuntimeError: read as "does not fit" they were bad
    # input (exit 2, rank 0's line). They are this process's failure: exit 1, its rank named.
    import torch.distributed as dist
    from test_validation import load_script

    module = load_script(script)

    def restore(error):
        if script == "fsdp.py":  # its first step: the sharded state dicts to load into
            monkeypatch.setattr(module, "get_state_dict", lambda *args: (_ for _ in ()).throw(error))
        with pytest.raises(module.ConfigError) as raised:
            module.restore({"model": {}}, "runs/x/checkpoints/step_1", RaisingModel(error), None, None, None, 1)
        return raised.value

    failed = restore(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert (failed.status, failed.rank) == (1, 1), (failed.status, failed.rank)
    assert str(failed) == ("restoring runs/x/checkpoints/step_1 failed in this process, not in the checkpoint: "
                           "DistBackendError: NCCL communicator was aborted on rank 1")
    misfit = restore(RuntimeError("Error(s) in loading state_dict for SmallCNN:\n\tsize mismatch"))
    assert (misfit.status, misfit.rank) == (2, None), (misfit.status, misfit.rank)
    assert str(misfit) == ("checkpoint runs/x/checkpoints/step_1 does not fit this model: "
                           "Error(s) in loading state_dict for SmallCNN:")
    if script == "fsdp.py":  # dcp.load reports each rank's exception inside a CheckpointException
        wrapped = module.dcp.api.CheckpointException("load failed", {0: (dist.DistBackendError("timeout"), None)})
        assert restore(wrapped).status == 1
