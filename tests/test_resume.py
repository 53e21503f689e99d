"""ddp_full.py resumes exactly: a run stopped and resumed ends bitwise equal to one never stopped.

Bitwise, not approximately: the same processes redo the same arithmetic on the same samples in
the same order from the same state (weights, optimizer, scaler, per-process random generators,
partial loss sums, position in the epoch, and on 3 or more processes DDP's gradient buckets), and
CPU runs are bitwise repeatable.
"""
import argparse
import shutil
from pathlib import Path

import pytest

import torch

from conftest import IMAGEFOLDER, ROOT, TINY, check, launch, metrics, weights

# 2 processes x 8 samples: 12 optimizer steps per epoch of 192 samples, 2 epochs.
ARGS = ["--batch-size", "8"]
TIMING_KEYS = ("samples_per_sec", "train_seconds", "val_seconds")  # measured, so never repeatable


def run_full(out_dir, *extra, nproc=2):
    return check(launch("ddp_full.py", [*TINY, *extra, "--out-dir", str(out_dir)], nproc=nproc))


def assert_bitwise_equal(a_dir, b_dir):
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    strip = lambda records: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]
    assert strip(metrics(a_dir)) == strip(metrics(b_dir))


# fp16 with 2 micro-batches per step on 2 processes x 8: 3 optimizer steps per epoch of 96. The
# loss scale grows and shrinks during training and the accumulation position matters: a resume
# that re-created the scaler or miscounted micro-batches would step differently and end elsewhere.
FP16_ACCUM = [*ARGS, "--amp", "fp16", "--accum-steps", "2", "--train-samples", "96"]


def test_resume_mid_epoch_then_at_an_epoch_boundary_is_bitwise_equal_to_an_uninterrupted_run(runs, tmp_path):
    reference = runs.get("full_fp16_accum_w2", "ddp_full.py", FP16_ACCUM, nproc=2)
    first = run_full(tmp_path, *FP16_ACCUM, "--max-steps", "2")
    assert "stopped after --max-steps 2" in first.stdout
    assert not (tmp_path / "model.pt").exists()
    # Resumed mid-epoch from a copy of the checkpoint named by its path, to the end of epoch 1 ...
    shutil.copy(tmp_path / "checkpoints" / "step_000000002.pt", tmp_path.parent / "saved.pt")
    second = run_full(tmp_path, *FP16_ACCUM, "--max-steps", "3", "--resume", str(tmp_path.parent / "saved.pt"))
    assert "saved.pt: step 2 of epoch 1" in second.stdout
    # ... then with --resume auto from the epoch boundary to the end.
    third = run_full(tmp_path, *FP16_ACCUM)
    assert "step_000000003.pt: step 0 of epoch 2" in third.stdout
    assert_bitwise_equal(reference, tmp_path)


# resnet18 has BatchNorm: running statistics are state that the checkpoint carries for rank 0
# only, while each process's own drift apart between DDP's buffer broadcasts. 2 processes x 8 x 2
# micro-batches: 2 optimizer steps per epoch of 48 (the second a group of one), 2 epochs. Its
# resumes, mid-epoch and at an epoch's end: test_cluster.py's SIGTERM tests.
BATCHNORM = ["--model", "resnet18", "--workers", "0", "--train-samples", "48", "--val-samples", "23",
             "--batch-size", "8", "--accum-steps", "2", "--log-interval", "1000"]


@pytest.mark.slow
def test_resume_restores_the_grad_scaler_state(runs, tmp_path):
    # The loss scale only moves after an overflow or 2000 clean steps, neither of which these short
    # runs reach, so a bitwise comparison alone cannot tell a restored scaler from a fresh one. Give
    # the checkpoint another scale; the run resumed from it must carry that scale on.
    stopped = runs.get("full_fp16_accum_w2_step2", "ddp_full.py", [*FP16_ACCUM, "--max-steps", "2"], nproc=2)
    checkpoint = torch.load(stopped / "checkpoints" / "step_000000002.pt", weights_only=True)
    assert checkpoint["scaler"]["scale"] == 65536.0
    checkpoint["scaler"]["scale"] = 1024.0
    torch.save(checkpoint, tmp_path / "scaled.pt")
    run_full(tmp_path / "out", *FP16_ACCUM, "--max-steps", "3", "--resume", str(tmp_path / "scaled.pt"))
    resumed = torch.load(tmp_path / "out" / "checkpoints" / "step_000000003.pt", weights_only=True)
    assert resumed["scaler"]["scale"] == 1024.0


