"""Step 3 of the DDP ladder: DistributedDataParallel, one process per device, launched by torchrun.

    torchrun --standalone --nproc_per_node=4 ddp_basic.py      # 4 GPUs, or 4 CPU processes (gloo)
    python ddp_basic.py                                         # a world of one process
    # [optional: legacy launcher]
    python -m torch.distributed.launch --nproc_per_node=4 ddp_basic.py   # the legacy launcher

To train something else, edit the section "your data and model" and nothing else.

Each process holds a full copy of the model, reads its own shard of every epoch
(DistributedSampler), and DDP averages the gradients across processes during backward, so every
copy takes the same optimizer step. Only rank 0 logs and writes files (a warning comes
from the process that meets its cause).
"""
import argparse
import datetime
import gc
import json
import math
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, Sampler, Subset,
                              TensorDataset, default_collate)

# How this file reads: first the program this step teaches -- main, then one epoch of training and
# of validation --, then what it trains ("your data and model": the section you edit), the rest of
# the program (the loaders, the optimizer...), and from the section "device" on the machinery that
# program needs, each of its sections marked "Skip on a first reading". A part a copier may delete
# is tagged "# [optional: NAME]": delete each such tag line with the statement under it (in a
# docstring: the line under it), and each line that ends in the tag, all of one NAME at once.

# torchvision is imported inside the functions that need it: it takes seconds to import, and the
# default run (synthetic data, small CNN) does not use it.

MOMENTUM = 0.9
# The learning rate and weight decay each optimizer is usually given (SGD's: the CIFAR recipes';
# AdamW's: PyTorch's default rate and the decay of the vision transformer recipes).
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.03, "weight_decay": 5e-4},
                      "adamw": {"lr": 1e-3, "weight_decay": 0.05}}

# What reading a broken file raises: OSError (PIL's UnidentifiedImageError, a truncated image, a
# file gone) and, from PIL for a PNG with a broken chunk, SyntaxError. Anything else is a bug.
UNREADABLE = (OSError, SyntaxError)
# Consecutive unreadable samples a training sample may skip to find a readable one: more, and
# the data set is broken, not a file in it.
MAX_UNREADABLE_IN_A_ROW = 16
# The exit status of a write that failed (a full disk, a permission): EX_IOERR, which a requeueing
# script can tell from bad input (2) and a crash (1). Free some space, then run the same command.
EXIT_WRITE_FAILED = 74


# --- main -----------------------------------------------------------------------------------------

def train(args):
    rank, local_rank, world_size, device = setup_distributed(args)
    configure_cuda(args, device)
    # Rank 0 writes the results: if it cannot, every process stops now, not after training.
    rank0_only(rank, prepare_out_dir, args)
    train_set, val_set, num_outputs = rank0_first(rank, build_datasets, args)
    # [optional: model check]
    check_model_fits(args, num_outputs, train_set, val_set)
    train_loader, val_loader = build_loaders(args, train_set, val_set, device, rank, world_size)
    set_seed(args.seed)
    model = build_model(args, num_outputs)
    # [optional: init-from]
    if args.init_from:
        # Rank 0 reads the weights; DDP hands them to every process when it wraps the model.
        rank0_only(rank, init_weights_from, args, model)
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = model.to(device, memory_format=layout)
    log(f"device {device} | {describe(model)} | {len(train_set)} train / {len(val_set)} val")
    # [optional: compile]
    if args.compile:
        # In place, before DDP wraps it: dynamo skips DDP's forward (torch.nn's code), so a compiled
        # wrapper compiles only what DDP calls, nothing of a model whose forward is torch.nn's
        # (nn.Sequential). DDP still cuts the compiled model at its buckets, to overlap all-reduces.
        model.compile()
    # DDP broadcasts rank 0's weights at construction and averages gradients during backward.
    # device_ids names the one GPU this process drives; on CPU it must be left out.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer, steps_per_epoch=len(train_loader))

    # The weights came from the same seed everywhere; from here on each process draws its own
    # random numbers (dropout, augmentation), or all of them would repeat one draw.
    set_seed(args.seed + rank)

    history = []  # metrics.jsonl's records (rank 0's)
    # [optional: init-from]
    if args.init_from and rank == 0:
        # The starting weights' score, what fine-tuning must improve on: epoch 0 in metrics.jsonl.
        history.append({"epoch": 0, **val_record(evaluate(args, model.module, val_loader, device))})
        log_epoch(history[-1], args.epochs)

    out_dir = Path(args.out_dir)
    metrics_path = out_dir / "metrics.jsonl"
    log(f"process group {dist.get_backend()} | {world_size} processes | "
        f"timeout {args.timeout_min:g} min")
    log(f"global batch {args.batch_size * world_size} = {args.batch_size} per process x "
        f"{world_size} processes")
    log_recipe(args)
    # Rank 0 writes; the others wait for its verdict: a write that fails stops every process here.
    rank0_only(rank, write_metrics, metrics_path, history)

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
        rank0_only(rank, write_metrics, metrics_path, history)

    save_start = time.perf_counter()
    # Save the unwrapped model: its keys have no "module." prefix and load into the bare model.
    rank0_only(rank, atomic_save, model.module.state_dict(), out_dir / "model.pt")
    log(f"saved {out_dir / 'model.pt'} in {time.perf_counter() - save_start:.2f} s")


