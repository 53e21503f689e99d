"""Step 2 of the DDP ladder: the same program on every visible GPU with nn.DataParallel.

    python dataparallel.py
    CUDA_VISIBLE_DEVICES=0,1 python dataparallel.py --model resnet18

To train something else, edit the section "your data and model" and nothing else.

DataParallel is the one-line way to use several GPUs, and the wrong way to scale: one Python
process drives every GPU (the GIL serialises the work), the model is copied to every GPU on every
forward, and GPU 0 scatters the inputs, gathers the outputs and computes the loss, so it needs more
memory and time than the others. It does not span machines. PyTorch recommends
DistributedDataParallel (the next step, ddp_basic.py) even on one machine.

BatchNorm under DataParallel: each GPU normalises its own chunk of the batch, and the running
statistics come from GPU 0's chunk alone (the other replicas are discarded after each forward).
A chunk of one sample cannot train BatchNorm at all: torch.chunk splits a batch of 10 on 4 GPUs
as 3,3,3,1 and a short last batch of 16 on 6 GPUs as 3,3,3,3,3,1. The short last batch is dropped;
choose a --batch-size whose chunks hold two samples or more.

A copier's map: what deleting each "# [optional: NAME]" gives up (lean/dataparallel.py: all).
    help formatter    --help stating each flag's default
    value checks      one line before any work for --lr nan, --epochs 0, an unwritable --out-dir
    cifar10           --data cifar10 and --download
    constant lr       --lr-schedule constant: --lr throughout, no warm-up
    atomic writes     the old file kept whole, not half a new one, when a write is cut short
"""
import argparse
import datetime
import json
import math
import os
import random
import sys
import tempfile  # [optional: value checks]
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, Subset, TensorDataset

MOMENTUM = 0.9
# The usual rate and decay of each optimizer: SGD's from the CIFAR recipes; AdamW's rate is
# PyTorch's default, its decay the vision transformer recipes'.
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.03, "weight_decay": 5e-4},
                      "adamw": {"lr": 1e-3, "weight_decay": 0.05}}
EXIT_DIVERGED = 3  # a run stopped because it diverged, told from a crash (1) and bad input (2)


# --- main -----------------------------------------------------------------------------------------

def train(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configure_cuda()
    # The results' folder, made now: one that cannot be made stops the run before training.
    prepare_out_dir(args)
    set_seed(args.seed)  # first: a random split the data section draws is the same in every run
    train_set, val_set, num_outputs = build_datasets(args)
    train_loader, val_loader = build_loaders(args, train_set, val_set, device)
    set_seed(args.seed)  # again: the weights start from the seed alone, whatever the data drew
    model = build_model(args, num_outputs).to(device)
    log(f"device {device} x {max(torch.cuda.device_count(), 1)} | {describe(model)} | "
        f"{len(train_set)} train / {len(val_set)} val")
    if args.compile:
        # Each replica copies the model's attributes, the compiled call among them, which would run
        # the original model, on the first GPU, with every GPU's share of the batch.
        if torch.cuda.device_count() > 1:
            raise ConfigError("--compile does not work with DataParallel over several GPUs: use "
                              "one GPU (CUDA_VISIBLE_DEVICES=0) or ddp_basic.py")
        # In place: the model keeps its class and its state_dict keys (torch.compile(model) would
        # return a wrapper that prefixes every key with "_orig_mod."), so model.pt loads anywhere.
        model.compile()
    # Each forward splits the batch across all visible GPUs and gathers the outputs on the first;
    # with no GPU, DataParallel calls the model as it is.
    model = nn.DataParallel(model)
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer, steps_per_epoch=len(train_loader))
    log(f"global batch {args.batch_size} | {recipe(args)}")

    out_dir, history = Path(args.out_dir), []  # history: metrics.jsonl's records
    for epoch in range(args.epochs):
        # Each epoch's order is a pure function of (seed, epoch): the same in every run.
        train_loader.sampler.generator.manual_seed(args.seed + epoch)
        epoch_start = time.perf_counter()
        train_totals = train_one_epoch(args, model, train_loader, optimizer, scheduler, device,
                                       epoch)
        val_start = time.perf_counter()
        val_totals = evaluate(args, model, val_loader, device)
        record = epoch_record(epoch, train_totals, val_totals, val_start - epoch_start,
                              time.perf_counter() - val_start, scheduler.get_last_lr()[0])
        history.append(record)
        log_epoch(record, args.epochs)
        write_metrics(out_dir / "metrics.jsonl", history)

    # Save the wrapped model's .module: keys without a "module." prefix load into the bare model.
    stop_if_not_finite(args, model.module.state_dict().values(), "model.pt")
    save_file(model.module.state_dict(), out_dir / "model.pt")
    log(f"saved {out_dir / 'model.pt'}")


