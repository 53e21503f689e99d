"""Run a ladder script's main() with a divergence planted, where a real one shows first.

    PROBE_RANK=R PROBE_STEP=N PROBE_LR=X [PROBE_WHAT=loss|weight|overflow] torchrun ... \
        tests/divergence_probe.py SCRIPT ARGS

Only in a run whose --lr is X, and only on rank R (every other process trains on as usual; -1: on
every process, as a real fp16 overflow of the all-reduced gradients is):
- loss: from the N-th optimizer step of this launch on, every loss that process computes is nan;
- weight: right after the N-th optimizer step of this launch, one value of the first parameter is
  nan, and no loss shows it before the next step;
- overflow (fp16): from the N-th optimizer step on, every step's first gradient holds an inf where
  the GradScaler looks for one, as an overflow leaves it (in its shard, under FSDP).
Nothing of the script is changed but this; the script's own code does the work.
"""
import functools
import importlib.util
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
RANK, STEP, WHAT = int(os.environ["PROBE_RANK"]), int(os.environ["PROBE_STEP"]), os.environ.get("PROBE_WHAT", "loss")
LR = float(os.environ["PROBE_LR"])
steps = 0


@functools.cache
def planted():
    rank = dist.get_rank() if dist.is_initialized() else 0  # steps 1-2 start no process group
    return float(module.parse_args(sys.argv[2:]).lr) == LR and RANK in (rank, -1)


def probed_step(step):
    def counting_step(self, *args, **kwargs):
        global steps
        result = step(self, *args, **kwargs)
        steps += 1
        if WHAT == "weight" and steps == STEP and planted():
            param = self.param_groups[0]["params"][0]
            with torch.no_grad():
                (param.to_local() if hasattr(param, "to_local") else param).view(-1)[0] = float("nan")
        return result
    return counting_step


def probed_loss(batch_loss):
    def poisoned(model, batch):
        loss, count = batch_loss(model, batch)
        if WHAT == "loss" and steps + 1 >= STEP and planted():
            loss = loss * float("nan")
        return loss, count
    return poisoned


unscale = torch.amp.GradScaler.unscale_
unscaled = 0


def overflowing_unscale(self, optimizer):
    global unscaled
    unscaled += 1
    if WHAT == "overflow" and unscaled >= STEP and planted():
        grad = optimizer.param_groups[0]["params"][0].grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
    return unscale(self, optimizer)


torch.amp.GradScaler.unscale_ = overflowing_unscale
for optimizer in (torch.optim.SGD, torch.optim.AdamW):
    optimizer.step = probed_step(optimizer.step)
module.batch_loss = probed_loss(module.batch_loss)
sys.exit(module.main(sys.argv[2:]))