def main(argv=None):
    try:
        check_task()
        args = parse_args(argv)
        check_args(args)
        train(args)
    except ConfigError as err:
        # Bad input, which every process meets, is one line from rank 0; an error that one process
        # met is that process's line, naming it (the peers it stopped say nothing).
        rank = int(os.environ.get("RANK", 0))
        if err.rank == rank or err.rank is None and rank == 0:
            who = "" if err.rank is None else f"rank {err.rank}: "
            intact = f"; {what_is_intact(args)}" if err.status == EXIT_WRITE_FAILED else ""
            # One write: the lines of processes that print at once never run together.
            sys.stderr.write(f"{Path(__file__).name}: error: {who}{err}{intact}\n")
        return err.status
    finally:
        cleanup_distributed()
    return 0


# --- train/eval -----------------------------------------------------------------------------------

def train_one_epoch(args, model, loader, optimizer, scheduler, device, epoch):
    """Train for one epoch; return [loss sum, samples, unreadable files] over the epoch,
    all processes."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    num_steps = len(loader)
    start = time.perf_counter()
    for batch_index, (batch, unreadable) in enumerate(loader):
        # A file that could not be read gave its place to the next readable one (SeededSamples).
        for name in unreadable:
            warn(f"cannot read {name}: trained on the next readable sample in its place")
        totals[2] += len(unreadable)
        batch = to_device(batch, device, args.channels_last)
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
        if step % args.log_interval == 0 or step == num_steps:
            elapsed = time.perf_counter() - start
            samples = totals[1].item()
            # Rank 0's own loss, and its throughput times the number of processes.
            log(f"epoch {epoch + 1}/{args.epochs} step {step}/{num_steps} "
                f"loss {totals[0].item() / samples:.4f} | lr {lr:.6g} | "
                f"{samples * dist.get_world_size() / elapsed:.0f} samples/s{peak_memory(device)} | "
                f"eta {format_seconds(elapsed / step * (num_steps - step))}")
    # One all-reduce after the loop turns per-process sums into global ones.
    dist.all_reduce(totals)
    return totals


@torch.no_grad()
def evaluate(args, model, loader, device):
    """Return the sums of EVAL_METRICS, the number of samples and of unreadable files over the
    loader.

    Sums, not means: a mean over batches of different sizes is not the mean over samples.
    """
    model.eval()
    totals = torch.zeros(len(EVAL_METRICS) + 2, dtype=torch.float64, device=device)
    for batch, unreadable in loader:
        for name in unreadable:
            warn(f"cannot read {name}: left out of validation")
        totals[-1] += len(unreadable)
        if batch is not None:  # None: not one sample of the batch could be read
            batch = to_device(batch, device, args.channels_last)
            sums, count = evaluate_batch(model, batch)
            totals[:-2] += sums
            totals[-2] += count
    model.train()
    return totals


def val_record(val_totals):
    """Validation's means over all samples, how many samples were counted and how many files
    could not be read."""
    count = val_totals[-2].item()
    record = {f"val_{name}": val_totals[i].item() / count for i, name in enumerate(EVAL_METRICS)}
    return {**record, "val_samples": int(count), "val_unreadable": int(val_totals[-1].item())}


def epoch_record(epoch, train_totals, val_totals, train_seconds, val_seconds, lr):
    """One line of metrics.jsonl: means over all samples, the samples counted, the files that
    could not be read, timings, and the learning rate the schedule has reached."""
    return {"epoch": epoch + 1, "train_loss": train_totals[0].item() / train_totals[1].item(),
            "train_unreadable": int(train_totals[2].item()), **val_record(val_totals),
            "samples_per_sec": train_totals[1].item() / train_seconds,
            "train_seconds": train_seconds, "val_seconds": val_seconds, "lr": lr}


# --- your data and model ------------------------------------------------------------------------
# The one section to edit to train something else: the task's flags, its data sets, its model
# (and the pretrained weights it may start from), and what a batch costs (the loss) and scores
# (the metrics). Nothing outside this section knows about images, classes or these flags
# (tests/test_seam.py swaps in another task to prove it).

SYNTHETIC_DEFAULTS = {"train": 4096, "val": 1000}
NUM_SYNTHETIC_CLASSES = 10
# Validation reports the mean over all samples of each of these (evaluate_batch returns sums).
EVAL_METRICS = ("loss", "acc")


def add_task_arguments(parser):
    parser.add_argument("--data", choices=["synthetic", "cifar10", "imagefolder"],
                        default="synthetic", help="data set")
    parser.add_argument("--data-dir", default="data",
                        help="root of cifar10, or of an image tree train/<class>/*, val/<class>/*")
    parser.add_argument("--download", action="store_true", help="download cifar10 into --data-dir")
    parser.add_argument("--train-samples", type=int, default=None,
                        help="size of the synthetic training set, a cap on a real one "
                             f"(default: {SYNTHETIC_DEFAULTS['train']} synthetic, all real)")
    parser.add_argument("--val-samples", type=int, default=None,
                        help="likewise for validation "
                             f"(default: {SYNTHETIC_DEFAULTS['val']} synthetic, all real)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="side of the synthetic images, and of imagefolder's, whose random "
                             "training crops keep 8-100%% of an image from 128 px up (ImageNet's "
                             "recipe), 35-100%% below")
    parser.add_argument("--model", default="cnn",
                        help="cnn (small, no batch statistics) or any torchvision classification "
                             "model by name: resnet18, resnet50, convnext_tiny, vit_b_16, ...")


def make_synthetic(num_samples, seed, split, size=32):
    """Images of 3 x size x size in 10 classes, a pure function of its arguments.

    Each class is a smooth colour pattern drawn from `seed`; a sample is its class pattern under
    strong noise, so a model has to learn (accuracy starts at chance) but can (it rises well above).
    The generators are private: building data never moves the global RNG that seeds the model.
    """
    patterns = torch.randn(NUM_SYNTHETIC_CLASSES, 3, 4, 4,
                           generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=(size, size), mode="bilinear", align_corners=False)
    generator = torch.Generator().manual_seed(seed * 2 + {"train": 1, "val": 2}[split])
    labels = torch.randint(NUM_SYNTHETIC_CLASSES, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, 3, size, size, generator=generator)
    images = 0.4 * patterns[labels] + noise
    return TensorDataset(images, labels)


def build_datasets(args):
    """Return (train_set, val_set, num_outputs); bad data settings are a ConfigError."""
    for name in ("train_samples", "val_samples", "image_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.data == "synthetic":
        train_set = make_synthetic(args.train_samples or SYNTHETIC_DEFAULTS["train"], args.seed,
                                   "train", args.image_size)
        val_set = make_synthetic(args.val_samples or SYNTHETIC_DEFAULTS["val"], args.seed, "val",
                                 args.image_size)
        return train_set, val_set, NUM_SYNTHETIC_CLASSES
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    if args.data == "cifar10":
        normalize = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                              normalize])
        val_tf = T.Compose([T.ToTensor(), normalize])
        try:
            train_set = datasets.CIFAR10(args.data_dir, train=True, transform=train_tf,
                                         download=args.download)
            val_set = datasets.CIFAR10(args.data_dir, train=False, transform=val_tf,
                                       download=args.download)
        except RuntimeError as err:  # torchvision's "Dataset not found or corrupted"
            raise ConfigError(f"cifar10 not found in {args.data_dir!r} ({err}); add --download") \
                from None
        num_classes = 10
    else:
        normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        # ImageNet's crops keep as little as 8% of a 224-pixel photo; 8% of a small image is a few
        # pixels of its object, so small images keep at least 35%.
        scale = (0.08, 1.0) if args.image_size >= 128 else (0.35, 1.0)
        train_tf = T.Compose([T.RandomResizedCrop(args.image_size, scale=scale),
                              T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        val_tf = T.Compose([T.Resize(round(args.image_size * 8 / 7)), T.CenterCrop(args.image_size),
                            T.ToTensor(), normalize])
        splits = []
        for split, transform in (("train", train_tf), ("val", val_tf)):
            root = os.path.join(args.data_dir, split)
            if not os.path.isdir(root):
                raise ConfigError(f"no directory {root!r}: --data imagefolder reads "
                                  f"<data-dir>/train/<class>/* and <data-dir>/val/<class>/*")
            try:
                splits.append(datasets.ImageFolder(root, transform=transform))
            except (FileNotFoundError, OSError) as err:  # no class folders, or no images in them
                raise ConfigError(f"no images under {root!r}: {err}") from None
        train_set, val_set = splits
        if train_set.classes != val_set.classes:
            raise ConfigError(f"train and val class folders differ under {args.data_dir!r}")
        num_classes = len(train_set.classes)
    if args.train_samples is not None:
        train_set = Subset(train_set, range(min(args.train_samples, len(train_set))))
    if args.val_samples is not None:
        val_set = Subset(val_set, range(min(args.val_samples, len(val_set))))
    return train_set, val_set, num_classes


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


# [optional: init-from]
def pretrained_weights(args):
    """The state dict that --init-from pretrained loads: torchvision's weights for --model, read
    from torch's download cache. Never downloaded here: every process of every node would fetch
    the same file at once; a download is a setup step, done once, before training."""
    import torchvision.models as models

    try:
        url = models.get_model_weights(args.model).DEFAULT.url
    except (ValueError, KeyError, AttributeError):  # cnn, or a model published without weights
        raise ConfigError(f"torchvision has no pretrained weights for --model {args.model}") \
            from None
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    if not path.is_file():
        raise ConfigError(f"torchvision's {args.model} weights are not in {path.parent}: fetch "
                          f"them once with python -c \"import torchvision; torchvision.models."
                          f"get_model('{args.model}', weights='DEFAULT')\", or copy {url} there")
    return read_state_dict(path)


def channels_last_pays(args, device):
    """Whether channels-last memory order speeds this model up on this device: on GPUs, where it
    is the layout of tensor-core convolutions; on CPU where measured (docs/bench/results.md): the
    small CNN 1.4x and mobilenet_v3_small 2.0x faster, resnet18 and resnet50 0.9-1.0x."""
    return device.type == "cuda" or args.model in ("cnn", "mobilenet_v3_small")


def batch_loss(model, batch):
    """The loss to train on (a mean over the batch), and how many samples the batch holds."""
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
    """Join the process group; return (rank, local_rank, world_size, device).

    torchrun sets RANK (this process among all), LOCAL_RANK (among those on this machine) and
    WORLD_SIZE. Without them, as under plain `python`, this process is a world of one.
    """
    # torch.distributed.nn.functional's collectives take the default process group as a default
    # argument, read once, as the module is imported. torch imports it lazily, with torch.compile or
    # at the first forward on the meta device (check_model_fits); imported after init_process_group,
    # it would keep the group alive after destroy_process_group, its gloo threads running until the
    # interpreter's exit, where they can abort a finished run ("terminate called without an active
    # exception"). Imported now, its defaults hold None.
    from torch.distributed.nn import functional  # noqa: F401

    # What exists now, the imported modules, lives as long as the process: frozen, the garbage
    # collector never walks it again, so cleanup_distributed's collection and the interpreter's at
    # exit are quick. All made from here on, the process group first, is collected as usual.
    gc.freeze()
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA GPUs and none is available; "
                          "use --backend gloo on CPU")
    launched = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
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
    # A collective that waits longer than this ends the job (nccl's watchdog, gloo's error): the
    # most that one process may work alone while the others wait for it.
    timeout = datetime.timedelta(minutes=args.timeout_min)
    if launched:
        dist.init_process_group(backend, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, local_rank, world_size, device


def rank0_only(rank, function, *args):
    """Call function on rank 0 alone; a ConfigError it raises stops every process with its line.

    The others wait for rank 0's verdict in a collective rather than a barrier: a ConfigError on
    rank 0 then stops every process with the same error, and none is left waiting on a peer that
    has exited. Any other error (a bug) is a traceback on rank 0, and the others stop quietly.
    """
    result, verdict = None, [None]
    if rank == 0:
        try:
            result = function(*args)
        except ConfigError as err:
            verdict = [(str(err), err.status, err.rank)]
        except Exception:
            # A bug, not bad input: its traceback here, and the others stop (exit 1) without one.
            dist.broadcast_object_list([("", 1, 0)], src=0)
            raise
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(*verdict[0])
    return result


def rank0_first(rank, function, *args):
    """Call function on rank 0 first (a download, say), then on the others: no two write a file.
    What rank 0 meets stops all; so does what another process meets after it (its node's own
    disk): that process reports it, with its rank, and the others stop with it."""
    result = rank0_only(rank, function, *args)
    error = None
    if rank != 0:
        try:
            result = function(*args)
        except ConfigError as err:
            error = (str(err), err.status)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        message, status = errors[rank] or ("", errors[failed[0]][1])
        raise ConfigError(message, status, rank=rank if errors[rank] else failed[0])
    return result


def cleanup_distributed():
    """Leave the process group after the DDP model is gone.

    gloo can abort a worker at exit ("terminate called without an active exception") while a DDP
    model is still alive at destroy_process_group(): the caller's model and optimizer are out of
    scope by now, and collecting garbage releases them before the group goes.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- data loading ---------------------------------------------------------------------------------