@pytest.mark.slow
def test_mid_epoch_resume_with_random_augmentation_is_bitwise(runs, image_tree, tmp_path):
    # Random crops and flips are seeded per sample (SeededSamples): a resumed run crops and flips
    # as the uninterrupted run did, whatever the state of the processes' own generators.
    args = [*IMAGEFOLDER, "--data-dir", str(image_tree)]
    reference = runs.get("imagefolder_w2", "ddp_full.py", args, nproc=2)
    check(launch("ddp_full.py", [*TINY, *args, "--max-steps", "2", "--out-dir", str(tmp_path)], nproc=2))
    result = check(launch("ddp_full.py", [*TINY, *args, "--out-dir", str(tmp_path)], nproc=2))
    assert "step_000000002.pt: step 2 of epoch 1" in result.stdout
    assert_bitwise_equal(reference, tmp_path)


def test_checkpoint_holds_the_unwrapped_model_and_everything_resume_needs(runs):
    reference = runs.get("full_w2", "ddp_full.py", ARGS, nproc=2)
    checkpoints = sorted((reference / "checkpoints").glob("step_*.pt"))
    assert [p.name for p in checkpoints] == ["step_000000012.pt", "step_000000024.pt"]
    checkpoint = torch.load(checkpoints[-1], map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scaler", "epoch", "step_in_epoch", "global_step", "rank_states"} <= checkpoint.keys()
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    assert (checkpoint["epoch"], checkpoint["step_in_epoch"], checkpoint["global_step"]) == (2, 0, 24)
    assert len(checkpoint["rank_states"]) == 2
    final = weights(reference)
    assert all(torch.equal(final[k], checkpoint["model"][k]) for k in final)


def test_a_resume_maps_the_checkpoint_into_memory_rather_than_reading_a_copy_into_each_process(runs):
    # Every process reads the checkpoint it resumes from: read, a node of 8 GPUs holds 8 copies of
    # the model and its optimizer state in host memory at once; memory-mapped, the page cache's one.
    from test_validation import load_script

    reference = runs.get("full_w2", "ddp_full.py", ARGS, nproc=2)
    path = sorted((reference / "checkpoints").glob("step_*.pt"))[-1]
    settings = argparse.Namespace(**torch.load(path, weights_only=True)["config"])  # the run's own
    checkpoint = load_script("ddp_full.py").load_checkpoint(path, settings)
    mapped = [[int(address, 16) for address in line.split()[0].split("-")]
              for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path.resolve()))]
    for name, tensor in checkpoint["model"].items():  # each tensor's bytes lie in the file's mapping
        assert any(start <= tensor.data_ptr() < end for start, end in mapped), (name, mapped)


def test_a_finished_run_started_again_says_so_and_trains_nothing(runs, tmp_path):
    # The Quickstart command run a second time: the newest checkpoint is the last epoch's.
    shutil.copytree(runs.get("full_w2", "ddp_full.py", ARGS, nproc=2), tmp_path / "run")
    result = run_full(tmp_path / "run", *ARGS)
    assert "nothing to train: the run already completed 2 epochs; start afresh in another --out-dir" in result.stdout
    assert "train_loss" not in result.stdout and "step_000000024.pt: step 0 of epoch 3" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_a_run_stopped_by_max_steps_started_again_takes_no_step_more(tmp_path, script):
    # A requeued job runs its command again: --max-steps already reached trains nothing and
    # writes nothing, rather than one step and one checkpoint more at every rerun.
    args = [*TINY, *ARGS, "--max-steps", "2", "--out-dir", str(tmp_path)]
    check(launch(script, args, nproc=2))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").iterdir()}
    again = check(launch(script, args, nproc=2))
    assert "nothing to train: the run already took 2 optimizer steps, --max-steps 2" in again.stdout
    assert [name.split(".")[0] for name in before] == ["step_000000002"]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").iterdir()} == before


