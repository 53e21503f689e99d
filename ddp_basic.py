"""Step 3 of the DDP ladder: DistributedDataParallel, one process per device, launched by torchrun.

    torchrun --standalone --nproc_per_node=4 ddp_basic.py      # 4 GPUs, or 4 CPU processes (gloo)
    python ddp_basic.py                                         # a world of one process
    # [optional: legacy launcher]
    python -m torch.distributed.launch --nproc_per_node=4 ddp_basic.py   # the legacy launcher

To train something else, edit the section "your data and model" and nothing else.
When several processes or nodes hang or fail: docs/troubleshooting.md.

Each process holds a full copy of the model, reads its own shard of every epoch
(DistributedSampler), and DDP averages the gradients across processes during backward, so every
copy takes the same optimizer step. Only rank 0 logs and writes files.

A copier's map: what deleting each "# [optional: NAME]" gives up (lean/ddp_basic.py: all).
    help formatter    --help stating each flag's default
    value checks      one line before any work for --lr nan, --epochs 0, an unwritable --out-dir
    cifar10           --data cifar10 and --download
    constant lr       --lr-schedule constant: --lr throughout, no warm-up
    atomic writes     the old file kept whole, not half a new one, when a write is cut short
    unused params     --find-unused-parameters: for a model whose steps leave parameters out
    legacy launcher   python -m torch.distributed.launch (--local-rank)
    error exchange    an error in rank0_only or rank0_first stops every process at once, in one line
    profile           --profile: a trace of a few steps per process, and where each one's time went
"""
import argparse
import atexit  # [optional: profile]
import datetime
import gc
import json
import math
import os
import random
import sys
import tempfile  # [optional: value checks]
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

MOMENTUM = 0.9
# The usual rate and decay of each optimizer: SGD's from the CIFAR recipes; AdamW's rate is
# PyTorch's default, its decay the vision transformer recipes'.
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.03, "weight_decay": 5e-4},
                      "adamw": {"lr": 1e-3, "weight_decay": 0.05}}
EXIT_DIVERGED = 3  # a run stopped because it diverged, told from a crash (1) and bad input (2)


# --- main -----------------------------------------------------------------------------------------

def train(args):
    rank, local_rank, world_size, device = setup_distributed(args)
    configure_cuda()
    # Rank 0 writes the results: a folder it cannot make stops the run now, not after training.
    rank0_only(rank, prepare_out_dir, args)
    set_seed(args.seed)  # first: a random split the data section draws is the same in every run
    train_set, val_set, num_outputs = rank0_first(rank, build_datasets, args)
    train_loader, val_loader = build_loaders(args, train_set, val_set, device, rank, world_size)
    set_seed(args.seed)  # again: the weights start from the seed alone, whatever the data drew
    model = build_model(args, num_outputs).to(device)
    log(f"device {device} | {describe(model)} | {len(train_set)} train / {len(val_set)} val")
    if args.compile:
        # In place, before DDP wraps it: dynamo skips torch.nn's code, so a compiled wrapper would
        # skip DDP's forward and an nn.Sequential model's. DDP cuts the compiled model at buckets.
        model.compile()
    # DDP broadcasts rank 0's weights at construction and averages gradients during backward.
    model = DDP(model,
                find_unused_parameters=args.find_unused_parameters,  # [optional: unused params]
                device_ids=[local_rank] if device.type == "cuda" else None)  # its GPU; on CPU none
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer, steps_per_epoch=len(train_loader))
    # The weights came from the same seed everywhere; from here on each process draws its own
    # random numbers (dropout, augmentation), or all of them would repeat one draw.
    set_seed(args.seed + rank)
    start_profiler(args, optimizer, device, rank)  # [optional: profile]
    log(f"process group {dist.get_backend()} | {world_size} processes | "
        f"timeout {args.timeout_min:g} min")
    log(f"global batch {args.batch_size * world_size} = {args.batch_size} per process x "
        f"{world_size} processes | {recipe(args)}")

    out_dir, history = Path(args.out_dir), []  # history: metrics.jsonl's records (rank 0's)
    for epoch in range(args.epochs):
        # Without set_epoch the sampler repeats epoch 0's order in every epoch.
        train_loader.sampler.set_epoch(epoch)
        epoch_start = time.perf_counter()
        train_totals = train_one_epoch(args, model, train_loader, optimizer, scheduler, device,
                                       epoch)
        # Rank 0 evaluates the whole set alone, through model.module: the DDP wrapper's forward
        # would start a collective (a buffer broadcast) that the others never join. They wait in
        # rank0_only below, at most --timeout-min; ddp_full.py splits validation so none waits.
        if rank == 0:
            val_start = time.perf_counter()
            val_totals = evaluate(args, model.module, val_loader, device)
            record = epoch_record(epoch, train_totals, val_totals, val_start - epoch_start,
                                  time.perf_counter() - val_start, scheduler.get_last_lr()[0])
            history.append(record)
            log_epoch(record, args.epochs)
        rank0_only(rank, write_metrics, out_dir / "metrics.jsonl", history)

    # Save the unwrapped model: its keys have no "module." prefix and load into the bare model.
    stop_if_not_finite(args, model.module.state_dict().values(), "model.pt")
    rank0_only(rank, save_file, model.module.state_dict(), out_dir / "model.pt")
    log(f"saved {out_dir / 'model.pt'}")


