"""Bad input ends in one clear line on stderr and a non-zero exit, and loses nothing.

Cases that need no second process launch the script as a world of one (`python script.py`, quicker).
Each case runs against a copy of a finished ddp_full run's output directory (checkpoints,
model.pt, metrics.jsonl) where the script has one: after the failed launch every file is
byte-for-byte what it was, and no file was added.
"""
import hashlib
import shutil
import subprocess

import pytest
import torch

from conftest import TINY, launch, script_traceback
from test_validation import load_script

SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]
MAPPED = ["ddp_full.py", "fsdp.py"]  # the scripts with the machinery of long runs, the model check among it


def snapshot(directory):
    return {p.relative_to(directory): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_one_clear_error(result, script, expected):
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if f"{script}: error:" in line]
    assert len(errors) == 1, result.stderr
    assert expected in errors[0], errors[0]
    assert not script_traceback(result, script), result.stderr


@pytest.fixture
def finished_run(runs, tmp_path):
    """A copy of a finished 2-process ddp_full run: a good checkpoint that nothing may touch."""
    source = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)
    shutil.copytree(source, tmp_path / "run")
    return tmp_path / "run"


def call_main(script, argv, capsys):
    """Argument checks run before any process group or data: main() itself, in this process (quicker
    than a launch; the exit status is main's return value, as `sys.exit(main())` passes it on)."""
    status = load_script(script).main(argv)
    return subprocess.CompletedProcess([script, *argv], status, *capsys.readouterr())