@pytest.mark.parametrize("script", ["ddp_full.py", pytest.param("fsdp.py", marks=pytest.mark.slow)])
@pytest.mark.parametrize("start", [0, 8], ids=["afresh", "from-an-older-checkpoint"])
def test_a_run_that_starts_before_its_out_dirs_newest_checkpoint_is_one_clear_error_and_writes_nothing(
        script, start, tmp_path, capsys):
    # One process, in this interpreter. Run A's checkpoints are steps 4, 8 and 12 (4 steps an
    # epoch). Run B, afresh (--resume none) or from A's step 8, would write its own among them, and
    # its restarts (--resume auto) would go on from A's step 12: another run's weights, silently.
    from test_bad_input import assert_one_clear_error, call_main, snapshot

    args = [*TINY, "--train-samples", "64", "--batch-size", "16", "--epochs", "3", "--out-dir", str(tmp_path)]
    assert call_main(script, args, capsys).returncode == 0
    before, name = snapshot(tmp_path), "step_000000012" + (".pt" if script == "ddp_full.py" else "")
    resume = str(tmp_path / "checkpoints" / name.replace("12", "08")) if start else "none"
    result = call_main(script, [*args, "--resume", resume], capsys)
    assert_one_clear_error(result, script, f"{tmp_path / 'checkpoints' / name} is later than this run's start "
                                           f"(step {start}): resume it with --resume auto, or start in another")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_a_task_flag_of_type_path_leaves_checkpoints_a_resume_can_read(script, tmp_path):
    # A user's section may add a flag of type Path; a checkpoint keeps every flag's value, and
    # torch.load(weights_only=True) refuses a pickled Path: every resume would find no usable one.
    copy = tmp_path / script
    text = (ROOT / script).read_text()
    flag = '    parser.add_argument("--notes", type=Path, default=Path("notes"), help="a path")\n'
    copy.write_text(text.replace("def add_task_arguments(parser):\n", "def add_task_arguments(parser):\n" + flag, 1))
    args = [*TINY, "--batch-size", "8", "--epochs", "1", "--notes", str(tmp_path / "n"), "--out-dir", str(tmp_path / "run")]
    check(launch(str(copy), [*args, "--max-steps", "3"], nproc=1))
    resumed = check(launch(str(copy), args, nproc=1))
    assert "resumed from" in resumed.stdout, resumed.stdout


@pytest.mark.parametrize("script", ["ddp_full.py", "lean/ddp_full.py", pytest.param("fsdp.py", marks=pytest.mark.slow),
                                    pytest.param("lean/fsdp.py", marks=pytest.mark.slow)])
def test_a_resume_may_move_the_data_but_not_change_it(script, image_tree, tmp_path, capsys):
    # One process, in this interpreter; 24 images, 6 steps an epoch, the checkpoint of epoch 1 the
    # newest. --data-dir may change on a resume (the data staged elsewhere): the run ends as it would
    # have. Other data may not: the schedule counts epochs, and a resume on half the images went on
    # with the cosine past its end, the rate climbing back to its peak (measured: 0.0225 -> 0.03).
    from test_bad_input import assert_one_clear_error, call_main, snapshot
    from conftest import write_image_tree

    args = [*TINY, *IMAGEFOLDER, "--out-dir", str(tmp_path / "run")]
    assert call_main(script, [*args, "--data-dir", str(image_tree)], capsys).returncode == 0
    shutil.copytree(tmp_path / "run", tmp_path / "straight")
    newest = max((tmp_path / "run" / "checkpoints").iterdir())
    shutil.rmtree(newest) if newest.is_dir() else newest.unlink()
    write_image_tree(tmp_path / "half", {"train": 4, "val": 3})
    before = snapshot(tmp_path / "run")
    result = call_main(script, [*args, "--data-dir", str(tmp_path / "half")], capsys)
    assert_one_clear_error(result, Path(script).name, "is from a run with 24 training samples, this run has 12")
    assert snapshot(tmp_path / "run") == before
    shutil.copytree(image_tree, tmp_path / "moved")
    (tmp_path / "run" / "model.pt").unlink()  # the straight run's: the resume must write its own
    resumed = call_main(script, [*args, "--data-dir", str(tmp_path / "moved")], capsys)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    assert_bitwise_equal(tmp_path / "straight", tmp_path / "run")
