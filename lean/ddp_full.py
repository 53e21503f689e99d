"""Step 5 of the DDP ladder: exact distributed validation, checkpoints, exact resume, and clusters.

    torchrun --standalone --nproc_per_node=4 ddp_full.py
    python ddp_full.py                                          # a world of one process
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=N --nproc_per_node=4 \
        --rdzv-backend=c10d --rdzv-endpoint=FIRST_NODE:29500 --rdzv-id=JOB_ID --max-restarts=3 \
        ddp_full.py --out-dir /shared/run    # on each of N nodes; a restart resumes by itself
    (without the variable, restarts often fail on stale rendezvous keys: pytorch#135712)

To train something else, edit the section "your data and model" and nothing else.
When several processes or nodes hang or fail: docs/troubleshooting.md.

Each process holds a full copy of the model, reads its own shard of every epoch
(DistributedSampler), and DDP averages the gradients across processes during backward, so every
copy takes the same optimizer step. Only rank 0 logs and writes files. --amp runs the forward in
bf16 or fp16 (fp16 with a GradScaler); --accum-steps K averages the gradients of K micro-batches and
all-reduces them once, not K times.

Every process scores a shard of the validation set with rank 0's model, and one all-reduce of
sums gives the whole set's exact metrics. Rank 0 writes checkpoints; the same command resumes
from the newest readable one (--resume auto) on any number of processes, at the same sample and
schedule point; bitwise as if never stopped on 1 or 2 CPU processes without augmenting workers.
"""
import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import random
import re
import sys
import time
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler, Subset, TensorDataset

MOMENTUM = 0.9
AMP_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The usual rate and decay of each optimizer: SGD's from the CIFAR recipes; AdamW's rate is
# PyTorch's default, its decay the vision transformer recipes'.
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.03, "weight_decay": 5e-4},
                      "adamw": {"lr": 1e-3, "weight_decay": 0.05}}
# A resumed run continues the same training: every setting must match the checkpoint's but these,
# which change how the run goes on, not what it computes (speed settings change rounding at most).
RESUME_MAY_CHANGE = ("workers", "out_dir", "log_interval", "resume", "ckpt_epochs", "keep_last",
                     "backend", "timeout_min", "compile", "channels_last", "tf32",
                     "cudnn_benchmark")
CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.pt$")
EXIT_DIVERGED = 3  # a run stopped because it diverged, told from a crash (1) and bad input (2)


# --- main -----------------------------------------------------------------------------------------

def train(args):
    rank, local_rank, world_size, device = setup_distributed(args)
    configure_cuda(args, device)
    if args.accum_steps < 1:  # 0 divides by zero; below it no group ends, so no step is ever taken
        raise ConfigError(f"--accum-steps must be at least 1, got {args.accum_steps}")
    # Rank 0 writes the results: a folder it cannot make stops the run now, not after training.
    rank0_only(rank, prepare_out_dir, args)
    set_seed(args.seed)  # first: a random split the data section draws is the same in every run
    train_set, val_set, num_outputs = rank0_first(rank, build_datasets, args)
    train_loader, val_loader = build_loaders(args, train_set, val_set, device, rank, world_size)
    # The checkpoint to resume from, or None: every process must find the same one.
    checkpoint, checkpoint_path = agreed_checkpoint(args, world_size)
    set_seed(args.seed)  # again: the weights start from the seed alone, whatever the data drew
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = build_model(args, num_outputs).to(device, memory_format=layout)
    log(f"device {device} | {describe(model)} | {len(train_set)} train / {len(val_set)} val")
    if args.compile:
        # In place, before DDP wraps it: dynamo skips torch.nn's code, so a compiled wrapper would
        # skip DDP's forward and an nn.Sequential model's. DDP cuts the compiled model at buckets.
        model.compile()
    # DDP broadcasts rank 0's weights at construction and averages gradients during backward.
    model = DDP(model,
                device_ids=[local_rank] if device.type == "cuda" else None)  # its GPU; on CPU none
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer, math.ceil(len(train_loader) / args.accum_steps))
    # fp16 needs loss scaling (small gradients underflow in fp16); bf16 has fp32's range and does
    # not. A disabled scaler passes everything through, so one code path serves all three.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    # The weights came from the same seed everywhere; from here on each process draws its own
    # random numbers (dropout, augmentation), or all of them would repeat one draw.
    set_seed(args.seed + rank)
    state = start_or_resume(args, checkpoint, checkpoint_path, model, optimizer, scheduler,
                            scaler, train_loader, rank)
    del checkpoint  # all it holds is restored now: free its memory
    log(f"process group {dist.get_backend()} | {world_size} processes | "
        f"timeout {args.timeout_min:g} min")
    log(f"global batch {args.batch_size * world_size * args.accum_steps} = {args.batch_size} per "
        f"process x {world_size} processes x {args.accum_steps} accumulation steps | "
        f"amp {args.amp} | {recipe(args)}")
    out_dir = Path(args.out_dir)
    # A resumed run rewrites the records of the epochs its checkpoint has seen, no more.
    rank0_only(rank, write_metrics, out_dir / "metrics.jsonl", state.history)
    log_resume(args, checkpoint_path, state)

    for epoch in range(state.epoch, args.epochs):
        # Without set_epoch the sampler repeats epoch 0's order in every epoch.
        train_loader.sampler.set_epoch(epoch)
        epoch_start = time.perf_counter()
        train_totals = train_one_epoch(args, model, train_loader, optimizer, scheduler, scaler,
                                       device, state)
        # Every process evaluates its shard through model.module: shards differ in length, and
        # the DDP wrapper's forward starts a collective (a buffer broadcast) left unmatched.
        val_start = time.perf_counter()
        val_totals = evaluate(args, model.module, val_loader, device)
        record = epoch_record(epoch, train_totals, val_totals, val_start - epoch_start,
                              time.perf_counter() - val_start, scheduler.get_last_lr()[0])
        state.history.append(record)
        # The next epoch begins: from here on a checkpoint resumes at its start.
        state.epoch, state.rng = epoch + 1, rng_state()
        log_epoch(record, args.epochs)
        rank0_only(rank, write_metrics, out_dir / "metrics.jsonl", state.history)
        if epoch + 1 == args.epochs or (args.ckpt_epochs and (epoch + 1) % args.ckpt_epochs == 0):
            save_checkpoint(args, model, optimizer, scheduler, scaler, state)

    # Save the unwrapped model: its keys have no "module." prefix and load into the bare model.
    stop_if_not_finite(args, model.module.state_dict().values(), "model.pt")
    rank0_only(rank, save_file, model.module.state_dict(), out_dir / "model.pt")
    log(f"saved {out_dir / 'model.pt'}")
    return 0