@pytest.mark.parametrize("script", SCRIPTS)
def test_batch_size_zero_is_one_clear_error(script, tmp_path, capsys):
    result = call_main(script, [*TINY, "--batch-size", "0", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, script, "--batch-size must be at least 1, got 0")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_learning_rate_that_is_not_a_finite_number_is_one_clear_error(script, value, tmp_path, capsys):
    # nan passes `<= 0` unnoticed: a run would train to nan weights, overwrite model.pt and exit 0.
    result = call_main(script, [*TINY, "--lr", value, "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, script, f"--lr must be a finite number, got {value}")


@pytest.mark.parametrize("script", ["ddp_amp_accum.py", "ddp_full.py"])
def test_accum_steps_zero_is_one_clear_error(script, tmp_path, capsys):
    result = call_main(script, [*TINY, "--accum-steps", "0", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, script, "--accum-steps must be at least 1, got 0")


@pytest.mark.parametrize("script, value", [("ddp_amp_accum.py", "-1"), ("ddp_full.py", "-1"), ("fsdp.py", "-1"),
                                           ("ddp_amp_accum.py", "0")])
def test_a_negative_accum_steps_is_one_clear_error_in_the_lean_copy_too(script, value, tmp_path):
    # The lean copy has no value checks: train() checks --accum-steps where it meets it. A negative
    # count never ends a group of micro-batches: the run took no optimizer step, printed its epochs
    # and saved its initial weights with exit 0 (measured on lean/ddp_amp_accum.py: 8 of 8 tensors);
    # 0 was a ZeroDivisionError's traceback.
    result = launch(f"lean/{script}", [*TINY, "--accum-steps", value, "--out-dir", str(tmp_path / "out")])
    assert_one_clear_error(result, script, f"--accum-steps must be at least 1, got {value}")
    assert not (tmp_path / "out").exists()


def test_bucket_cap_mb_zero_is_one_clear_error(tmp_path, capsys):
    result = call_main("ddp_full.py", [*TINY, "--bucket-cap-mb", "0", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, "ddp_full.py", "--bucket-cap-mb must be positive, got 0.0")


def test_dataparallel_with_fewer_training_samples_than_a_batch_is_one_clear_error(tmp_path, capsys):
    # DataParallel drops the short last batch: an epoch of 32 samples in batches of 64 has none.
    result = call_main("dataparallel.py", [*TINY, "--train-samples", "32", "--batch-size", "64", "--out-dir",
                                           str(tmp_path)], capsys)
    assert_one_clear_error(result, "dataparallel.py", "--batch-size 64 is more than the 32 training samples")


def test_dataparallel_compile_over_several_gpus_is_one_clear_error(tmp_path, capsys, monkeypatch):
    # CPU stand-in for 2 GPUs: the check reads torch.cuda.device_count() alone.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = call_main("dataparallel.py", [*TINY, "--compile", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, "dataparallel.py", "--compile does not work with DataParallel over several GPUs")


def blocked_out_dir(tmp_path):
    """An --out-dir that cannot be created: a file stands where its parent directory should be.

    (The tests run as root on CI, where a read-only directory is still writable; a file in the way
    fails the same check for every user.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    return blocker / "out"


@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py"])
def test_out_dir_that_cannot_be_written_is_one_clear_error_before_training(script, tmp_path, capsys):
    out_dir = blocked_out_dir(tmp_path)
    result = call_main(script, [*TINY, "--out-dir", str(out_dir)], capsys)
    assert_one_clear_error(result, script, f"cannot write to --out-dir {out_dir}: Not a directory")
    assert "epoch" not in result.stdout  # it stopped before training, not after
    assert out_dir.parent.read_text() == "keep me"


def test_out_dir_that_cannot_be_written_stops_every_rank_with_one_line_from_rank_0(tmp_path):
    out_dir = blocked_out_dir(tmp_path)
    result = launch("ddp_full.py", [*TINY, "--out-dir", str(out_dir)], nproc=2)
    assert_one_clear_error(result, "ddp_full.py", f"cannot write to --out-dir {out_dir}: Not a directory")
    assert "epoch" not in result.stdout
    assert out_dir.parent.read_text() == "keep me"


def test_bad_argument_under_torchrun_is_one_line_from_rank_0_and_a_failed_launch(finished_run):
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--batch-size", "0", "--out-dir", str(finished_run)], nproc=2)
    assert_one_clear_error(result, "ddp_full.py", "--batch-size must be at least 1, got 0")
    assert snapshot(finished_run) == before


def test_nccl_without_cuda_is_one_clear_error(tmp_path):
    result = launch("ddp_basic.py", [*TINY, "--backend", "nccl", "--out-dir", str(tmp_path)])
    assert_one_clear_error(result, "ddp_basic.py", "--backend nccl needs CUDA GPUs")


@pytest.mark.slow
def test_more_processes_than_training_samples_is_one_clear_error(finished_run):
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--train-samples", "1", "--resume", "none", "--out-dir", str(finished_run)],
                    nproc=2)
    assert_one_clear_error(result, "ddp_full.py", "2 processes but only 1 training samples")
    assert snapshot(finished_run) == before


def test_missing_image_directory_is_one_clear_error(finished_run, tmp_path):
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--data", "imagefolder", "--data-dir", str(tmp_path / "nowhere"),
                                    "--out-dir", str(finished_run)], nproc=2)  # rank 0 finds it, both stop
    assert_one_clear_error(result, "ddp_full.py", f"no imagefolder data in '{tmp_path / 'nowhere'}': [Errno 2] "
                                                  "No such file or directory")
    assert snapshot(finished_run) == before


def test_empty_image_directory_is_one_clear_error(tmp_path):
    for split in ("train", "val"):
        (tmp_path / "images" / split).mkdir(parents=True)
    result = launch("ddp_basic.py", [*TINY, "--data", "imagefolder", "--data-dir", str(tmp_path / "images"),
                                     "--out-dir", str(tmp_path / "out")])
    assert_one_clear_error(result, "ddp_basic.py", "no imagefolder data in")
    assert "Couldn't find any class folder" in result.stderr


def test_missing_cifar10_without_download_is_one_clear_error(tmp_path):
    result = launch("single_gpu.py", [*TINY, "--data", "cifar10", "--data-dir", str(tmp_path),
                                      "--out-dir", str(tmp_path / "out")])
    assert_one_clear_error(result, "single_gpu.py", "add --download")


def test_resume_of_a_missing_checkpoint_is_one_clear_error(finished_run):
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--batch-size", "8", "--resume", str(finished_run / "nope.pt"),
                                    "--out-dir", str(finished_run)])
    assert_one_clear_error(result, "ddp_full.py",
                           f"checkpoint {finished_run / 'nope.pt'} cannot be read: FileNotFoundError")
    assert snapshot(finished_run) == before


# A write cut short leaves half a file, or none of it (a full disk): either is its own error, not
# torch's advice that only a zip file can be memory-mapped (the checkpoint is mapped only if zip).
@pytest.mark.parametrize("kept, reason", [(0.5, "failed finding central directory"), (0, "EOFError")])
def test_resume_of_a_truncated_checkpoint_is_one_clear_error_naming_it(kept, reason, finished_run, tmp_path):
    good = finished_run / "checkpoints" / "step_000000024.pt"
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good.read_bytes()[: int(good.stat().st_size * kept)])
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--batch-size", "8", "--resume", str(bad),
                                    "--out-dir", str(finished_run)])
    assert_one_clear_error(result, "ddp_full.py", f"checkpoint {bad} cannot be read: ")
    assert reason in result.stderr and "mmap" not in result.stderr, result.stderr
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("content", [b"hello\n", b"\x80\x02}q\x00.", b"PK\x03\x04"], ids=["text", "pickle", "zip"])
def test_resume_of_a_file_torch_save_did_not_write_is_one_clear_error_naming_it(content, tmp_path, capsys):
    # torch.load of such a file raises whatever its bytes lead to (KeyError, IndexError, struct.error...).
    bad = tmp_path / "not_a_checkpoint.pt"
    bad.write_bytes(content)
    result = call_main("ddp_full.py", [*TINY, "--resume", str(bad), "--out-dir", str(tmp_path / "out")], capsys)
    assert_one_clear_error(result, "ddp_full.py", f"checkpoint {bad} cannot be read")


def test_resume_of_a_checkpoint_for_another_architecture_is_one_clear_error(finished_run, tmp_path):
    import torch

    checkpoint = torch.load(finished_run / "checkpoints" / "step_000000024.pt", weights_only=True)
    checkpoint["model"]["classifier.weight"] = torch.zeros(10, 128)  # a wider last layer
    # Launched as a world of one (quicker): the checkpoint says so, leaving the model as the misfit.
    checkpoint["world_size"], checkpoint["rank_states"] = 1, checkpoint["rank_states"][:1]
    torch.save(checkpoint, tmp_path / "other.pt")
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--batch-size", "8", "--resume", str(tmp_path / "other.pt"),
                                    "--out-dir", str(finished_run)])
    assert_one_clear_error(result, "ddp_full.py", "does not fit this model: Error(s) in loading state_dict")
    assert snapshot(finished_run) == before


def _without_epoch_position(checkpoint):  # before checkpoints held the position over all processes
    del checkpoint["epoch_position"]


def _with_loader_rng(checkpoint):  # before 7467b91 each process's states held its loader's generator
    for states in checkpoint["rank_states"]:
        states["loader_rng"] = torch.get_rng_state()


def _without_config(checkpoint):  # a dict that holds the training state but not the settings
    del checkpoint["config"]


@pytest.mark.parametrize("change", [_without_epoch_position, _with_loader_rng, _without_config],
                         ids=["without-epoch-position", "with-loader-rng", "without-config"])
def test_resume_of_a_checkpoint_from_an_older_version_is_one_clear_error(change, finished_run, tmp_path, capsys):
    # Not a KeyError or a TypeError midway through the restore.
    checkpoint = torch.load(finished_run / "checkpoints" / "step_000000024.pt", weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, tmp_path / "old.pt")
    result = call_main("ddp_full.py", [*TINY, "--batch-size", "8", "--resume", str(tmp_path / "old.pt"),
                                       "--out-dir", str(finished_run)], capsys)
    assert_one_clear_error(result, "ddp_full.py", "was not written by this script (or this version)")


def test_resume_with_other_settings_is_one_clear_error(finished_run):
    before = snapshot(finished_run)
    result = launch("ddp_full.py", [*TINY, "--batch-size", "4", "--epochs", "3",
                                    "--resume", str(finished_run / "checkpoints" / "step_000000024.pt"),
                                    "--out-dir", str(finished_run)])
    assert_one_clear_error(result, "ddp_full.py", "is from a run with --batch-size 8, this run has 4")
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("script", ["ddp_amp_accum.py", "ddp_full.py", "fsdp.py"])
@pytest.mark.parametrize("size, steps", [("100", "12.5"), ("0", "0")])
def test_a_global_batch_size_the_processes_cannot_make_is_one_clear_error(script, size, steps, tmp_path, capsys):
    result = call_main(script, [*TINY, "--batch-size", "8", "--global-batch-size", size, "--out-dir", str(tmp_path)],
                       capsys)
    assert_one_clear_error(result, script, f"--global-batch-size {size} / (--batch-size 8 x 1 processes) = {steps} "
                                           "accumulation steps: must be a whole number >= 1")


@pytest.mark.parametrize("script", ["ddp_amp_accum.py", "ddp_full.py", "fsdp.py"])
def test_accum_steps_that_disagree_with_the_global_batch_size_are_one_clear_error(script, tmp_path, capsys):
    args = ["--batch-size", "8", "--global-batch-size", "32", "--accum-steps", "2", "--out-dir", str(tmp_path)]
    result = call_main(script, [*TINY, *args], capsys)
    assert_one_clear_error(result, script, "= 4 accumulation steps: must be a whole number >= 1, and "
                                           "--accum-steps, if given, equal")


def test_sync_bn_without_cuda_is_one_clear_error(tmp_path, capsys):
    # SyncBatchNorm raises "SyncBatchNorm layers only work with GPU modules" inside DDP on a CPU.
    result = call_main("ddp_full.py", [*TINY, "--sync-bn", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, "ddp_full.py", "--sync-bn needs CUDA GPUs")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("script", ["ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"])
def test_timeout_min_zero_is_one_clear_error(script, tmp_path, capsys):
    result = call_main(script, [*TINY, "--timeout-min", "0", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, script, "--timeout-min must be positive, got 0.0")


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_model_is_one_clear_error_saying_how_to_list_the_names(script, tmp_path, capsys):
    result = call_main(script, [*TINY, "--model", "resnet19", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, script, "unknown --model 'resnet19': cnn or a torchvision "
                                           "classification model; list them with: python -c")


def test_a_model_that_does_not_fit_the_images_is_one_clear_error(tmp_path):
    # torchvision's ViT is built for 224-pixel images; the synthetic data is 32 pixels.
    result = launch("ddp_full.py", [*TINY, "--model", "vit_b_16", "--out-dir", str(tmp_path)])
    assert_one_clear_error(result, "ddp_full.py", "the model does not fit the data: "
                                                  "Wrong image height! Expected 224 but got 32!")
    assert "epoch" not in result.stdout


# resnet18 fed 32-pixel images ends in a 1x1 feature map: a training batch of 1 sample gives its last
# BatchNorm one value per channel, which it cannot normalise (a ValueError in the forward).
BATCHNORM_OF_ONE = ["--model", "resnet18", "--val-samples", "8", "--epochs", "1"]
BATCH_OF_ONE = "Expected more than 1 value per channel when training"


@pytest.mark.parametrize("script", MAPPED)
def test_batchnorm_given_training_batches_of_one_is_one_clear_error_before_training(script, tmp_path):
    result = launch(script, [*TINY, *BATCHNORM_OF_ONE, "--batch-size", "1", "--out-dir", str(tmp_path)])
    assert_one_clear_error(result, script, f"the model does not fit the data: {BATCH_OF_ONE}")
    assert "(a training batch of 1: try another --batch-size)" in result.stderr
    assert "epoch" not in result.stdout


def test_an_epochs_last_batch_of_one_sample_per_process_is_found_before_training(tmp_path):
    # 17 samples over 2 processes: 9 each (the sampler pads), in batches of 4, 4 and 1. Found
    # after a whole epoch's work, it was a traceback from every process.
    result = launch("ddp_full.py", [*TINY, *BATCHNORM_OF_ONE, "--train-samples", "17", "--batch-size", "4",
                                    "--out-dir", str(tmp_path)], nproc=2)
    assert_one_clear_error(result, "ddp_full.py", f"the model does not fit the data: {BATCH_OF_ONE}")
    assert ("(a training batch of 1, the last of 9 samples per process in batches of 4: try another "
            "--batch-size)") in result.stderr
    assert "epoch" not in result.stdout


def test_a_model_whose_training_output_the_loss_cannot_take_is_one_clear_error_naming_training_mode(tmp_path):
    # googlenet returns its auxiliary outputs too in training (a namedtuple), which cross_entropy cannot
    # take: the batch is not the cause, and the line sent its user to --batch-size (a fresh reader).
    result = launch("ddp_full.py", [*TINY, "--model", "googlenet", "--out-dir", str(tmp_path)])
    assert_one_clear_error(result, "ddp_full.py", "the model does not fit the data: ")
    assert "not GoogLeNetOutputs (in training mode)" in result.stderr
    assert "--batch-size" not in result.stderr


def reads_values_as_it_is_built(args, num_outputs):
    """A build_model whose model reads a tensor's value in __init__: on the meta device it cannot."""
    import torch

    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.ones(1).item()
            self.linear = torch.nn.Linear(3 * 32 * 32, num_outputs)

        def forward(self, images):
            return self.linear(images.flatten(1)) * self.scale

    return ReadsValues()


@pytest.mark.parametrize("script", MAPPED)
def test_the_model_check_gives_no_verdict_on_a_model_that_reads_values_as_it_is_built(script):
    # The check builds the model on the meta device, where a tensor has no value to read: such a
    # model is not bad input (the DDP scripts train it; fsdp.py's own line is in test_fsdp.py).
    module = load_script(script)
    module.build_model = reads_values_as_it_is_built
    args = module.parse_args(TINY)
    train_set, val_set, num_outputs = module.build_datasets(args)
    assert module.check_model_fits(args, num_outputs, train_set, val_set, 1) is None


def counts_its_samples_by_value(model, batch):
    """A batch_loss that reads a tensor's value (a language model counting its non-padding tokens)."""
    images, labels = batch
    return torch.nn.functional.cross_entropy(model(images), labels), int((labels >= 0).sum())


@pytest.mark.parametrize("script", MAPPED)
def test_the_model_check_gives_no_verdict_on_a_loss_that_reads_values(script):
    # On the meta device a tensor has no value: "Tensor.item() cannot be called on meta tensors" is
    # the check's limit, not the user's mistake, and must not stop a task that trains.
    module = load_script(script)
    module.batch_loss = counts_its_samples_by_value
    args = module.parse_args(TINY)
    train_set, val_set, num_outputs = module.build_datasets(args)
    assert module.check_model_fits(args, num_outputs, train_set, val_set, 1) is None


@pytest.mark.parametrize("flag", ["--train-samples", "--image-size"])
def test_a_data_size_of_zero_is_one_clear_error(flag, tmp_path, capsys):
    result = call_main("single_gpu.py", [*TINY, flag, "0", "--out-dir", str(tmp_path)], capsys)
    assert_one_clear_error(result, "single_gpu.py", f"{flag} must be at least 1")
