"""Run a ladder script with a counting DDP communication hook.

    COUNT_SCRIPT=ddp_amp_accum.py COUNT_DIR=DIR torchrun ... tests/count_allreduces.py ARGS


The hook wraps PyTorch's own all-reduce hook, so training is unchanged; it counts how often DDP
all-reduces gradients, and each process writes {"reductions": N} to $COUNT_DIR/rank<R>.json at exit.
A gradient sync all-reduces every bucket once; bucket 0 is in every sync, so counting it counts syncs.
"""
import json
import os
import runpy
import sys

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

counts = {"reductions": 0, "bucket_calls": 0}
original_init = DistributedDataParallel.__init__


def counting_hook(state, bucket):
    counts["bucket_calls"] += 1
    if bucket.index() == 0:
        counts["reductions"] += 1
    return default_hooks.allreduce_hook(state, bucket)


def init_with_hook(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self.register_comm_hook(None, counting_hook)


DistributedDataParallel.__init__ = init_with_hook
script = os.environ["COUNT_SCRIPT"]
sys.argv = [script, *sys.argv[1:]]
os.makedirs(os.environ["COUNT_DIR"], exist_ok=True)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    path = os.path.join(os.environ["COUNT_DIR"], f"rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as f:
        json.dump(counts, f)