def main(argv=None):
    try:
        args = parse_args(argv)
        return train(args)
    except ConfigError as err:
        # Rank 0 reports bad input, which all meet; err.rank names a process that met one alone.
        rank = int(os.environ.get("RANK", 0))
        if err.rank == rank or (err.rank is None and rank == 0):
            who = "" if err.rank is None else f"rank {err.rank}: "
            message = f"{Path(__file__).name}: error: {who}{err}"
            # One write: the lines of processes that print at once never run together.
            sys.stderr.write(message + "\n")
        return err.status
    finally:
        cleanup_distributed()


# --- train/eval -----------------------------------------------------------------------------------

def autocast(args, device):
    """The forward in --amp's precision where autocast allows it (matmuls, convolutions)."""
    return torch.autocast(device.type, dtype=AMP_DTYPES[args.amp], enabled=args.amp != "none")


def train_one_epoch(args, model, loader, optimizer, scheduler, scaler, device, state):
    """Train one epoch; return [loss sum, samples] over the epoch, all processes."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    num_steps = math.ceil(len(loader) / args.accum_steps)
    start = time.perf_counter()
    group_count = torch.zeros((), dtype=torch.float64, device=device)  # the group's, so far
    for batch_index, batch in enumerate(loader):
        batch = to_device(batch, device, args.channels_last)
        # Micro-batches in groups of accum_steps; the epoch's last group and batch may be shorter.
        group_start = batch_index - batch_index % args.accum_steps
        group_end = min(group_start + args.accum_steps, len(loader))
        last_in_group = batch_index == group_end - 1
        held = min(group_end * args.batch_size, len(loader.sampler)) - group_start * args.batch_size
        # DDP decides during the forward whether the coming backward all-reduces, so no_sync must
        # cover the forward and the backward of every micro-batch but the group's last.
        sync_context = contextlib.nullcontext() if last_in_group else model.no_sync()
        with sync_context:
            with autocast(args, device):
                loss, count = batch_loss(model, batch)
            # Each mean weighs by count / held (held: the group's samples); divide_by_count ends it.
            scaler.scale(loss * (count / held)).backward()
        # A sum weighted by batch size, so a short last batch counts for what it holds.
        totals[0] += loss.detach().double() * count
        totals[1] += count
        group_count += count
        if not last_in_group:
            continue
        per_sample = divide_by_count(model, group_count, held)
        grad_norm = None
        if args.clip_grad_norm > 0:
            # Clip true gradients: unscale_ first divides out fp16's loss scale (once a step).
            scaler.unscale_(optimizer)
            # The norm before clipping, for the progress line: a rising norm warns of trouble.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        # With fp16, step() skips the update when a gradient overflowed and update() adapts the
        # scale; without a scaler (none, bf16) they are a plain optimizer.step() and nothing.
        scaler.step(optimizer)
        scaler.update()
        # The rate this step used, for the progress line; then one schedule step per optimizer step.
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step, state.global_step = batch_index // args.accum_steps + 1, state.global_step + 1
        if step % args.log_interval == 0 or step == num_steps:
            where = f"epoch {state.epoch + 1} step {step}"
            mean, seen = stop_if_diverged(args, totals, grad_norm, scaler, per_sample, where)
            elapsed = time.perf_counter() - start  # read after the wait for the GPU
            norm = "" if grad_norm is None else f" | grad norm {grad_norm.item():.3g}"
            log(f"epoch {state.epoch + 1}/{args.epochs} step {step}/{num_steps} "
                f"loss {mean:.4f} | lr {lr:.6g}{norm} | "
                f"{seen / elapsed:.0f} samples/s{peak_memory(device)} | "
                f"eta {datetime.timedelta(seconds=round(elapsed / step * (num_steps - step)))}")
    # One all-reduce after the loop makes per-process sums global (nccl needs them on the GPU).
    dist.all_reduce(totals)
    return totals


def divide_by_count(model, group_count, held):
    """The step's gradients divided by the count of all processes' micro-batches (one all-reduce):
    the global batch's mean over what batch_loss counts, samples or tokens, whichever processes
    hold more of them. Returns the count per sample, 1 for samples; group_count is zero again."""
    dist.all_reduce(group_count)
    # The processes' gradients were averaged, each mean weighed by count / held: this undoes both.
    per_sample = group_count / (dist.get_world_size() * held)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, (1 / per_sample).float())  # one kernel, as clip_grad_norm_'s
    group_count.zero_()
    return per_sample


def stop_if_diverged(args, totals, grad_norm, scaler, per_sample, where):
    """All processes' mean loss and count so far, by one all-reduce; every process stops here, in
    one line, where training diverged: a loss not finite, or (the same on every process) a gradient
    norm not finite or fp16's loss scale per sample below 1, where even unscaled gradients overflow
    fp16 (above it, a step skipped for an overflow is normal)."""
    seen = totals.clone()
    dist.all_reduce(seen)
    loss_sum, count = seen.tolist()  # waits for the GPU
    if not math.isfinite(loss_sum):
        raise diverged(args, f"loss {loss_sum / count:g} at {where}")
    if grad_norm is not None and not scaler.is_enabled() and not grad_norm.isfinite():
        raise diverged(args, f"gradient norm {grad_norm.item():g} at {where}")
    if scaler.is_enabled() and (scale := scaler.get_scale() * per_sample.item()) < 1:
        raise diverged(args, f"fp16's loss scale fell to {scale:g} at {where}")
    return loss_sum / count, count


def stop_if_not_finite(args, tensors, what):
    """Every process stops, in one line, rather than write `what` with a value not finite on any."""
    bad = sum(torch.count_nonzero(~t.isfinite()) for t in tensors if t.is_floating_point())
    dist.all_reduce(bad)
    if bad.item():
        raise diverged(args, f"{what} would hold values that are not finite: not written")


def diverged(args, problem):
    """The error that stops a diverged run: one line, what to try, its own exit status."""
    return ConfigError(f"training diverged: {problem}; try a lower --lr (now {args.lr:g}), a "
                       f"longer --warmup-epochs, --clip-grad-norm, or --amp bf16 rather than fp16",
                       status=EXIT_DIVERGED)


@torch.no_grad()
def evaluate(args, model, loader, device):
    """The sums of EVAL_METRICS and the sample count: each process scores a shard, all-reduced."""
    # Every process scores its shard with rank 0's buffers (BatchNorm's running statistics), those
    # of the model saved: each has updated its own since DDP last broadcast them.
    broadcast_buffers(model)
    model.eval()
    totals = torch.zeros(len(EVAL_METRICS) + 1, dtype=torch.float64, device=device)
    for batch in loader:
        with autocast(args, device):
            sums, count = evaluate_batch(model, to_device(batch, device, args.channels_last))
        totals[:-1] += sums
        totals[-1] += count
    dist.all_reduce(totals)
    return totals.cpu()  # waits for the GPU: validation's time is read after it


def broadcast_buffers(model):
    """Rank 0's buffers (BatchNorm's statistics, each process's own in training) to all others."""
    for buffer in model.buffers():
        values = buffer.contiguous()  # gloo leaves a strided view's values as they were
        dist.broadcast(values, src=0)
        buffer.copy_(values)


