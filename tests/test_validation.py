"""Validation reports the metrics of the whole validation set, whatever the number of processes.

The reference is computed here, in one process, from the saved weights: the mean loss and the
accuracy over all VAL_SAMPLES samples in float64. 103 samples do not divide by 2 processes, so a
DistributedSampler would pad them to 104 and count one sample twice; a mean of per-batch or
per-process means would weight samples unequally.

Tolerance. The scripts evaluate in batches of 8 per process, the reference in one batch of 103;
per-sample losses then differ only in float32 rounding (measured: relative difference < 1e-7).
VAL_LOSS_RTOL = 1e-5. Counts of samples are integers and must be equal; so must counts of correct
predictions, but for a sample whose two highest logits lie within TIE_ATOL of each other: other
batch sizes round its logits otherwise (by about 1e-6 here, logits below 10 in size), and a tie
can go either way on another CPU. Such samples are counted (`ties`), and the count may differ by
at most that many; none of the evaluations here has had one. Every pitfall of validation moves
the loss by far more than 1e-5 or a count by a sample with no tie.
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, VAL_SAMPLES, metrics, weights

VAL_LOSS_RTOL = 1e-5
TIE_ATOL = 1e-4


def assert_counts_correct(val_acc, logits, labels):
    """val_acc (a script's, over len(labels) samples) counts the predictions the logits get right,
    give or take the samples whose two highest logits are a tie to rounding."""
    top_two = logits.topk(2, dim=1).values
    ties = (top_two[:, 0] - top_two[:, 1] <= TIE_ATOL).sum().item()
    correct = (logits.argmax(dim=1) == labels).sum().item()
    reported = round(val_acc * len(labels))
    assert abs(reported - correct) <= ties, f"{reported} correct where the logits give {correct} ({ties} ties)"


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts run nothing at import
    return module


def reference_logits(script, model_file, samples=VAL_SAMPLES):
    """The CNN of model_file on the script's first `samples` validation samples, in one batch of
    one process: (logits, labels)."""
    module = load_script(script)
    images, labels = module.make_synthetic(samples, 0, "val", 32).tensors
    model = module.SmallCNN(module.NUM_SYNTHETIC_CLASSES)
    model.load_state_dict(torch.load(model_file, map_location="cpu", weights_only=True))
    model.eval()
    with torch.no_grad():
        return model(images), labels


def assert_matches_reference(script, out_dir):
    """The last record of metrics.jsonl scores model.pt as one process does."""
    record = metrics(out_dir)[-1]
    logits, labels = reference_logits(script, out_dir / "model.pt")
    assert record["val_samples"] == VAL_SAMPLES
    assert_counts_correct(record["val_acc"], logits, labels)
    loss = F.cross_entropy(logits.double(), labels, reduction="sum").item() / VAL_SAMPLES
    assert record["val_loss"] == pytest.approx(loss, rel=VAL_LOSS_RTOL), (record, loss)


def test_ddp_full_sharded_validation_equals_one_process_evaluation(runs):
    out_dir = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)
    assert_matches_reference("ddp_full.py", out_dir)


def test_ddp_basic_rank0_validation_equals_one_process_evaluation(runs):
    out_dir = runs.get("basic_w2", "ddp_basic.py", ["--batch-size", "8"], nproc=2)
    assert_matches_reference("ddp_basic.py", out_dir)


# resnet18 has BatchNorm: after the last step each process holds running statistics of its own
# micro-batches. 48 training samples in batches of 8 (2 or 3 processes), 23 validation samples,
# which neither 2 nor 3 divides. Scored in batches of 8 against one batch of 23, the losses differ in float rounding only (VAL_LOSS_RTOL holds); each shard scored with its
# own process's running statistics moved the loss by 6e-3 (2 processes) and 5e-3 (3), relative.
BATCHNORM = ["--model", "resnet18", "--workers", "0", "--train-samples", "48", "--val-samples", "23",
             "--epochs", "1", "--batch-size", "8", "--log-interval", "1000"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_validation_with_batchnorm_scores_the_saved_model(runs, nproc):
    import torchvision

    out_dir = runs.get(f"full_bn_w{nproc}", "ddp_full.py", BATCHNORM, nproc=nproc)
    images, labels = load_script("ddp_full.py").make_synthetic(23, 0, "val", 32).tensors
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(weights(out_dir))
    model.eval()
    with torch.no_grad():
        logits = model(images).double()
    [record] = metrics(out_dir)
    assert record["val_samples"] == 23
    assert_counts_correct(record["val_acc"], logits, labels)
    loss = F.cross_entropy(logits, labels, reduction="sum").item() / 23
    assert record["val_loss"] == pytest.approx(loss, rel=VAL_LOSS_RTOL), record