def main(argv=None):
    try:
        args = parse_args(argv)
        check_args(args)  # [optional: value checks]
        train(args)
    except ConfigError as err:
        # Rank 0 reports bad input, which all meet; err.rank names a process that met one alone.
        rank = int(os.environ.get("RANK", 0))
        if err.rank == rank or (err.rank is None and rank == 0):
            who = "" if err.rank is None else f"rank {err.rank}: "
            # One write: the lines of processes that print at once never run together.
            sys.stderr.write(f"{Path(__file__).name}: error: {who}{err}\n")
        return err.status
    finally:
        cleanup_distributed()
    return 0


# --- train/eval -----------------------------------------------------------------------------------

def train_one_epoch(args, model, loader, optimizer, scheduler, device, epoch):
    """Train for one epoch; return [loss sum, samples] over the epoch, all processes."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    start = time.perf_counter()
    for batch_index, batch in enumerate(loader):
        batch = to_device(batch, device)
        loss, count = batch_loss(model, batch)
        loss.backward()
        optimizer.step()
        # The rate this step used, for the progress line; then the schedule moves one step on.
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # A sum weighted by batch size, so a short last batch counts for what it holds.
        totals[0] += loss.detach().double() * count
        totals[1] += count
        step = batch_index + 1
        if step % args.log_interval == 0 or step == len(loader):
            mean, seen = stop_if_diverged(args, totals, f"epoch {epoch + 1} step {step}")
            elapsed = time.perf_counter() - start  # read after the wait for the GPU
            log(f"epoch {epoch + 1}/{args.epochs} step {step}/{len(loader)} "
                f"loss {mean:.4f} | lr {lr:.6g} | "
                f"{seen / elapsed:.0f} samples/s{peak_memory(device)} | "
                f"eta {datetime.timedelta(seconds=round(elapsed / step * (len(loader) - step)))}")
    # One all-reduce after the loop makes per-process sums global (nccl needs them on the GPU).
    dist.all_reduce(totals)
    return totals


def stop_if_diverged(args, totals, where):
    """All processes' mean loss and count so far, by one all-reduce; every process stops here, in
    one line, where training diverged: a loss that is not finite (nan, inf) on any process."""
    seen = totals.clone()
    dist.all_reduce(seen)
    loss_sum, count = seen.tolist()  # waits for the GPU
    if not math.isfinite(loss_sum):
        raise diverged(args, f"loss {loss_sum / count:g} at {where}")
    return loss_sum / count, count


def stop_if_not_finite(args, tensors, what):
    """Every process stops, in one line, rather than write `what` with a value not finite on any."""
    bad = sum(torch.count_nonzero(~t.isfinite()) for t in tensors if t.is_floating_point())
    dist.all_reduce(bad)
    if bad.item():
        raise diverged(args, f"{what} would hold values that are not finite: not written")


def diverged(args, problem):
    """The error that stops a diverged run: one line, what to try, its own exit status."""
    return ConfigError(f"training diverged: {problem}; try a lower --lr (now {args.lr:g}) or a "
                       f"longer --warmup-epochs", status=EXIT_DIVERGED)


@torch.no_grad()
def evaluate(args, model, loader, device):
    """The sums of EVAL_METRICS and the sample count: a last, short batch skews a mean of means."""
    model.eval()
    totals = torch.zeros(len(EVAL_METRICS) + 1, dtype=torch.float64, device=device)
    for batch in loader:
        sums, count = evaluate_batch(model, to_device(batch, device))
        totals[:-1] += sums
        totals[-1] += count
    return totals.cpu()  # waits for the GPU: validation's time is read after it


def epoch_record(epoch, train_totals, val_totals, train_seconds, val_seconds, lr):
    """One line of metrics.jsonl: means over all samples, val_samples, timings, the lr reached."""
    count = val_totals[-1].item()
    val = {f"val_{name}": val_totals[i].item() / count for i, name in enumerate(EVAL_METRICS)}
    return {"epoch": epoch + 1, "train_loss": train_totals[0].item() / train_totals[1].item(),
            **val, "val_samples": int(count),
            "samples_per_sec": train_totals[1].item() / train_seconds,
            "train_seconds": train_seconds, "val_seconds": val_seconds, "lr": lr}


# --- your data and model ------------------------------------------------------------------------
# The one section to edit to train something else: the task's flags, data sets and model, loss
# and metrics. Nothing outside it knows about images, classes or these flags.

SYNTHETIC_DEFAULTS = {"train": 4096, "val": 1000}
NUM_SYNTHETIC_CLASSES = 10
# Validation reports the mean over all samples of each of these (evaluate_batch returns sums).
EVAL_METRICS = ("loss", "acc")


def add_task_arguments(parser):
    parser.add_argument("--data", default="synthetic", help="data set", choices=[
        "synthetic", "imagefolder",
        "cifar10",  # [optional: cifar10]
    ])
    parser.add_argument("--data-dir", default="data",
                        help="root of the data (imagefolder: train/<class>/*, val/<class>/*)")
    # [optional: cifar10]
    parser.add_argument("--download", action="store_true", help="download cifar10 into --data-dir")
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
    # [optional: cifar10]
    if args.data == "cifar10":
        augment, resize = [T.RandomCrop(32, padding=4)], []
        to_tensor = [T.ToTensor(), T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))]
    transforms = {"train": T.Compose([*augment, T.RandomHorizontalFlip(), *to_tensor]),
                  "val": T.Compose([*resize, *to_tensor])}
    hint = "<data-dir>/train/<class>/*, <data-dir>/val/<class>/*"
    hint = "add --download" if args.data == "cifar10" else hint  # [optional: cifar10]
    try:
        sets = [
            datasets.CIFAR10(  # [optional: cifar10]
                args.data_dir, split == "train", transforms[split],  # [optional: cifar10]
                download=args.download) if args.data == "cifar10" else  # [optional: cifar10]
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
    function = returning_errors(function)  # [optional: error exchange]
    result = None
    for turn in turns or [rank == 0, rank != 0 and first_of_node, not first_of_node]:
        if turn:
            result = function(*args)
        stop_if_any_failed(rank, result)  # [optional: error exchange]
        dist.barrier()
    return result


# [optional: error exchange]
def returning_errors(function):
    """function, returning the exception it raises: stop_if_any_failed then stops every process."""
    def call(*args):
        try:
            return function(*args)
        except Exception as err:
            return err
    return call


# [optional: error exchange]
def stop_if_any_failed(rank, result):
    """Stop every process if one failed, none waiting for a peer that has exited: a ConfigError is
    one line from who met it (rank 0's unnamed: bad input all meet), a bug a traceback there."""
    status = getattr(result, "status", 1) if isinstance(result, Exception) else None
    statuses = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, status)
    failed = [r for r, s in enumerate(statuses) if s is not None]
    if isinstance(result, ConfigError) and rank != 0:
        raise ConfigError(str(result), result.status, rank=rank)
    if isinstance(result, Exception):
        raise result
    if failed:  # the others stop quietly, with the exit status of who failed first
        raise ConfigError("", statuses[failed[0]], rank=failed[0])


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
    return (DataLoader(train_set, sampler=train_sampler, **loader_args),
            DataLoader(val_set, shuffle=False, **loader_args))


