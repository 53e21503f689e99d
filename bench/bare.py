"""Reference loops for the benchmark, launched like the ladder scripts (python or torchrun).

    --mode plain        one process: forward, backward, step; nothing else
    --mode ddp          the same under DistributedDataParallel (gloo on CPU, nccl on CUDA)
    --mode independent  WORLD_SIZE processes training alone, no process group: no DDP run on cores
                        these processes share can beat it (the ceiling)
Prints one JSON line (rank 0): global samples/s, the time spent waiting for data, and with
--count-comm the gradient all-reduces and bytes per optimizer step (counted with a communication hook).
"""
import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from single_gpu import SmallCNN, make_synthetic  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "ddp", "independent"], default="plain")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD, as the ladder's defaults (default: 0.05)")
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="(default: 5e-4, the ladder's)")
    parser.add_argument("--train-samples", type=int, default=0,
                        help="size of the synthetic set, cycled through epoch after epoch (default: 0, as many "
                             "samples as the run uses). Match the script compared with: on this 2-core machine "
                             "a 47 MB set trains 20%% slower than a 20 MB one (the cache), whatever the loop")
    parser.add_argument("--naive", action="store_true", help="accumulate without no_sync")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--model", default="cnn", help="cnn or a torchvision model by name (default: cnn)")
    parser.add_argument("--amp", choices=["none", "bf16"], default="none", help="autocast (default: none)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: TF32 matmuls and convolutions, as the scripts' default (default: on)")
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: cudnn.benchmark, as the scripts' default (default: on)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                        help="model and inputs channels-last, as the scripts' default (default: on)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default: 25, DDP's)")
    parser.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP: gradients are views into buckets")
    parser.add_argument("--static-graph", action="store_true", help="DDP: the graph is the same every step")
    parser.add_argument("--compress", choices=["none", "fp16", "bf16"], default="none",
                        help="DDP: all-reduce gradients in 16 bits (PyTorch's compression hooks; default: none)")
    parser.add_argument("--count-comm", action="store_true",
                        help="DDP: count all-reduces and bytes with a communication hook (default: off)")
    parser.add_argument("--image-size", type=int, default=0,
                        help="random images of this side made on the device, no loader (default: 0, the "
                             "ladder's synthetic 32x32 data through a DataLoader)")
    args = parser.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if args.model == "cnn":
        model = SmallCNN(10).to(device)
    else:
        import torchvision
        model = torchvision.models.get_model(args.model, num_classes=10).to(device)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)
    counts = {"reductions": 0, "bytes": 0}
    if args.mode == "ddp":
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view, static_graph=args.static_graph)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        reduce = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                  "bf16": default_hooks.bf16_compress_hook}[args.compress]
        width = 4 if args.compress == "none" else 2  # bytes per gradient element on the wire

        def hook(state, bucket):
            counts["bytes"] += bucket.buffer().numel() * width
            counts["reductions"] += bucket.index() == 0
            return reduce(state, bucket)
        # Without --count-comm DDP keeps its built-in all-reduce, as in the scripts: a Python hook
        # runs per bucket, a cost the loops compared with the scripts must not carry.
        if args.count_comm:
            model.register_comm_hook(None, hook)
        elif args.compress != "none":
            model.register_comm_hook(None, reduce)
    micro = args.steps * args.accum_steps + args.warmup * args.accum_steps
    if args.image_size:  # data already on the device: measures the model, not the input pipeline
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        images = images.to(memory_format=layout)
        labels = torch.randint(10, (args.batch_size,), device=device)
        loader = [(images, labels)] * micro
    else:
        data = make_synthetic(args.train_samples or micro * args.batch_size, rank, "train", 32)
        loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.workers, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    wait = compute = 0.0
    samples = 0
    iterator = iter(loader)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if args.mode == "ddp":
                dist.barrier()
            counts.update(reductions=0, bytes=0)  # count the timed steps only
            start, wait, compute, samples = time.perf_counter(), 0.0, 0.0, 0
        for k in range(args.accum_steps):
            t0 = time.perf_counter()
            try:
                images, labels = next(iterator)
            except StopIteration:  # the next epoch, as the scripts start one
                iterator = iter(loader)
                images, labels = next(iterator)
            images = images.to(device, non_blocking=True, memory_format=layout)
            labels = labels.to(device, non_blocking=True)
            t1 = time.perf_counter()
            last = k == args.accum_steps - 1
            sync = contextlib.nullcontext() if (last or args.naive or args.mode != "ddp") else model.no_sync()
            with sync:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16"):
                    loss = F.cross_entropy(model(images), labels) / args.accum_steps
                loss.backward()
            wait += t1 - t0
            compute += time.perf_counter() - t1
            samples += labels.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {"samples_per_sec": samples * world_size / elapsed, "wait_fraction": wait / (wait + compute),
              "seconds_per_step": elapsed / args.steps}
    if device.type == "cuda":  # the most this process's tensors held on the GPU
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if args.count_comm:
        result.update(reductions_per_step=counts["reductions"] / args.steps, bytes_per_step=counts["bytes"] / args.steps)
    if args.mode == "independent":  # no group: every process reports, the sum is the global rate
        result["samples_per_sec"] = samples / elapsed
    if rank == 0 or args.mode == "independent":  # one write per line: lines of processes never interleave
        os.write(1, ("BENCH " + json.dumps(result) + "\n").encode())
    if args.mode == "ddp":
        del model, optimizer
        import gc
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
