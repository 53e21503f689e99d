"""Run a ladder script's main() with fp16's first optimizer step overflowing, and record the scale.

    PROBE_DIR=DIR torchrun ... tests/overflow_probe.py SCRIPT ARGS --amp fp16

At the first optimizer step, before the GradScaler looks for an overflow, an inf is planted in the
first parameter's gradient on every process (in its shard, under FSDP), where an fp16 overflow
leaves one; each process writes DIR/scales_r<R>.json, the scale after each step. Nothing of the
script is changed but this; the script's own code does the work.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# LADDER_ROOT: another copy of the scripts, as in conftest.py (the mutation check's).
ROOT = Path(os.environ.get("LADDER_ROOT") or Path(__file__).resolve().parent.parent)
script = sys.argv[1]
spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)  # defines everything, runs nothing
unscale, update = torch.amp.GradScaler.unscale_, torch.amp.GradScaler.update
scales = []


def planting_unscale(self, optimizer):
    if not scales:
        grad = optimizer.param_groups[0]["params"][0].grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
    return unscale(self, optimizer)


def recording_update(self, *args, **kwargs):
    update(self, *args, **kwargs)
    scales.append(self.get_scale())
    (Path(os.environ["PROBE_DIR"]) / f"scales_r{dist.get_rank()}.json").write_text(json.dumps(scales))


torch.amp.GradScaler.unscale_, torch.amp.GradScaler.update = planting_unscale, recording_update
sys.exit(module.main(sys.argv[2:]))