def main(argv=None):
    try:
        args = parse_args(argv)
        check_args(args)  # [optional: value checks]
        train(args)
    except ConfigError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr, flush=True)
        return err.status
    return 0


# --- train/eval -----------------------------------------------------------------------------------

def train_one_epoch(args, model, loader, optimizer, scheduler, device, epoch):
    """Train for one epoch; return [loss sum, samples] over the epoch."""
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
    return totals


def stop_if_diverged(args, totals, where):
    """The mean loss and count so far; the run stops here, in one line, where training diverged:
    a loss that is not finite (nan, inf) leaves weights that are worth nothing."""
    loss_sum, count = totals.tolist()  # waits for the GPU
    if not math.isfinite(loss_sum):
        raise diverged(args, f"loss {loss_sum / count:g} at {where}")
    return loss_sum / count, count


def stop_if_not_finite(args, tensors, what):
    """The run stops, in one line, rather than write `what` with a value that is not finite."""
    bad = sum(torch.count_nonzero(~t.isfinite()) for t in tensors if t.is_floating_point())
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


# --- data loading ---------------------------------------------------------------------------------

def build_loaders(args, train_set, val_set, device):
    # Workers read and decode files while the model trains; tensors in memory they would only copy.
    workers = args.workers
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        workers = 0 if isinstance(train_set, TensorDataset) else max(1, min(8, cpus - 1))
    loader_args = dict(
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        # Page-locked host memory lets the copy to the GPU run asynchronously (non_blocking=True).
        pin_memory=device.type == "cuda",
        # The loaders' one generator seeds their workers, leaving the global RNG to the model.
        generator=torch.Generator().manual_seed(args.seed),
    )
    # The shuffle draws from a generator of its own, which train() reseeds every epoch.
    train_sampler = RandomSampler(train_set, generator=torch.Generator())
    # A short last batch could leave a GPU one sample, on which BatchNorm fails: it is dropped,
    # fewer than --batch-size samples an epoch, others each epoch.
    if len(train_set) < args.batch_size:
        raise ConfigError(f"--batch-size {args.batch_size} is more than the {len(train_set)} "
                          f"training samples: an epoch would have no batch")
    return (DataLoader(train_set, sampler=train_sampler, drop_last=True, **loader_args),
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
    """An error the user can act on: one line and a non-zero exit, not a traceback."""

    def __init__(self, message, status=2):
        super().__init__(message)
        self.status = status


# [optional: help formatter]
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help states each default; a flag whose default is decided later states it in its help."""

    def _get_help_string(self, a):  # 0 == False: a default of 0 is stated too
        return a.help if a.default is None or a.default is False else super()._get_help_string(a)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.formatter_class = HelpFormatter  # [optional: help formatter]
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step")
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
    add_task_arguments(parser)
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
POSITIVE = ("lr",)  # [optional: value checks]


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
            f", schedule {args.lr_schedule}"  # [optional: constant lr]
            f" | weight decay {args.weight_decay:g}")


def log_epoch(record, epochs):
    metrics = " ".join(f"val_{name} {record[f'val_{name}']:.4f}" for name in EVAL_METRICS)
    log(f"epoch {record['epoch']}/{epochs} train_loss {record['train_loss']:.4f} {metrics} "
        f"({record['val_samples']} samples) | {record['samples_per_sec']:.0f} samples/s")


if __name__ == "__main__":
    sys.exit(main())
