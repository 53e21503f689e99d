"""What one process holds, and how long a step takes, in ddp_full.py and fsdp.py on the same model.

    torchrun --standalone --nproc_per_node=2 bench/fsdp_memory.py --script fsdp.py --model resnet18

Builds the model, the wrapping (DDP, or fsdp.py's shard_model) and the optimizer with the script's
own functions, then times training steps on one synthetic batch (data loading left out) and counts
the bytes of this process's parameters, gradients and optimizer state. Gradients are counted after
every backward, the most held: p.grad, and for FSDP
with --skip-reduce also the unsharded gradients it accumulates between micro-batches (FSDP's own
attributes, not visible in p.grad). DDP's gradient buckets (one more gradient-sized buffer, unless
--gradient-as-bucket-view) are not counted. Activations: the bytes a forward leaves saved for its
backward (autograd's saved tensors, each storage once, parameters left out); with fsdp.py's
--activation-checkpointing, what the blocks keep (their inputs) and what lies outside them.
Prints one line: BENCH {json}.
"""
import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def nbytes(tensors):
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def accumulated_unsharded(model):
    """FSDP's unsharded gradients held between micro-batches when reduction is skipped."""
    held = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for param in (group.fsdp_params if group else []):
            # bf16 gradients are held upcast to float32 here; float32 ones stay on the unsharded
            # parameter, which FSDP keeps apart from the sharded one p.grad belongs to.
            held.append(getattr(param, "unsharded_accumulated_grad", None))
            unsharded = getattr(param, "_unsharded_param", None)
            held.append(None if unsharded is None else unsharded.grad)
    return held


def counting_saved_tensors(counted):
    """Count into counted[0] the bytes of each storage saved for backward, once, parameters left out."""
    seen = set()

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                counted[0] += storage.nbytes()
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", choices=["ddp_full.py", "fsdp.py"], required=True)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-reduce", action="store_true",
                        help="fsdp: set_requires_gradient_sync(False) on all but the last micro-batch")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="fsdp: recompute each block's forward in its backward")
    bench = parser.parse_args()
    spec = importlib.util.spec_from_file_location("script", ROOT / bench.script)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(["--model", bench.model, "--optimizer", "adamw", "--image-size", str(bench.image_size),
                              "--batch-size", str(bench.batch_size), "--accum-steps", str(bench.accum_steps),
                              *(["--activation-checkpointing"] if bench.activation_checkpointing else [])])
    rank, local_rank, world_size, device = script.setup_distributed(args)
    torch.manual_seed(0)
    if bench.script == "fsdp.py":
        # As fsdp.py builds it: the shapes on the meta device everywhere, the values on rank 0.
        with torch.device("meta"):
            model = script.build_model(args, 10)
        values = script.initial_values(args, 10) if rank == 0 else None
        script.shard_model(args, model, values, device, world_size)
        del values
    else:
        model = script.build_model(args, 10).to(device)
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = script.build_optimizer(args, model)
    batch = (torch.randn(bench.batch_size, 3, bench.image_size, bench.image_size, device=device),
             torch.randint(10, (bench.batch_size,), device=device))
    times, grads, activations = [], 0, 0
    for step in range(bench.warmup + bench.steps):
        start = time.perf_counter()
        for micro in range(bench.accum_steps):
            last = micro == bench.accum_steps - 1
            if bench.skip_reduce:
                model.set_requires_gradient_sync(last)
            counted = [0]
            with counting_saved_tensors(counted):
                loss, _ = script.batch_loss(model, batch)
            activations = max(activations, counted[0])
            (loss / bench.accum_steps).backward()
            held = [p.grad for p in model.parameters()]
            if bench.script == "fsdp.py":
                held += accumulated_unsharded(model)
            grads = max(grads, nbytes(held))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= bench.warmup:
            times.append(time.perf_counter() - start)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    record = {"script": bench.script, "model": bench.model, "world_size": world_size, "rank": rank,
              "accum_steps": bench.accum_steps, "skip_reduce": bench.skip_reduce,
              "params_mb": nbytes(model.parameters()) / 1e6, "grads_mb": grads / 1e6,
              "optimizer_mb": nbytes(state) / 1e6, "activations_mb": activations / 1e6,
              "activation_checkpointing": bench.activation_checkpointing,
              "seconds_per_step": statistics.median(times)}
    records = [None] * world_size
    dist.all_gather_object(records, record)
    if rank == 0:
        print("BENCH " + json.dumps(records), flush=True)
    del model, optimizer
    script.cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