def val_record(val_totals):
    """Validation's means over all samples, and the samples counted."""
    count = val_totals[len(EVAL_METRICS)].item()
    record = {f"val_{name}": val_totals[i].item() / count for i, name in enumerate(EVAL_METRICS)}
    return {**record, "val_samples": int(count)}


def epoch_record(epoch, train_totals, val_totals, train_seconds, val_seconds, lr):
    """One line of metrics.jsonl: means over all samples, val_samples, timings, the lr reached."""
    return {"epoch": epoch + 1, "train_loss": train_totals[0].item() / train_totals[1].item(),
            **val_record(val_totals), "samples_per_sec": train_totals[1].item() / train_seconds,
            "train_seconds": train_seconds, "val_seconds": val_seconds, "lr": lr}


# --- your data and model ------------------------------------------------------------------------
# The one section to edit to train something else: the task's flags, data sets and model, loss
# and metrics. Nothing outside it knows about images, classes or these flags.

SYNTHETIC_DEFAULTS = {"train": 4096, "val": 1000}
NUM_SYNTHETIC_CLASSES = 10
# Validation reports the mean over all samples of each of these (evaluate_batch returns sums).
EVAL_METRICS = ("loss", "acc")
# Settings that say where the data is, not what it is: a resumed run may change them.
RESUME_MAY_CHANGE_TASK = ("data_dir",)