def build_loaders(args, train_set, val_set, device, rank, world_size):
    if len(train_set) < world_size:
        raise ConfigError(f"{world_size} processes but only {len(train_set)} training samples: "
                          f"every process needs at least one")
    # Every process draws the same permutation of (seed, epoch) and takes every world_size-th
    # sample of it from position rank: together they see what one process would see. It pads
    # with repeated samples until the set divides evenly, so every process runs as many steps.
    # Each index comes as (epoch, index), the key of its random augmentation (SeededSamples).
    train_sampler = EpochKeys(DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                                 shuffle=True, seed=args.seed))
    workers = args.workers if args.workers is not None else default_workers(train_set)
    loader_args = dict(
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        # Page-locked host memory lets the copy to the GPU run asynchronously (non_blocking=True).
        pin_memory=device.type == "cuda",
        # Each item is (sample, unreadable files): a batch comes as (batch, unreadable files).
        collate_fn=collate_readable,
        # The loader's own generator seeds its workers (augmentation is seeded per sample anyway),
        # leaving the global RNG to the model.
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    train_loader = DataLoader(SeededSamples(train_set, args.seed), sampler=train_sampler,
                              **loader_args)
    val_loader = DataLoader(ReadableSamples(val_set), shuffle=False, **loader_args)
    return train_loader, val_loader


def to_device(batch, device, channels_last):
    """The batch (a tensor, or tuples, lists and dicts of them) on the device, 4-D tensors in the
    model's memory order. non_blocking: a copy from pinned memory overlaps the GPU's work."""
    if isinstance(batch, torch.Tensor):
        fmt = torch.channels_last if channels_last and batch.dim() == 4 else torch.preserve_format
        return batch.to(device, non_blocking=True, memory_format=fmt)
    if isinstance(batch, dict):
        return {key: to_device(value, device, channels_last) for key, value in batch.items()}
    return type(batch)(to_device(value, device, channels_last) for value in batch)


class EpochKeys(Sampler):
    """The wrapped sampler's indices as (epoch, index): the keys SeededSamples seeds from."""

    def __init__(self, sampler):
        self.sampler, self.epoch = sampler, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        return ((self.epoch, index) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)

    def __getattr__(self, name):
        """Anything else is the wrapped sampler's (its generator, set_start, num_samples)."""
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


# --- optimizer and schedule -----------------------------------------------------------------------

def build_optimizer(args, model):
    """SGD with momentum or AdamW; weight decay on weight matrices and convolution kernels only.

    Decay pulls weights toward zero to keep the fit simple. Biases and normalisation weights are a
    few numbers per channel that shift and scale activations: decaying them regularises little and
    pulls the network off its fit (timm and nanoGPT leave them out, as here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr)
    return torch.optim.SGD(groups, lr=args.lr, momentum=MOMENTUM)


def lr_factor(args, step, steps_per_epoch):
    """The learning rate of optimizer step `step` (0, 1, ...) as a fraction of --lr.

    Warm-up: the first gradients of random weights are large and erratic, and a large global
    batch takes large steps; rising linearly to --lr lets the weights settle first. Then cosine
    decay lowers the rate smoothly, to 0 after the last step, so training ends in small steps."""
    if args.lr_schedule == "constant":
        return 1.0
    warmup = round(args.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return (step + 1) / warmup
    total = args.epochs * steps_per_epoch
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def build_scheduler(args, optimizer, steps_per_epoch):
    """The learning-rate schedule: scheduler.step() once per optimizer step, never per batch."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(args, step, steps_per_epoch))


# --- device ---------------------------------------------------------------------------------------
# Skip on a first reading: the GPU's settings for speed (TF32, cuDNN's autotuning).

def configure_cuda(args, device):
    """Speed settings: CUDA's libraries (on CPU they change nothing), and the memory layout."""
    if args.channels_last is None:
        args.channels_last = channels_last_pays(args, device)
    # TF32 multiplies float32 on tensor cores with a 10-bit mantissa (sums stay float32): several
    # times faster on Ampere and later GPUs, at about fp16's precision per product.
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    # cuDNN times its algorithms for each new input shape and keeps the fastest; its choice can
    # differ between runs, so GPU runs are not bitwise repeatable with it.
    torch.backends.cudnn.benchmark = args.cudnn_benchmark


# --- writing files --------------------------------------------------------------------------------
# Skip on a first reading: --out-dir tried first; files written whole (temporary file, rename).

def prepare_out_dir(args):
    """Create --out-dir and make sure a file can be written there, before any training."""
    try:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        # Writing a file is the one sure test: permissions, read-only mounts and a file standing
        # where the directory should be all fail here, in one line, instead of after the last epoch.
        with tempfile.TemporaryFile(dir=args.out_dir):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write to --out-dir {args.out_dir}: {err.strerror or err}")


def atomic_save(obj, path):
    """Write obj (bytes, or what torch.save takes) to a temporary file, then rename: a reader sees
    the old file or the new, never half. A write that fails leaves the old file and no temporary
    one, and is a ConfigError (write_error)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(obj) if isinstance(obj, bytes) else torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        # torch.save reports a write that its file refused as a RuntimeError ("unexpected pos"),
        # raised while the OSError (errno 28: no space left) is handled.
        cause = err if isinstance(err, OSError) else err.__context__
        if not isinstance(cause, OSError):
            raise
        raise write_error(path, cause) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def write_error(path, err):
    """A file that cannot be written (a full disk, a permission), as one line: which, why, the
    space left on its file system. Written files are replaced whole or not at all (atomic_save)."""
    return ConfigError(f"cannot write {path}: {err.strerror or err} ({free_space(path)}); the "
                       f"files already in --out-dir are whole", status=EXIT_WRITE_FAILED)


def free_space(path):
    try:
        return f"{shutil.disk_usage(Path(path).parent).free / 2**20:.2f} MiB free there"
    except OSError:
        return "free space unknown"


def what_is_intact(args):
    """After a write that failed: what the same command, run again, starts from."""
    start = "no checkpoint"
    return f"{start}: fix that, then run the same command again"


# --- samples --------------------------------------------------------------------------------------
# Skip on a first reading: samples the same in every run, whatever the workers; unreadable files.

class SeededSamples(Dataset):
    """The training set, each sample loaded with random draws that are a pure function of
    (seed, epoch, index): the same crop and flip whichever process or worker loads it, with any
    --workers, any world size, and after a resume.

    Left alone, a transform draws from the generators of the process that loads the sample: a
    worker's, seeded once when the worker starts (a resumed run starts new ones), or the main
    process's. A transform qualifies if it draws from torch's or Python's global generator, as
    torchvision's do (numpy's is not seeded here). The loading process's own generators are left
    as they were.

    A sample whose file cannot be read (truncated, corrupt, gone) gives its place to the next
    readable one in index order, loaded with the key's seed: a choice made from the key alone,
    so that every exactness promise holds (each process, worker and resume makes the same one).
    Each item is (sample, [] or [its unreadable file]); the training loop reports and counts it.
    """

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        if isinstance(self.dataset, TensorDataset):
            return self.dataset[index], []  # tensors in memory: no transform to seed, no file
        seed = ((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63
        unreadable, tries = [], min(MAX_UNREADABLE_IN_A_ROW + 1, len(self.dataset))
        for offset in range(tries):
            try:
                return self.load((index + offset) % len(self.dataset), seed), unreadable
            except UNREADABLE as err:
                # This sample's own file is reported (once per epoch); the others tried in its
                # place are reported by their own keys.
                unreadable = unreadable or [describe_unreadable(self.dataset, index, err)]
        raise OSError(f"{tries} samples in a row cannot be read, from {unreadable[0]}")

    def load(self, index, seed):
        if torch.utils.data.get_worker_info() is not None:
            # A worker's generators serve its samples alone: seed them and load.
            torch.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed costs
            random.seed(seed)                          # 90 us a call, seeding every device
            return self.dataset[index]
        # In the main process they also serve the model (dropout): put them back afterwards.
        torch_state, python_state = torch.get_rng_state(), random.getstate()
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(python_state)


class ReadableSamples(Dataset):
    """The validation set, each item (sample, []) or, where its file cannot be read, (None, [the
    file]): the sample is left out and reported. A stand-in would count another sample twice."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        try:
            return self.dataset[index], []
        except UNREADABLE as err:
            return None, [describe_unreadable(self.dataset, index, err)]


