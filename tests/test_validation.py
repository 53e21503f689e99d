"""Validation reports the metrics of the whole validation set, whatever the number of processes.

The reference is computed here, in one process, from the saved weights: the mean loss and the
accuracy over all VAL_SAMPLES samples in float64. 103 samples do not divide by 2 processes, so a
DistributedSampler would pad them to 104 and count one sample twice; a mean of per-batch or
per-process means would weight samples unequally.

Tolerance. The scripts evaluate in batches of 8 per process, the reference in one batch of 103;
per-sample losses then differ only in float32 rounding (measured: relative difference < 1e-7).
VAL_LOSS_RTOL = 1e-5. Counts (samples, correct predictions) are integers and must be equal.
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, TINY, VAL_SAMPLES, metrics, weights

VAL_LOSS_RTOL = 1e-5


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts run nothing at import
    return module


def reference_metrics(script, out_dir):
    module = load_script(script)
    images, labels = module.make_synthetic(VAL_SAMPLES, 0, "val").tensors
    model = module.SmallCNN(module.NUM_SYNTHETIC_CLASSES)
    model.load_state_dict(weights(out_dir))
    model.eval()
    with torch.no_grad():
        logits = model(images)
    loss = F.cross_entropy(logits.double(), labels, reduction="sum").item()
    correct = (logits.argmax(dim=1) == labels).sum().item()
    return {"val_loss": loss / VAL_SAMPLES, "val_acc": correct / VAL_SAMPLES, "val_samples": VAL_SAMPLES}


def assert_matches_reference(script, out_dir):
    last = metrics(out_dir)[-1]
    expected = reference_metrics(script, out_dir)
    assert last["val_samples"] == expected["val_samples"]
    assert round(last["val_acc"] * VAL_SAMPLES) == round(expected["val_acc"] * VAL_SAMPLES), (last, expected)
    assert last["val_loss"] == pytest.approx(expected["val_loss"], rel=VAL_LOSS_RTOL), (last, expected)


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


@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_validation_with_batchnorm_scores_the_saved_model(runs, nproc):
    import torchvision

    out_dir = runs.get(f"full_bn_w{nproc}", "ddp_full.py", BATCHNORM, nproc=nproc)
    images, labels = load_script("ddp_full.py").make_synthetic(23, 0, "val").tensors
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(weights(out_dir))
    model.eval()
    with torch.no_grad():
        logits = model(images).double()
    [record] = metrics(out_dir)
    assert record["val_samples"] == 23
    assert round(record["val_acc"] * 23) == (logits.argmax(dim=1) == labels).sum().item(), record
    loss = F.cross_entropy(logits, labels, reduction="sum").item() / 23
    assert record["val_loss"] == pytest.approx(loss, rel=VAL_LOSS_RTOL), record
