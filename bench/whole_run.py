"""A whole training run the way the ladder's peers write it: the reference for bench/run.py's profile.

    torchrun --standalone --nproc_per_node=2 bench/whole_run.py --framework bare ARGS
    torchrun --standalone --nproc_per_node=2 bench/whole_run.py --framework accelerate ARGS
    torchrun --standalone --nproc_per_node=2 bench/whole_run.py --framework fabric ARGS

The same work as `ddp_full.py` with the same ARGS: the scripts' synthetic data, model (in channels-last
memory order with --channels-last, as the scripts can be told; else PyTorch's default, contiguous, as
each peer leaves it), SGD settings, per-process batch, DistributedSampler shuffle and epochs; validation of the whole
validation set with one all-reduce of sums; model.pt written by rank 0 at the end. What it leaves
out is what a reference adds: checkpoints, resume, preemption, argument checks, logging.
  bare        DistributedDataParallel by hand, the fewest lines that do the work
  accelerate  Hugging Face Accelerate (Accelerator.prepare, accelerator.backward)
  fabric      Lightning Fabric (Fabric.setup, fabric.backward)
Rank 0 prints "global batch ..." just before the first step (the end of start-up, as the scripts
do) and, at the end, one line "WHOLE {json}" with the seconds spent training, validating and
writing model.pt.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from single_gpu import SmallCNN, make_synthetic  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["bare", "accelerate", "fabric"], default="bare")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-samples", type=int, default=4096)
    parser.add_argument("--val-samples", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--out-dir", default="runs/whole_run")
    parser.add_argument("--channels-last", action="store_true",
                        help="model and batches in channels-last memory order (default: PyTorch's, contiguous)")
    args, _ = parser.parse_known_args()  # the scripts' other flags (--workers 0, ...) are their defaults here
    torch.manual_seed(0)
    if args.model == "cnn":
        model = SmallCNN(10)
    else:
        import torchvision
        model = torchvision.models.get_model(args.model, num_classes=10)
    args.layout = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=args.layout)
    train_set = make_synthetic(args.train_samples, 0, "train", 32)
    val_set = make_synthetic(args.val_samples, 0, "val", 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    run = {"bare": bare, "accelerate": accelerate, "fabric": fabric}[args.framework]
    run(args, model, optimizer, train_set, val_set)


def batches(loader, device, layout):
    for images, labels in loader:
        yield images.to(device, memory_format=layout), labels.to(device)


def report(times, world_size, args):
    if int(os.environ.get("RANK", 0)) == 0:
        os.write(1, ("WHOLE " + json.dumps(times) + "\n").encode())


def bare(args, model, optimizer, train_set, val_set):
    # Under torchrun DDP; under plain python one process without a process group, as single_gpu.py.
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    device = torch.device("cpu")
    sampler = DistributedSampler(train_set, world_size, rank, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_set, world_size, rank, shuffle=False))
    unwrapped = model.module if launched else model
    if rank == 0:
        print(f"global batch {args.batch_size * world_size}", flush=True)
    times = {"train": 0.0, "val": 0.0, "write": 0.0}
    for epoch in range(args.epochs):
        start = time.perf_counter()
        sampler.set_epoch(epoch)
        for images, labels in batches(loader, device, args.layout):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        middle = time.perf_counter()
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for images, labels in batches(val_loader, device, args.layout):
                logits = unwrapped(images)
                sums += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                                      (logits.argmax(1) == labels).sum().item(), len(labels)])
        if launched:
            dist.all_reduce(sums)
        model.train()
        times["train"] += middle - start
        times["val"] += time.perf_counter() - middle
    start = time.perf_counter()
    if rank == 0:
        torch.save(unwrapped.state_dict(), Path(args.out_dir) / "model.pt")
    times["write"] = time.perf_counter() - start
    report(times, world_size, args)
    if launched:
        del model, unwrapped, optimizer
        dist.destroy_process_group()


def accelerate(args, model, optimizer, train_set, val_set):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    model, optimizer, loader, val_loader = accelerator.prepare(model, optimizer, loader, val_loader)
    if accelerator.is_main_process:
        print(f"global batch {args.batch_size * accelerator.num_processes}", flush=True)
    times = {"train": 0.0, "val": 0.0, "write": 0.0}
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for images, labels in batches(loader, accelerator.device, args.layout):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
        middle = time.perf_counter()
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
        with torch.no_grad():
            for images, labels in batches(val_loader, accelerator.device, args.layout):
                logits = model(images)
                sums += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                                      (logits.argmax(1) == labels).sum().item(), len(labels)])
        accelerator.reduce(sums, "sum")
        model.train()
        times["train"] += middle - start
        times["val"] += time.perf_counter() - middle
    start = time.perf_counter()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), Path(args.out_dir) / "model.pt")
    times["write"] = time.perf_counter() - start
    report(times, accelerator.num_processes, args)
    accelerator.end_training()


def fabric(args, model, optimizer, train_set, val_set):
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader, val_loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
                                                  DataLoader(val_set, batch_size=args.batch_size))
    if fabric.global_rank == 0:
        print(f"global batch {args.batch_size * fabric.world_size}", flush=True)
    times = {"train": 0.0, "val": 0.0, "write": 0.0}
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loader.sampler.set_epoch(epoch)
        for images, labels in batches(loader, fabric.device, args.layout):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
        middle = time.perf_counter()
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for images, labels in batches(val_loader, fabric.device, args.layout):
                logits = model(images)
                sums += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                                      (logits.argmax(1) == labels).sum().item(), len(labels)])
        fabric.all_reduce(sums, reduce_op="sum")
        model.train()
        times["train"] += middle - start
        times["val"] += time.perf_counter() - middle
    start = time.perf_counter()
    fabric.save(Path(args.out_dir) / "model.pt", {"model": model})
    times["write"] = time.perf_counter() - start
    report(times, fabric.world_size, args)


if __name__ == "__main__":
    main()