def describe_unreadable(dataset, index, err):
    """'file (reason)' for a sample that cannot be read: its file where the data set lists them
    (torchvision's ImageFolder and DatasetFolder: .samples), else its index."""
    # An OSError's own words where it has them; PIL's name the file object: that is left out.
    reason = getattr(err, "strerror", None) or str(err).split(" <")[0]
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    try:
        entry = dataset.samples[index]
    except (AttributeError, LookupError, TypeError):
        entry = None
    path = entry[0] if isinstance(entry, (tuple, list)) and entry else entry
    return f"{path if isinstance(path, (str, os.PathLike)) else f'sample {index}'} ({reason})"


def collate_readable(items):
    """(the batch of the readable samples, or None if there is none, the files that were not)."""
    samples = [sample for sample, _ in items if sample is not None]
    unreadable = [name for _, names in items for name in names]
    return (default_collate(samples) if samples else None), unreadable


def default_workers(train_set):
    """Data in memory as tensors: none, since workers would only copy it. Files: one worker per CPU
    this process may use (its CPU affinity, shared by the processes on this node), but one left to
    the training process, at least 1 and at most 8."""
    if isinstance(train_set, TensorDataset):
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cpus or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, min(8, per_process - 1))


# --- model ----------------------------------------------------------------------------------------
# Skip on a first reading: the model tried on the data before the first step; --init-from.

