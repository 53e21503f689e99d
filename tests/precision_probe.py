"""Run a ladder script's main() and record the precision its matrix work ran in.

    PROBE_DIR=DIR python tests/precision_probe.py SCRIPT ARGS     (or under torchrun)

Each process writes DIR/precision_r<R>.json: for training (train_one_epoch) and validation
(evaluate), the convolutions and matrix products (aten.convolution, mm, addmm, bmm, baddbmm) that
ran, counted by the dtype of their output. Under autocast they are the operations it casts, seen
after its casts; under FSDP's policy, with the parameters as it gathered them. Nothing of the
script is changed but these records; the script's own code does the work.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# LADDER_ROOT: another copy of the scripts, as in conftest.py (the mutation check's).
ROOT = Path(os.environ.get("LADDER_ROOT") or Path(__file__).resolve().parent.parent)
MATRIX_OPS = {"convolution", "mm", "addmm", "bmm", "baddbmm"}

script = sys.argv[1]
spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)  # defines everything, runs nothing
counts = {"train": {}, "validation": {}}


class CountingMatrixOps(TorchDispatchMode):
    def __init__(self, phase):
        super().__init__()
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATRIX_OPS and isinstance(out, torch.Tensor):
            key = str(out.dtype).removeprefix("torch.")
            counts[self.phase][key] = counts[self.phase].get(key, 0) + 1
        return out


def counted(function, phase):
    def run(*args, **kwargs):
        with CountingMatrixOps(phase):
            result = function(*args, **kwargs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        (Path(os.environ["PROBE_DIR"]) / f"precision_r{rank}.json").write_text(json.dumps(counts))
        return result
    return run


module.train_one_epoch = counted(module.train_one_epoch, "train")
module.evaluate = counted(module.evaluate, "validation")
sys.exit(module.main(sys.argv[2:]))