def add_task_arguments(parser):
    parser.add_argument("--data", default="synthetic", help="data set", choices=[
        "synthetic", "imagefolder",
    ])
    parser.add_argument("--data-dir", default="data",
                        help="root of the data (imagefolder: train/<class>/*, val/<class>/*)")
    parser.add_argument("--train-samples", type=int, default=None,
                        help="size of the synthetic training set, a cap on a real one "
                             f"(default: {SYNTHETIC_DEFAULTS['train']} synthetic, all real)")
    parser.add_argument("--val-samples", type=int, default=None, help="likewise for validation "
                        f"(default: {SYNTHETIC_DEFAULTS['val']} synthetic, all real)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="side of the synthetic images and of imagefolder's crops")
    parser.add_argument("--model", default="cnn",
                        help="cnn (small, no batch statistics) or a torchvision classification "
                             "model: resnet18, convnext_tiny, ... (vit_b_16 at --image-size 224)")


def make_synthetic(num_samples, seed, split, size):
    """Images in 10 classes, each a smooth colour pattern under strong noise: a model must learn,
    and can. A pure function of its arguments, from generators of its own (not the global one)."""
    patterns = torch.randn(NUM_SYNTHETIC_CLASSES, 3, 4, 4,
                           generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=(size, size), mode="bilinear", align_corners=False)
    generator = torch.Generator().manual_seed(seed * 2 + {"train": 1, "val": 2}[split])
    labels = torch.randint(NUM_SYNTHETIC_CLASSES, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, 3, size, size, generator=generator)
    return TensorDataset(0.4 * patterns[labels] + noise, labels)


def build_datasets(args):
    """Return (train_set, val_set, num_outputs); bad data settings are a ConfigError."""
    for name in ("train_samples", "val_samples", "image_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.data == "synthetic":
        return (make_synthetic(args.train_samples or SYNTHETIC_DEFAULTS["train"], args.seed,
                               "train", args.image_size),
                make_synthetic(args.val_samples or SYNTHETIC_DEFAULTS["val"], args.seed, "val",
                               args.image_size), NUM_SYNTHETIC_CLASSES)
    import torchvision.datasets as datasets  # here: it takes seconds, and synthetic data needs none
    import torchvision.transforms as T

    # Random crops keep 8-100% of an image (ImageNet's recipe); of a small image, 35-100%.
    scale = (0.08, 1.0) if args.image_size >= 128 else (0.35, 1.0)
    augment = [T.RandomResizedCrop(args.image_size, scale=scale)]
    resize = [T.Resize(round(args.image_size * 8 / 7)), T.CenterCrop(args.image_size)]
    to_tensor = [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    transforms = {"train": T.Compose([*augment, T.RandomHorizontalFlip(), *to_tensor]),
                  "val": T.Compose([*resize, *to_tensor])}
    hint = "<data-dir>/train/<class>/*, <data-dir>/val/<class>/*"
    try:
        sets = [
            datasets.ImageFolder(os.path.join(args.data_dir, split), transforms[split])
            for split in ("train", "val")]
    except (RuntimeError, OSError) as err:  # torchvision's errors for data it cannot find
        raise ConfigError(f"no {args.data} data in {args.data_dir!r}: {err} ({hint})") from None
    if sets[0].classes != sets[1].classes:
        raise ConfigError(f"train and val class folders differ under {args.data_dir!r}")
    # A cap takes a random subset, the same in every run: an image folder lists its files class by
    # class, and its first files would be its first classes.
    generator = torch.Generator().manual_seed(args.seed)
    subsets = [Subset(s, torch.randperm(len(s), generator=generator)[:cap].tolist()) if cap else s
               for s, cap in zip(sets, (args.train_samples, args.val_samples))]
    return subsets[0], subsets[1], len(sets[0].classes)


class SmallCNN(nn.Module):
    """A fast CNN without batch statistics, so its output depends on each sample alone."""

    def __init__(self, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def build_model(args, num_outputs):
    if args.model == "cnn":
        return SmallCNN(num_outputs)
    import torchvision.models as models

    # torchvision's registry holds every classification model by name; built untrained.
    if args.model not in models.list_models(module=models):
        raise ConfigError(f"unknown --model {args.model!r}: cnn or a torchvision classification "
                          "model; list them with: python -c \"import torchvision.models as m; "
                          "print(m.list_models(module=m))\"")
    return models.get_model(args.model, num_classes=num_outputs)


def batch_loss(model, batch):
    """The loss to train on, a mean over the batch, and the count it is a mean over: samples, or
    tokens for a mean over tokens (a mean reported, or a step of several batches, weighs by it)."""
    images, labels = batch
    return F.cross_entropy(model(images), labels), labels.numel()


def evaluate_batch(model, batch):
    """The sums over the batch of each of EVAL_METRICS, and how many samples the batch holds."""
    images, labels = batch
    logits = model(images).float()
    loss = F.cross_entropy(logits, labels, reduction="sum")
    correct = (logits.argmax(dim=1) == labels).sum()
    return torch.stack([loss.double(), correct.double()]), labels.numel()


# --- distributed ----------------------------------------------------------------------------------

def setup_distributed(args):
    """Join the process group; return (rank, local_rank, world_size, device). torchrun sets RANK
    (this process among all), LOCAL_RANK (among those on this machine) and WORLD_SIZE; without
    RANK, as under plain `python`, this process is a world of one."""
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA GPUs and none is available: use gloo")
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            # Met by the processes of too high a local rank only: each that gets here says so.
            raise ConfigError(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs "
                              f"are visible: start at most one process per GPU", rank=rank)
        # One GPU per process: set_device makes "cuda" mean this process's GPU, for nccl too.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Imported now, not by torch.compile later: it would keep the group alive to an abort at exit.
    from torch.distributed.nn import functional  # noqa: F401
    gc.freeze()  # what exists now lives to the end: cleanup_distributed's gc.collect() skips it
    # A collective that waits longer than this ends the job: the most one process may work alone.
    timeout = datetime.timedelta(minutes=args.timeout_min)
    # device_id binds the group to this process's GPU: nccl connects now, not at a first collective.
    device_id = device if device.type == "cuda" else None
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device_id)
    # Not WORLD_SIZE: under plain `python` a stray one would shard the data for absent processes.
    return rank, local_rank, dist.get_world_size(), device


def rank0_only(rank, function, *args):
    """Call function on rank 0 alone, the others waiting for it."""
    return rank0_first(rank, function, *args, turns=[rank == 0])


def rank0_first(rank, function, *args, turns=None):
    """Call function on rank 0 (a section's download, say), then on each other node's first
    process, then on the rest, a barrier after each turn: no two write one file at once."""
    first_of_node = int(os.environ.get("LOCAL_RANK", 0)) == 0
    result = None
    for turn in turns or [rank == 0, rank != 0 and first_of_node, not first_of_node]:
        if turn:
            result = function(*args)
        dist.barrier()
    return result


def cleanup_distributed():
    """Collect the DDP model, then leave the process group: else gloo may abort (pytorch#179291)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- data loading ---------------------------------------------------------------------------------

def build_loaders(args, train_set, val_set, device, rank, world_size):
    if len(train_set) < world_size:
        raise ConfigError(f"{world_size} processes but only {len(train_set)} training samples: "
                          f"every process needs at least one")
    # Workers read and decode files while the model trains; tensors in memory they would only copy.
    workers = args.workers
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # The processes of a node share its CPUs (torchrun sets LOCAL_WORLD_SIZE).
        cpus //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        workers = 0 if isinstance(train_set, TensorDataset) else max(1, min(8, cpus - 1))
    loader_args = dict(
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        # Page-locked host memory lets the copy to the GPU run asynchronously (non_blocking=True).
        pin_memory=device.type == "cuda",
        # The loaders' one generator seeds their workers, leaving the global RNG to the model.
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    # Every process draws the same permutation of (seed, epoch) and takes every world_size-th
    # sample of it from position rank: together they see what one process would see. It pads
    # with repeated samples until the set divides evenly, so every process runs as many steps.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed)
    # Validation: each process scores its own shard, unpadded, so that every sample counts once.
    val_sampler = ShardSampler(val_set, world_size, rank)
    return (DataLoader(train_set, sampler=train_sampler, **loader_args),
            DataLoader(val_set, sampler=val_sampler, **loader_args))


def to_device(batch, device, channels_last):
    """The batch (tensors, in tuples, lists and dicts) on the device, 4-D tensors in the
    model's memory order. non_blocking: a copy from pinned memory overlaps the GPU's work."""
    if isinstance(batch, torch.Tensor):
        fmt = torch.channels_last if channels_last and batch.dim() == 4 else torch.preserve_format
        return batch.to(device, non_blocking=True, memory_format=fmt)
    if isinstance(batch, dict):
        return {key: to_device(value, device, channels_last) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device, channels_last) for value in batch)
    return batch  # anything else (a file name, a number) stays as it is


class ShardSampler(Sampler):
    """Every world_size-th index from rank, in order, unpadded: each sample once, on one process.
    DistributedSampler pads the set with repeated samples until it divides evenly, or with
    drop_last=True leaves the remainder out: either skews validation's metrics."""

    def __init__(self, dataset, num_replicas, rank):
        self.indices = range(rank, len(dataset), num_replicas)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


# --- optimizer and schedule -----------------------------------------------------------------------

def build_optimizer(args, model):
    """SGD with momentum or AdamW. Weight decay pulls weights toward zero to keep the fit simple:
    weight matrices and kernels only, not biases and norm weights (as timm and nanoGPT do)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if args.optimizer == "adamw":
        # On GPUs one fused kernel updates all parameters (torch's fastest AdamW); on a CPU, a loop.
        return torch.optim.AdamW(groups, lr=args.lr, fused=any(p.is_cuda for p in params))
    return torch.optim.SGD(groups, lr=args.lr, momentum=MOMENTUM)


def lr_factor(args, step, steps_per_epoch):
    """The learning rate of optimizer step `step` (0, 1, ...) as a fraction of --lr. Cosine: a
    linear warm-up while the first, erratic gradients of random weights settle, then decay to 0."""
    warmup = round(args.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return (step + 1) / warmup
    total = args.epochs * steps_per_epoch
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def build_scheduler(args, optimizer, steps_per_epoch):
    """The learning-rate schedule: scheduler.step() follows optimizer steps, not batches."""
    # A step fp16's scaler skips takes its rate too; torch takes a skipped first one for a
    # scheduler.step() called too early and would warn from every process.
    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(args, step, steps_per_epoch))


# --- checkpointing --------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainState:
    """Where the run stands at its last optimizer step, kept beside the model and the optimizer."""

    # The same on every process:
    epoch: int = 0  # the epoch under way; those before it are done, validation included
    global_step: int = 0
    history: list = dataclasses.field(default_factory=list)  # one metrics record per epoch done
    train_set_size: int = 0  # the schedule counts epochs of it: other data would misplace it
    # Each process's own (rank 0 gathers them):
    rng: dict = None  # Python's and torch's random states


SHARED_STATE = ("epoch", "global_step", "history", "train_set_size")
PER_PROCESS_STATE = ("rng",)


def rng_state():
    """This process's global random generators: Python's and torch's (CPU, and CUDA if used)."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(args, model, optimizer, scheduler, scaler, state):
    """Write everything an exact resume needs; every process calls this, rank 0 writes the file."""
    start, rank = time.perf_counter(), dist.get_rank()
    # Each process's own random states: rank 0 gathers them, a resume on as many gives each back.
    per_process = {name: getattr(state, name) for name in PER_PROCESS_STATE}
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(per_process, gathered, dst=0)
    checkpoint = {
        # The unwrapped model: no "module." prefix, so it loads into the bare model too.
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        # The schedule's position: without it a resumed run would warm up again from step 0.
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(), **{name: getattr(state, name) for name in SHARED_STATE},
        "world_size": dist.get_world_size(), "rank_states": gathered,
        # The settings as JSON values (a section's Path flag as its text): what weights_only loads.
        "config": json.loads(json.dumps(vars(args), default=str)),
    }
    ckpt_dir = Path(args.out_dir) / "checkpoints"
    path = ckpt_dir / f"step_{state.global_step:09d}.pt"
    stop_if_not_finite(args, tensors_in([checkpoint, per_process]), path.name)
    # The others wait for rank 0: a write that fails stops the run here.
    rank0_only(rank, save_file, checkpoint, path)
    if rank == 0:
        # The lowest steps go, never the one just written (a torn later file may rank above it).
        for old in [p for p in list_checkpoints(ckpt_dir) if p != path][args.keep_last - 1:]:
            old.unlink()
    log(f"checkpoint {path} in {time.perf_counter() - start:.2f} s")


def tensors_in(obj):
    """The tensors in obj and in its dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(value)


def list_checkpoints(ckpt_dir):
    """The checkpoints in ckpt_dir, newest first."""
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).glob("step_*.pt")
             if (m := CHECKPOINT_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path, args):
    """Read and check a checkpoint; anything wrong with it is a ConfigError naming the file."""
    try:
        # To the CPU, where random states must be; mmap: a node's processes share the file's pages.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True,
                                mmap=zipfile.is_zipfile(path))  # not zip: the file's own error
    except Exception as err:  # weights_only runs nothing from the file: what fails is the file
        reason = f"{type(err).__name__} {(str(err).strip().splitlines() or [''])[0]}"
        raise ConfigError(f"checkpoint {path} cannot be read: {reason}") from None
    keys = {"scheduler", "scaler", "world_size", "config", "rank_states", *SHARED_STATE}
    if not isinstance(checkpoint, dict) or not keys <= checkpoint.keys() or any(
            set(states) != set(PER_PROCESS_STATE) for states in checkpoint["rank_states"]):
        raise ConfigError(f"checkpoint {path} was not written by this script (or this version)")
    settings, saved = json.loads(json.dumps(vars(args), default=str)), checkpoint["config"]
    may_change = RESUME_MAY_CHANGE + RESUME_MAY_CHANGE_TASK
    for name in sorted(settings.keys() & saved.keys()):
        if saved[name] != settings[name] and name not in may_change:
            raise ConfigError(f"checkpoint {path} is from a run with --{name.replace('_', '-')} "
                              f"{saved[name]}, this run has {settings[name]}")
    return checkpoint


def agreed_checkpoint(args, world_size):
    """find_checkpoint on every process, then one collective: all must have found the same. A node
    that misses the newest checkpoint would start afresh while the others resume, and hang."""
    try:
        checkpoint, path = find_checkpoint(args)
        view = (f"{Path(path).name} (step {checkpoint['global_step']})" if path else "none", None)
    except ConfigError as err:
        checkpoint, path, view = None, None, (None, (str(err), err.status))
    views = [None] * world_size
    dist.all_gather_object(views, view)
    for rank, (found, error) in enumerate(views):
        if error is not None:
            raise ConfigError(error[0] if rank == 0 else f"on rank {rank}: {error[0]}", error[1])
        if found != views[0][0]:
            raise ConfigError(f"processes disagree on the checkpoint to resume from: rank 0 finds "
                              f"{views[0][0]}, rank {rank} finds {found}; every node must see the "
                              f"same --out-dir")
    return checkpoint, path


def find_checkpoint(args):
    """The checkpoint to resume from and its path, or (None, None) to start afresh."""
    candidates = list_checkpoints(Path(args.out_dir) / "checkpoints")
    if args.resume != "auto":
        checkpoint = None if args.resume == "none" else load_checkpoint(args.resume, args)
        start = checkpoint["global_step"] if checkpoint else 0
        if candidates and int(CHECKPOINT_NAME.match(candidates[0].name)[1]) > start:
            raise ConfigError(f"{candidates[0]} is later than this run's start (step {start}): "
                              f"resume it with --resume auto, or start in another --out-dir")
        return checkpoint, args.resume if checkpoint else None
    reasons = []
    for path in candidates:
        try:
            return load_checkpoint(path, args), path
        except ConfigError as err:
            # A torn or foreign file is reported and passed over for the one before it.
            log(f"skipping: {err}")
            reasons.append(str(err))
    if candidates:
        raise ConfigError(f"no usable checkpoint in {Path(args.out_dir) / 'checkpoints'} (newest: "
                          f"{reasons[0]}); start afresh in another --out-dir or delete them")
    return None, None


def restore(checkpoint, path, model, optimizer, scheduler, scaler, rank):
    """Load a checkpoint into the unwrapped model and the rest; return the TrainState it holds."""
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"checkpoint {path} does not fit this model: {first_line(err)}") from None
    if checkpoint["scaler"]:  # empty from a run without fp16's scaler: nothing to restore
        scaler.load_state_dict(checkpoint["scaler"])
    rank_states = checkpoint["rank_states"]
    if len(rank_states) == dist.get_world_size():
        own = rank_states[rank]
    else:
        # Another number of processes: each keeps its own random states (seed + rank).
        own = {"rng": rng_state()}
    state = TrainState(**{name: checkpoint[name] for name in SHARED_STATE}, **own)
    set_rng_state(state.rng)
    return state


def first_line(err):
    return (str(err).strip() or type(err).__name__).splitlines()[0]


def start_or_resume(args, checkpoint, path, model, optimizer, scheduler, scaler, train_loader,
                    rank):
    """The TrainState to start from: a fresh one, or the checkpoint's with all it holds restored."""
    if checkpoint is None:
        return TrainState(rng=rng_state(), train_set_size=len(train_loader.dataset))
    if checkpoint["train_set_size"] != len(train_loader.dataset):  # --data-dir moved, not changed
        raise ConfigError(f"checkpoint {path} is from a run with {checkpoint['train_set_size']} "
                          f"training samples, this run has {len(train_loader.dataset)}")
    state = restore(checkpoint, path, model.module, optimizer, scheduler, scaler, rank)
    if checkpoint["world_size"] != dist.get_world_size():
        # Another number of processes: the schedule goes on from the same fraction of the run.
        steps_per_epoch = math.ceil(len(train_loader) / args.accum_steps)
        scheduler.last_epoch = state.epoch * steps_per_epoch - 1
        scheduler.step()
        was = checkpoint["world_size"] * checkpoint["config"]["accum_steps"] * args.batch_size
        log(f"written by {checkpoint['world_size']} processes, resumed by {dist.get_world_size()}: "
            f"global batch {was} -> {args.batch_size * args.accum_steps * dist.get_world_size()}; "
            f"fresh random states (dropout), rank 0's BatchNorm statistics: the rest stays behind")
    return state


# --- machinery ------------------------------------------------------------------------------------
# Skip on a first reading: the GPU's speed settings, files, flags, and what a run prints.

def configure_cuda(args, device):
    # Tensor cores' convolutions take channels-last tensors: on GPUs, the layout by default.
    if args.channels_last is None:
        args.channels_last = device.type == "cuda"
    # TF32: float32 matmuls and convolutions on tensor cores, several times faster from Ampere on.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    # cuDNN times its algorithms per input shape and keeps the fastest: a GPU run's bits may vary.
    torch.backends.cudnn.benchmark = args.cudnn_benchmark


def prepare_out_dir(args):
    """Create --out-dir: a file standing where it should be stops the run now, in one line."""
    try:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot write to --out-dir {args.out_dir}: {err.strerror or err}")


def save_file(obj, path):
    """Write obj (bytes, or what torch.save takes) to path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)


def write_metrics(path, history):
    save_file("".join(json.dumps(record) + "\n" for record in history).encode(), path)


class ConfigError(Exception):
    """An error the user can act on: one line and a non-zero exit, not a traceback. Rank 0 reports
    it (bad input, met by all), or the process it names by rank (met alone: a GPU it cannot see)."""

    def __init__(self, message, status=2, rank=None):
        super().__init__(message)
        self.status, self.rank = status, rank


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per process per micro-batch: the global batch is it times "
                             "the processes and the accumulation steps")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="SGD with momentum, or AdamW")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: 0.03 with sgd, 1e-3 with adamw)")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="epochs of linear warm-up of the cosine schedule")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="decay of weight matrices and kernels, not of biases and norm "
                             "weights (default: 5e-4 with sgd, 0.05 with adamw)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, data and shuffle")
    parser.add_argument("--workers", type=int, default=None,
                        help="data loader processes (default: none for tensors in memory; for "
                             "files, a process's CPUs but one, 1 to 8)")
    parser.add_argument("--out-dir", default=None, help="output folder (default: runs/<script>)")
    parser.add_argument("--log-interval", type=int, default=20,
                        help="optimizer steps between progress lines")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: float32 matmuls and convolutions on tensor cores (TF32)")
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: cuDNN times its algorithms per input shape, keeps the fastest")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model: faster "
                        "GPU steps after minutes of compiling, slower on CPU (default: off)")
    add_task_arguments(parser)
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                        help="autocast the forward to this precision; fp16 adds a GradScaler")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="4-D inputs and weights in channels-last order (default: on GPUs)")
    parser.add_argument("--accum-steps", type=int, default=1,
                        help="micro-batches averaged into each optimizer step (default: 1)")
    parser.add_argument("--clip-grad-norm", type=float, default=0.0,
                        help="clip the global gradient norm to this value; 0 turns clipping off")
    parser.add_argument("--resume", default="auto", help="auto: the newest readable checkpoint "
                        "in <out-dir>/checkpoints, afresh if empty; none: afresh; or a checkpoint's"
                        " path (none and a path refuse an --out-dir holding later checkpoints)")
    parser.add_argument("--ckpt-epochs", type=int, default=1,
                        help="checkpoint every this many epochs and after the last; 0: the last")
    parser.add_argument("--keep-last", type=int, default=3, help="checkpoints kept; older go")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="process group backend; auto is nccl with CUDA, gloo without")
    parser.add_argument("--timeout-min", type=float, default=30.0,
                        help="minutes a process waits in a collective before the job fails")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", Path(__file__).stem)
    # The optimizers want rates and decays of different sizes: the chosen one's, unless given.
    for name, value in OPTIMIZER_DEFAULTS[args.optimizer].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def set_seed(seed):
    """Seed every generator the training code draws from (Python's and torch's, CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


def log(message):
    """Print on rank 0 only: every process runs this code, and one copy of each line is enough."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def describe(model):
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    return f"{type(model).__name__} ({millions:.2f} M parameters)"


def peak_memory(device):
    """For progress lines: the most memory this process's tensors have held on the GPU so far."""
    if device.type != "cuda":
        return ""
    return f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"


def recipe(args):
    return (f"optimizer {args.optimizer} | lr {args.lr:g}"
            f" | weight decay {args.weight_decay:g}")


def log_resume(args, checkpoint_path, state):
    """Say where a resumed run goes on, or that it already completed every epoch."""
    if checkpoint_path is not None:
        log(f"resumed from {checkpoint_path}: "
            f"epoch {state.epoch + 1}")
    if state.epoch >= args.epochs:
        log(f"nothing to train: the run already completed {state.epoch} epochs; start afresh in "
            f"another --out-dir")


def log_epoch(record, epochs):
    metrics = " ".join(f"val_{name} {record[f'val_{name}']:.4f}" for name in EVAL_METRICS)
    log(f"epoch {record['epoch']}/{epochs} train_loss {record['train_loss']:.4f} {metrics} "
        f"({record['val_samples']} samples) | {record['samples_per_sec']:.0f} samples/s")


if __name__ == "__main__":
    sys.exit(main())