# [optional: model check]
def check_model_fits(args, num_outputs, train_set, val_set):
    """One sample through the model on the meta device (shapes only: no memory, no arithmetic),
    then the smallest training batch. A model that cannot take the data (a ViT built for 224-pixel
    images, fed 32; BatchNorm given one value per channel) is a ConfigError here, in one line,
    rather than a traceback in the first step or at an epoch's end; so is a data set none of whose
    first samples can be read."""
    # A file that cannot be read is skipped in training and validation alike, but a set none of
    # whose first samples can be read is no data set. The model meets a validation sample.
    for dataset in (train_set, val_set):
        try:
            sample, _ = SeededSamples(dataset, args.seed)[(0, 0)]
        except OSError as err:
            raise ConfigError(f"the data cannot be read: {err}") from None
    try:
        with torch.device("meta"):
            model = build_model(args, num_outputs).eval()
    except (RuntimeError, NotImplementedError):
        return  # a model that reads values as it is built: no verdict, the first step will tell
    # In training, BatchNorm normalises each channel over the batch, which one value (1 sample,
    # a 1x1 feature map) cannot be: the smallest batch is tried too, an epoch's last of the
    # samples each process gets (the sampler pads them to one number for all).
    per_process = math.ceil(len(train_set) / dist.get_world_size())
    smallest = per_process % args.batch_size or args.batch_size
    where = ""
    try:
        evaluate_batch(model, to_device(default_collate([sample]), "meta", False))
        where = f" (a training batch of {smallest}, the smallest: try another --batch-size)"
        batch_loss(model.train(), to_device(default_collate([sample] * smallest), "meta", False))
    except NotImplementedError:
        return  # an operation with no meta implementation: no verdict, the first step will tell
    except (RuntimeError, ValueError, AssertionError, TypeError, IndexError) as err:
        if "meta tensors" in str(err):
            return  # a value read (.item(), int() of a count): no verdict, the first step will tell
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"the model does not fit the data: {reason}{where}") from None


