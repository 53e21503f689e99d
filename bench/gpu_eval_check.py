"""Score a ddp_full.py run's model.pt on its validation set in this one process, and compare with
the validation the run reported (metrics.jsonl, last epoch): the GPU side of
tests/test_validation.py's BatchNorm test (resnet18, sharded validation with rank 0's buffers).

    python bench/gpu_eval_check.py OUT_DIR --val-samples N [--model resnet18] [--image-size 32]

Exit status 1 when the sample or correct counts differ, or the loss differs by more than 1e-3
relative: the scripts score in batches of 128 on two GPUs, this in batches of 100 on one, with
cuDNN free to pick other kernels for other shapes -- float rounding, far below 1e-3 -- while a shard
scored with another process's running statistics moved the loss by 5e-3 on CPU.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_full import make_synthetic  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--val-samples", type=int, required=True)
parser.add_argument("--model", default="resnet18")
parser.add_argument("--image-size", type=int, default=32)
args = parser.parse_args()
import torchvision  # noqa: E402

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = torchvision.models.get_model(args.model, num_classes=10)
model.load_state_dict(torch.load(Path(args.out_dir) / "model.pt", map_location="cpu", weights_only=True))
model = model.to(device, memory_format=torch.channels_last).eval()
images, labels = make_synthetic(args.val_samples, 0, "val", args.image_size).tensors
loss = correct = 0.0
with torch.no_grad():
    for i in range(0, len(labels), 100):
        x = images[i:i + 100].to(device, memory_format=torch.channels_last)
        y = labels[i:i + 100].to(device)
        logits = model(x).double()
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
reported = [json.loads(line) for line in (Path(args.out_dir) / "metrics.jsonl").read_text().splitlines()][-1]
expected = {"val_samples": len(labels), "correct": correct, "val_loss": loss / len(labels)}
print("reported", reported, "\none process", expected)
ok = (reported["val_samples"] == len(labels) and round(reported["val_acc"] * len(labels)) == correct
      and abs(reported["val_loss"] - expected["val_loss"]) <= 1e-3 * abs(expected["val_loss"]))
sys.exit(0 if ok else 1)
