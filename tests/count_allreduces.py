"""Run a ladder script with a counting DDP communication hook, count FSDP's all-reduces across
replicas (HSDP), and count what torch.compile did.

    COUNT_SCRIPT=ddp_amp_accum.py COUNT_DIR=DIR torchrun ... tests/count_allreduces.py ARGS


The hook wraps PyTorch's own all-reduce hook, so training is unchanged; it counts how often DDP
all-reduces gradients. A gradient sync all-reduces every bucket once; bucket 0 is in every sync, so
counting it counts syncs. A hook the script registers itself (ddp_full.py's --grad-compression) runs
inside the counting one, in place of PyTorch's all-reduce hook; "bytes_sent" sums the sizes of the
tensors the hooks all-reduce (torch's default_hooks module). FSDP all-reduces gradients only across the replicas of HSDP, from its
collectives module (torch.distributed.fsdp._fully_shard._fsdp_collectives, through
torch.distributed.all_reduce): each such call, one per unit and backward, is counted in
"fsdp_all_reduces". With --compile, dynamo's own counters of this process say how many graphs
it captured, how often it broke a graph (a graph break: code it could not trace, run eagerly between
two graphs) and why it compiled again (a recompile). Each process writes
{"reductions": N, "bucket_calls": N, "bytes_sent": N, "fsdp_all_reduces": N, "graphs": N, "graph_breaks": N,
"frames_skipped": N, "recompiles": [reason, ...]} to
$COUNT_DIR/rank<R>.json at exit.
"""
import json
import os
import runpy
import sys

import torch._dynamo.utils as dynamo_utils
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

counts = {"reductions": 0, "bucket_calls": 0, "bytes_sent": 0, "fsdp_all_reduces": 0}
original_init = DistributedDataParallel.__init__
original_register = DistributedDataParallel.register_comm_hook
original_all_reduce = dist.all_reduce


def counting_hook(model, bucket):
    counts["bucket_calls"] += 1
    if bucket.index() == 0:
        counts["reductions"] += 1
    return model.hook_counted(model.hook_state, bucket)


def init_with_hook(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self.hook_counted, self.hook_state = default_hooks.allreduce_hook, None
    original_register(self, self, counting_hook)


def register_counted(self, state, hook):
    """The script's own hook, run by the counting one (DDP takes one hook only)."""
    self.hook_counted, self.hook_state = hook, state


def counting_all_reduce(tensor, *args, **kwargs):
    caller = sys._getframe(1).f_code.co_filename
    if caller.endswith("_fsdp_collectives.py"):
        counts["fsdp_all_reduces"] += 1
    if caller.endswith("default_hooks.py"):
        counts["bytes_sent"] += tensor.numel() * tensor.element_size()
    return original_all_reduce(tensor, *args, **kwargs)


DistributedDataParallel.__init__ = init_with_hook
DistributedDataParallel.register_comm_hook = register_counted
dist.all_reduce = counting_all_reduce
script = os.environ["COUNT_SCRIPT"]
sys.argv = [script, *sys.argv[1:]]
os.makedirs(os.environ["COUNT_DIR"], exist_ok=True)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    # unique_graphs grows only when dynamo hands a captured graph to its backend (torch 2.14's
    # output_graph.py); the compilation metrics keep each frame's recompile reason.
    counts["graphs"] = dynamo_utils.counters["stats"]["unique_graphs"]
    # Breaks dynamo resumed after, and those it could not (it then ran the whole frame eagerly).
    counts["graph_breaks"] = sum(dynamo_utils.counters["graph_break"].values()) + \
        sum(dynamo_utils.counters["unimplemented"].values())
    counts["frames_skipped"] = dynamo_utils.counters["frames"]["total"] - dynamo_utils.counters["frames"]["ok"]
    counts["recompiles"] = [m.recompile_reason for m in dynamo_utils.get_compilation_metrics()
                            if m.recompile_reason]
    path = os.path.join(os.environ["COUNT_DIR"], f"rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as f:
        json.dump(counts, f)