# [optional: init-from]
def read_state_dict(path):
    """The weights in a file: a model.pt, a plain state dict, or a checkpoint holding "model"."""
    try:
        # weights_only: tensors and plain containers only, so loading a file runs no code from it.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "empty or truncated"
        raise ConfigError(f"--init-from {path} cannot be read: {reason}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a training checkpoint
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--init-from {path} holds no state dict")
    # Wrappers put a prefix before every key -- DDP's and DataParallel's "module.", torch.compile's
    # "_orig_mod." -- that the plain model does not have.
    prefixes = ("module.", "_orig_mod.")
    while state and (prefix := next((p for p in prefixes if all(k.startswith(p) for k in state)),
                                    None)):
        state = {key.removeprefix(prefix): value for key, value in state.items()}
    return state


# [optional: init-from]
def init_weights_from(args, model):
    """Load --init-from into the model before training: fine-tuning. Every key must fit, but
    pretrained weights' layers of another shape (a classifier for another number of classes) keep
    their fresh weights, to be trained for this task."""
    own, fresh = model.state_dict(), []
    if args.init_from == "pretrained":
        state = pretrained_weights(args)
        fresh = sorted(k for k, v in state.items() if k in own and v.shape != own[k].shape)
        state.update({key: own[key] for key in fresh})
    else:
        state = read_state_dict(args.init_from)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(f"--init-from {args.init_from} does not fit the model: {reason}") \
            from None
    log(f"weights from {args.init_from}" + (f"; fresh: {', '.join(fresh)}" if fresh else ""))


# --- config ---------------------------------------------------------------------------------------
# Skip on a first reading: the flags, and their checks before anything starts.

class ConfigError(Exception):
    """An error the user can act on: reported as one line and a non-zero exit, never as a traceback.

    Without a rank, it is one that every process meets (bad input): rank 0 alone reports it. One
    that a process may meet alone (a GPU it cannot see, a file it cannot write) names that
    process's rank: that process reports it, and the peers it stopped say nothing.
    """

    def __init__(self, message, status=2, rank=None):
        super().__init__(message)
        self.status, self.rank = status, rank


def no_pretrained_weights(args):
    raise ConfigError("this task has no pretrained weights for --init-from pretrained: define "
                      "pretrained_weights(args) in the section \"your data and model\"")


# What the rest of the script takes from the section "your data and model": each name, what it
# must be, and the default that a section without it gets (REQUIRED: none, the script stops).
REQUIRED = object()


TASK_HOOKS = {
    "build_datasets": ("build_datasets(args) returns (train_set, val_set, num_outputs)", REQUIRED),
    "build_model": ("build_model(args, num_outputs) returns the model", REQUIRED),
    "batch_loss": ("batch_loss(model, batch) returns (the mean loss to train on, the batch's "
                   "sample count)", REQUIRED),
    "evaluate_batch": ("evaluate_batch(model, batch) returns (the batch's sums of EVAL_METRICS, "
                       "its sample count)", REQUIRED),
    "EVAL_METRICS": ("EVAL_METRICS names the metrics whose sums evaluate_batch returns", REQUIRED),
    "add_task_arguments": ("add_task_arguments(parser) adds the task's flags",
                           lambda parser: None),
    "pretrained_weights": ("pretrained_weights(args) returns the state dict of --init-from "
                           "pretrained", no_pretrained_weights),
    "channels_last_pays": ("channels_last_pays(args, device) says whether channels-last memory "
                           "order speeds the model up", lambda args, device: False),
}


def check_task():
    """Before any work: a hook the section lacks gets its default, or stops the script in one line
    that names it (a copy of the section made before the hook existed has no such name)."""
    for name, (what, default) in TASK_HOOKS.items():
        if name not in globals():
            if default is REQUIRED:
                raise ConfigError(f"the section \"your data and model\" has no {name}: {what}")
            globals()[name] = default


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help states each default; a flag without a fixed one (None) states it in its own help."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per process per micro-batch; the global batch is batch size "
                             "x world size x accumulation steps")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="SGD with momentum, or AdamW")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate for the global batch, used as given (default: "
                             "0.03 with sgd, 1e-3 with adamw)")
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
                        help="data loader processes per process (default: 0 for data already in "
                             "memory as tensors, where workers only add copies; for files, this "
                             "process's share of its CPUs less one, 1 to 8)")
    parser.add_argument("--out-dir", default=None, help="output folder (default: runs/<script>)")
    parser.add_argument("--log-interval", type=int, default=20,
                        help="optimizer steps between progress lines")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="4-D inputs and weights in channels-last memory order (default: where "
                             "it pays: on GPUs, and on CPU for models measured faster with it)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: float32 matmuls and convolutions on tensor cores (TF32)")
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: cuDNN times its algorithms per input shape, keeps the fastest")
    # [optional: compile]
    parser.add_argument("--compile", action="store_true",
                        help="compile the model with torch.compile: faster steps on GPUs after "
                             "a minute or more of compiling; measured slower on CPU (default: off)")
    # [optional: init-from]
    parser.add_argument("--init-from", default=None,
                        help="start from these weights: a model.pt of any step, a state dict, or "
                             "'pretrained': the task's published weights (pretrained_weights)")
    add_task_arguments(parser)
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="process group backend; auto is nccl with CUDA, gloo without")
    parser.add_argument("--timeout-min", type=float, default=30.0,
                        help="minutes a process waits for the others in a collective before the "
                             "job fails (nccl's own default is 10)")
    # [optional: legacy launcher]
    # torch.distributed.launch passes --local-rank=N (--local_rank before torch 2.0) as well as
    # setting LOCAL_RANK, as torchrun does: the flag is accepted, and LOCAL_RANK read.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help="passed by the legacy launcher, which sets LOCAL_RANK too: "
                             "accepted, not read")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", Path(__file__).stem)
    # The optimizers want rates and decays of different sizes: the chosen one's, unless given.
    for name, value in OPTIMIZER_DEFAULTS[args.optimizer].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# The least value of each numeric setting (None, a default decided later, is not checked), and the