def to_device(batch, device):
    """The batch (tensors, in tuples, lists and dicts) on the device. non_blocking: a copy
    from pinned memory overlaps the GPU's work."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch  # anything else (a file name, a number) stays as it is


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
    # [optional: constant lr]
    if args.lr_schedule == "constant":
        return 1.0
    warmup = round(args.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return (step + 1) / warmup
    total = args.epochs * steps_per_epoch
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def build_scheduler(args, optimizer, steps_per_epoch):
    """The learning-rate schedule: scheduler.step() follows optimizer steps, not batches."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(args, step, steps_per_epoch))


# --- machinery ------------------------------------------------------------------------------------
# Skip on a first reading: the GPU's speed settings, files, flags, and what a run prints.

def configure_cuda():
    # TF32: float32 matmuls and convolutions on tensor cores, several times faster from Ampere on.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # cuDNN times its algorithms for each new input shape and keeps the fastest.
    torch.backends.cudnn.benchmark = True


def prepare_out_dir(args):
    """Create --out-dir: a file standing where it should be stops the run now, in one line."""
    try:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        # [optional: value checks]
        # A file written there: permissions and read-only mounts stop it now, not after training.
        tempfile.TemporaryFile(dir=args.out_dir).close()
    except OSError as err:
        raise ConfigError(f"cannot write to --out-dir {args.out_dir}: {err.strerror or err}")


