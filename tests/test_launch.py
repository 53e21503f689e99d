"""Launch paths and model kinds that the tiny CNN runs elsewhere do not cover."""
import pytest
import torch
import torch.nn.functional as F

from conftest import check, launch, metrics, weights
from test_validation import load_script

pytestmark = pytest.mark.slow  # second tier, as a whole


def test_resnet18_with_batchnorm_validates_on_rank_0_without_hanging(tmp_path):
    # resnet18 has BatchNorm buffers, which DDP broadcasts from rank 0 at every forward through the
    # wrapper: validating on rank 0 alone through the wrapper would wait for ranks that never come.
    # Validation through model.module finishes, and its numbers are the whole set's.
    args = ["--model", "resnet18", "--workers", "0", "--train-samples", "32", "--val-samples", "21",
            "--epochs", "1", "--batch-size", "8", "--out-dir", str(tmp_path)]
    check(launch("ddp_basic.py", args, nproc=2, timeout=180))
    module = load_script("ddp_basic.py")
    images, labels = module.make_synthetic(21, 0, "val", 32).tensors
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(weights(tmp_path))
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(images).double(), labels, reduction="sum").item() / 21
    [record] = metrics(tmp_path)
    assert record["val_samples"] == 21
    assert abs(record["val_loss"] - loss) <= 1e-5 * abs(loss)  # the tolerance of test_validation.py