# settings that must be positive.
AT_LEAST = {"epochs": 1, "batch_size": 1, "log_interval": 1, "workers": 0, "weight_decay": 0,
            "warmup_epochs": 0}


POSITIVE = ("lr", "timeout_min")


def check_args(args):
    """Reject settings that cannot work before any process does any work."""
    for name, least in AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    for name in POSITIVE:
        value = getattr(args, name)
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    # [optional: init-from]
    if args.init_from not in (None, "pretrained") and not os.path.isfile(args.init_from):
        raise ConfigError(f"--init-from {args.init_from!r}: no such file")


def set_seed(seed):
    """Seed every generator the training code draws from (Python's and torch's, CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


# --- logging --------------------------------------------------------------------------------------
# Skip on a first reading: what a run prints, and metrics.jsonl.

def log(message):
    """Print on rank 0 only: every process runs this code, and one copy of each line is enough."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def warn(message):
    """A warning from whichever process meets it, not rank 0 alone (another process's files are
    not rank 0's to see): one line on stderr, naming the process."""
    # One write: the lines of processes that warn at once never run together.
    sys.stderr.write(f"{Path(__file__).name}: warning: rank {dist.get_rank()}: {message}\n")


def format_seconds(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def describe(model):
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    return f"{type(model).__name__} ({millions:.2f} M parameters)"


def peak_memory(device):
    """For progress lines: the most memory this process's tensors have held on the GPU so far."""
    if device.type != "cuda":
        return ""
    return f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"


def write_metrics(path, history):
    """Write one JSON object per epoch, a line each, as a whole new file (atomic_save): a crash or a
    full disk leaves the previous version, never half a line."""
    atomic_save("".join(json.dumps(record) + "\n" for record in history).encode(), path)


def log_recipe(args):
    log(f"optimizer {args.optimizer} | lr {args.lr:g}, schedule {args.lr_schedule} | weight decay "
        f"{args.weight_decay:g}")


def log_epoch(record, epochs):
    metrics = " ".join(f"val_{name} {record[f'val_{name}']:.4f}" for name in EVAL_METRICS)
    unreadable = record.get("train_unreadable", 0) + record["val_unreadable"]  # epoch 0: val only
    skipped = f" | unreadable files skipped: {unreadable}" if unreadable else ""
    if record["epoch"] == 0:  # the starting weights of a fine-tuning run: no training yet
        log(f"epoch 0/{epochs} (starting weights) {metrics} ({record['val_samples']} samples)"
            f"{skipped}")
        return
    log(f"epoch {record['epoch']}/{epochs} train_loss {record['train_loss']:.4f} {metrics} "
        f"({record['val_samples']} samples) | {record['samples_per_sec']:.0f} samples/s{skipped}")


if __name__ == "__main__":
    sys.exit(main())