def save_file(obj, path):
    """Write obj (bytes, or what torch.save takes) to path."""
    # [optional: atomic writes]
    path, final = Path(path).with_name(f".{Path(path).name}.tmp"), path
    if isinstance(obj, bytes):
        Path(path).write_bytes(obj)
    else:
        torch.save(obj, path)
    os.replace(path, final)  # [optional: atomic writes]


def write_metrics(path, history):
    save_file("".join(json.dumps(record) + "\n" for record in history).encode(), path)


class ConfigError(Exception):
    """An error the user can act on: one line and a non-zero exit, not a traceback. Rank 0 reports
    it (bad input, met by all), or the process it names by rank (met alone: a GPU it cannot see)."""

    def __init__(self, message, status=2, rank=None):
        super().__init__(message)
        self.status, self.rank = status, rank


# [optional: help formatter]
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help states each default; a flag whose default is decided later states it in its help."""

    def _get_help_string(self, a):  # 0 == False: a default of 0 is stated too
        return a.help if a.default is None or a.default is False else super()._get_help_string(a)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.formatter_class = HelpFormatter  # [optional: help formatter]
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per process per optimizer step: the global batch is it "
                             "times the processes")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="SGD with momentum, or AdamW")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: 0.03 with sgd, 1e-3 with adamw)")
    # [optional: constant lr]
    parser.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                        help="cosine: linear warm-up to --lr, then cosine decay to 0 at the last "
                             "step; constant: --lr throughout, no warm-up")
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
    parser.add_argument("--compile", action="store_true", help="torch.compile the model: faster "
                        "GPU steps after minutes of compiling, slower on CPU (default: off)")
    # [optional: profile]
    parser.add_argument("--profile", action="store_true", help="profile optimizer steps 4-6: "
                        "each process's trace in --out-dir, and where its time went (default: off)")
    add_task_arguments(parser)
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="process group backend; auto is nccl with CUDA, gloo without")
    parser.add_argument("--timeout-min", type=float, default=30.0,
                        help="minutes a process waits in a collective before the job fails")
    # [optional: unused params]
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="DDP: a model whose steps may leave parameters out (slower)")
    # [optional: legacy launcher]
    # torch.distributed.launch passes --local-rank=N (--local_rank before torch 2.0): accepted.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help="passed by the legacy launcher, which sets LOCAL_RANK too: not read")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", Path(__file__).stem)
    # The optimizers want rates and decays of different sizes: the chosen one's, unless given.
    for name, value in OPTIMIZER_DEFAULTS[args.optimizer].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# [optional: value checks]
# The least value of each numeric setting (None, a default decided later, is not checked).
AT_LEAST = {"epochs": 1, "batch_size": 1, "log_interval": 1, "workers": 0, "weight_decay": 0,
            "warmup_epochs": 0}
POSITIVE = ("lr", "timeout_min")  # [optional: value checks]


# [optional: value checks]
def check_args(args):
    """Reject settings that cannot work before any work is done."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):  # nan and inf fail no comparison
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name, least in AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    for name in POSITIVE:
        if (value := getattr(args, name)) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")


def set_seed(seed):
    """Seed every generator the training code draws from (Python's and torch's, CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


def log(message):
    """Print on rank 0 only: every process runs this code, and one copy of each line is enough."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


# [optional: profile]
def start_profiler(args, optimizer, device, rank):
    """With --profile, torch.profiler over optimizer steps 4-6 (the first ones allocate memory and
    pick kernels): each process's trace in --out-dir, Chrome's format (Perfetto reads it too)."""
    if not args.profile:
        return
    path = Path(args.out_dir) / f"profile_rank{rank}.json"

    def step(*_):
        if profiler.step_num < 6:  # after the profiled steps, nothing
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a step's time includes its GPU work
            profiler.step()

    def trace_ready(_):  # every process's line in one write (no two interleave), after the steps
        if profiler.step_num < 6:  # stopped at the exit below
            return print(f"rank {rank}: nothing profiled, the run ended before step 6\n", end="")
        profiler.export_chrome_trace(str(path))
        print(f"rank {rank}: {summarize_trace(path)} | {path}\n", end="", flush=True)

    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA][
            :1 + (device.type == "cuda")],
        schedule=torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
        on_trace_ready=trace_ready)
    optimizer.register_step_post_hook(step)  # a profiler step ends with each optimizer step
    profiler.start()
    atexit.register(profiler.stop)  # one left running at the exit crashes it


# [optional: profile]
def summarize_trace(path):
    """Milliseconds a profiled step: its time, its collectives' (gloo's or nccl's), and theirs
    that no computation hid (a GPU kernel; on a CPU, an op of the training thread)."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    gpu = any(e.get("cat") == "kernel" for e in events)

    def collective(e):  # on a GPU nccl's kernels, not the calls that launch them
        return e.get("cat") == "kernel" and "nccl" in e["name"] if gpu else e["name"][:5] == "gloo:"

    def spans(keep):  # the union of the kept events' intervals
        merged = []
        for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in events if keep(e)):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    comms = spans(collective)
    busy = spans(lambda e: not collective(e) and (e.get("cat") == "kernel" if gpu else (
        e.get("cat") == "cpu_op" and e["tid"] == steps[0]["tid"] and "c10d::" not in e["name"])))
    ms = 1e-3 / len(steps)  # from microseconds in all to milliseconds a step
    comm = sum(end - start for start, end in comms) * ms
    hidden = sum(max(0, min(end, e) - max(start, s)) for start, end in comms for s, e in busy) * ms
    return (f"{len(steps)} steps profiled: {sum(e['dur'] for e in steps) * ms:.1f} ms a step, "
            f"collectives {comm:.1f} ms, not hidden {comm - hidden:.1f} ms")


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
            f", schedule {args.lr_schedule}"  # [optional: constant lr]
            f" | weight decay {args.weight_decay:g}")


def log_epoch(record, epochs):
    metrics = " ".join(f"val_{name} {record[f'val_{name}']:.4f}" for name in EVAL_METRICS)
    log(f"epoch {record['epoch']}/{epochs} train_loss {record['train_loss']:.4f} {metrics} "
        f"({record['val_samples']} samples) | {record['samples_per_sec']:.0f} samples/s")


if __name__ == "__main__":
    sys.exit(main())
