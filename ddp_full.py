"""Step 5 of the DDP ladder: exact distributed validation, checkpoints, exact resume, and clusters.

    torchrun --standalone --nproc_per_node=4 ddp_full.py
    python ddp_full.py                                          # a world of one process
    python -m torch.distributed.launch --nproc_per_node=4 ddp_full.py   # the legacy launcher
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=4 --max-restarts=3 ddp_full.py

Each process holds a full copy of the model, reads its own shard of every epoch
(DistributedSampler), and DDP averages the gradients across processes during backward, so every
copy takes the same optimizer step. Only rank 0 prints and writes files.

--amp runs the forward in bf16 or fp16 (fp16 with a GradScaler); --accum-steps K sums the
gradients of K micro-batches before each optimizer step and all-reduces them once, not K times.

Every process evaluates its own shard of the validation set and one all-reduce of sums gives the
exact metrics of the whole set. Rank 0 writes checkpoints atomically to <out-dir>/checkpoints/;
a restart (--resume auto, the default) continues from the newest readable one and ends bitwise
identical to a run that was never stopped. SIGTERM (preemption) finishes the optimizer step,
writes a checkpoint and exits with status 75 (EX_TEMPFAIL): "requeue me". --bucket-cap-mb and
--gradient-as-bucket-view tune how DDP carries gradients (bench/ measures when they pay).
"""
import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import pickle
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler, Subset, TensorDataset

# torchvision is imported inside the functions that need it: it takes seconds to import, and the
# default run (synthetic data, small CNN) does not use it.

SYNTHETIC_DEFAULTS = {"train": 4096, "val": 1000}
NUM_SYNTHETIC_CLASSES = 10
MOMENTUM = 0.9
AMP_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A resumed run must continue the same run: these settings have to match the checkpoint's.
RESUME_MUST_MATCH = ("model", "data", "seed", "batch_size", "accum_steps", "train_samples", "lr",
                     "weight_decay", "amp", "clip_grad_norm", "image_size")
CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.pt$")
# sysexits.h EX_TEMPFAIL: "try again later". A preempted run exits with it after its checkpoint.
EXIT_REQUEUE = 75


# --- config ------------------------------------------------------------------------------------

class ConfigError(Exception):
    """Bad input from the user: reported as one line and a non-zero exit, never as a traceback."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set (default: 5)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per process per optimizer step; the global batch is batch size x "
                             "world size x accumulation steps (default: 64)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate for the global batch, used as given (default: 0.05)")
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay (default: 5e-4)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the model, the synthetic data and the shuffle (default: 0)")
    parser.add_argument("--data", choices=["synthetic", "cifar10", "imagefolder"], default="synthetic",
                        help="data set (default: synthetic)")
    parser.add_argument("--data-dir", default="data",
                        help="root of cifar10, or of an image tree with train/<class>/* and val/<class>/* "
                             "(default: data)")
    parser.add_argument("--download", action="store_true", help="download cifar10 into --data-dir if missing")
    parser.add_argument("--train-samples", type=int, default=None,
                        help="size of the synthetic training set, a cap on a real one "
                             f"(default: {SYNTHETIC_DEFAULTS['train']} synthetic, all real)")
    parser.add_argument("--val-samples", type=int, default=None,
                        help="size of the synthetic validation set, a cap on a real one "
                             f"(default: {SYNTHETIC_DEFAULTS['val']} synthetic, all real)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="side of the square images fed to the model, imagefolder only (default: 32)")
    parser.add_argument("--model", choices=["cnn", "resnet18"], default="cnn",
                        help="cnn: small and fast, no batch statistics; resnet18: torchvision's (default: cnn)")
    parser.add_argument("--workers", type=int, default=None,
                        help="data loader processes (default: 0 for synthetic data, already in memory, "
                             "where workers only add copies; 2 for image files)")
    parser.add_argument("--out-dir", default=None,
                        help="where model.pt and metrics.jsonl go (default: runs/<script name>)")
    parser.add_argument("--log-interval", type=int, default=20,
                        help="optimizer steps between progress lines (default: 20)")
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                        help="autocast the forward to this precision; fp16 adds a GradScaler (default: none)")
    parser.add_argument("--accum-steps", type=int, default=1,
                        help="micro-batches whose gradients are summed before each optimizer step (default: 1)")
    parser.add_argument("--clip-grad-norm", type=float, default=0.0,
                        help="clip the global gradient norm to this value; 0 turns clipping off (default: 0)")
    parser.add_argument("--resume", default="auto",
                        help="auto: continue from the newest readable checkpoint in <out-dir>/checkpoints "
                             "if there is one; none: start afresh; or the path of a checkpoint (default: auto)")
    parser.add_argument("--ckpt-steps", type=int, default=0,
                        help="also write a checkpoint every this many optimizer steps; 0: only at the ends "
                             "of epochs (default: 0)")
    parser.add_argument("--ckpt-epochs", type=int, default=1,
                        help="write a checkpoint every this many epochs and after the last; 0: only after "
                             "the last (default: 1)")
    parser.add_argument("--keep-last", type=int, default=3,
                        help="checkpoints kept in <out-dir>/checkpoints; older ones are deleted (default: 3)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="stop after this many optimizer steps in all, with a checkpoint to resume from; "
                             "0: no limit (default: 0)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP gradient bucket size in MB: larger buckets mean fewer, bigger all-reduces "
                             "(default: 25, DDP's)")
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="DDP keeps gradients as views into its all-reduce buckets, saving a copy and "
                             "the memory of one set of gradients (default: off, DDP's)")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="process group backend; auto is nccl with CUDA, gloo without (default: auto)")
    # torch.distributed.launch passes --local-rank=N (--local_rank before torch 2.0); torchrun sets
    # the LOCAL_RANK environment variable instead, which wins when both are present.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help="set by the legacy launcher; torchrun sets LOCAL_RANK (default: from the environment)")
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = 0 if args.data == "synthetic" else 2
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", Path(__file__).stem)
    return args


def check_args(args):
    """Reject settings that cannot work before any process does any work."""
    for name in ("epochs", "batch_size", "log_interval", "accum_steps", "keep_last"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("train_samples", "val_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0:
        raise ConfigError(f"--workers must be 0 or more, got {args.workers}")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if args.clip_grad_norm < 0:
        raise ConfigError(f"--clip-grad-norm must be 0 (off) or positive, got {args.clip_grad_norm}")
    if args.bucket_cap_mb <= 0:
        raise ConfigError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    for name in ("ckpt_steps", "ckpt_epochs", "max_steps"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 (off) or more, got {getattr(args, name)}")
    if args.resume not in ("auto", "none") and not os.path.isfile(args.resume):
        raise ConfigError(f"--resume {args.resume!r}: no such checkpoint file")


def set_seed(seed):
    """Seed every generator the training code draws from (Python's and torch's, CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


# --- logging -----------------------------------------------------------------------------------

def log(message):
    """Print on rank 0 only: every process runs this code, and one copy of each line is enough."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def format_seconds(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def write_metrics(path, record):
    """Append one JSON object per line: a file that survives a crash up to its last complete line."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# --- distributed -------------------------------------------------------------------------------

def setup_distributed(args):
    """Join the process group; return (rank, local_rank, world_size, device).

    torchrun sets RANK (this process among all), LOCAL_RANK (among those on this machine) and
    WORLD_SIZE. Without them, as under plain `python`, this process is a world of one.
    """
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA GPUs and none is available; use --backend gloo on CPU")
    launched = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                              f"start at most one process per GPU")
        # One GPU per process: set_device makes "cuda" mean this process's GPU, for nccl too.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launched:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, local_rank, world_size, device


def rank0_only(rank, function, *args):
    """Call function on rank 0 alone; a ConfigError it raises stops every process with the same line.

    The others wait for rank 0's verdict in a collective rather than a barrier: a ConfigError on
    rank 0 then stops every process with the same error, and none is left waiting on a peer that
    has exited.
    """
    result, verdict = None, [None]
    if rank == 0:
        try:
            result = function(*args)
        except ConfigError as err:
            verdict = [str(err)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
    return result


def rank0_first(rank, function, *args):
    """Call function on rank 0 first (a download, say), then on the others, so no two write the same files."""
    result = rank0_only(rank, function, *args)
    return result if rank == 0 else function(*args)


def cleanup_distributed():
    """Leave the process group after the DDP model is gone.

    gloo can abort a worker at exit ("terminate called without an active exception") while a DDP
    model is still alive at destroy_process_group(): the caller's model and optimizer are out of
    scope by now, and collecting garbage releases them before the group goes.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


class Preemption:
    """Turns SIGTERM into a request to stop at the next optimizer step that all processes agree on.

    Schedulers (SLURM, Kubernetes) send SIGTERM some time before SIGKILL, and torchrun forwards it
    to every worker. Processes can see it at different steps, so each step they all-reduce the flag
    on a CPU (gloo) group, which costs no GPU synchronisation; then all stop at the same step and
    no collective is left half-entered.
    """

    def __init__(self):
        self.requested = False
        self.group = dist.new_group(backend="gloo")
        signal.signal(signal.SIGTERM, self.request)

    def request(self, signum, frame):
        self.requested = True

    def agreed(self):
        flag = torch.tensor([float(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() > 0


# --- data --------------------------------------------------------------------------------------

def make_synthetic(num_samples, seed, split):
    """Images of 3x32x32 in 10 classes, a pure function of (num_samples, seed, split).

    Each class is a smooth colour pattern drawn from `seed`; a sample is its class pattern under
    strong noise, so a model has to learn (accuracy starts at chance) but can (it rises well above).
    The generators are private: building data never moves the global RNG that seeds the model.
    """
    patterns = torch.randn(NUM_SYNTHETIC_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=(32, 32), mode="bilinear", align_corners=False)
    generator = torch.Generator().manual_seed(seed * 2 + {"train": 1, "val": 2}[split])
    labels = torch.randint(NUM_SYNTHETIC_CLASSES, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, 3, 32, 32, generator=generator)
    images = 0.4 * patterns[labels] + noise
    return TensorDataset(images, labels)


def build_datasets(args):
    """Return (train_set, val_set, num_classes); a missing or empty data directory is a ConfigError."""
    if args.data == "synthetic":
        train_set = make_synthetic(args.train_samples or SYNTHETIC_DEFAULTS["train"], args.seed, "train")
        val_set = make_synthetic(args.val_samples or SYNTHETIC_DEFAULTS["val"], args.seed, "val")
        return train_set, val_set, NUM_SYNTHETIC_CLASSES
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    if args.data == "cifar10":
        normalize = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        val_tf = T.Compose([T.ToTensor(), normalize])
        try:
            train_set = datasets.CIFAR10(args.data_dir, train=True, transform=train_tf, download=args.download)
            val_set = datasets.CIFAR10(args.data_dir, train=False, transform=val_tf, download=args.download)
        except RuntimeError as err:  # torchvision's "Dataset not found or corrupted"
            raise ConfigError(f"cifar10 not found in {args.data_dir!r} ({err}); add --download") from None
        num_classes = 10
    else:
        normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        train_tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                              normalize])
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


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can begin an epoch part-way through, for an exact mid-epoch resume."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_start(self, start):
        """Skip the first `start` samples of this process's share of the epoch."""
        self.start = start

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self):
        return self.num_samples - self.start


class ShardSampler(Sampler):
    """Every world_size-th index from rank, in order and without padding: each sample once, on one process.

    DistributedSampler pads the set with repeated samples until it divides evenly; counted in
    validation, those repeats skew the metrics. torch ships no sampler without padding.
    """

    def __init__(self, dataset, num_replicas, rank):
        self.indices = range(rank, len(dataset), num_replicas)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def build_loaders(args, train_set, val_set, device, rank, world_size):
    # Every process draws the same permutation of (seed, epoch) and takes every world_size-th
    # sample of it from position rank: together they see what one process would see. It pads
    # with repeated samples until the set divides evenly, so every process runs as many steps.
    train_sampler = ResumableDistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                                seed=args.seed)
    loader_args = dict(
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        # Page-locked host memory lets the copy to the GPU run asynchronously (non_blocking=True).
        pin_memory=device.type == "cuda",
        # The loader's own generator seeds its workers, leaving the global RNG to the model.
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    train_loader = DataLoader(train_set, sampler=train_sampler, **loader_args)
    val_loader = DataLoader(val_set, sampler=ShardSampler(val_set, world_size, rank), **loader_args)
    return train_loader, val_loader


# --- model -------------------------------------------------------------------------------------

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


def build_model(args, num_classes):
    if args.model == "resnet18":
        import torchvision.models as models

        return models.resnet18(num_classes=num_classes)
    return SmallCNN(num_classes)


# --- train/eval --------------------------------------------------------------------------------

def train_one_epoch(args, model, loader, optimizer, scaler, device, epoch, state, save, preemption):
    """Train for the rest of one epoch; return [sum of losses, number of samples] over the epoch, all
    processes, or None if the run stops before its end (a checkpoint is written first)."""
    model.train()
    # This process's sums so far in the epoch: zero at its start, restored from a mid-epoch checkpoint.
    totals = state["train_totals"]
    first_batch = state["step_in_epoch"] * args.accum_steps
    num_batches = first_batch + len(loader)
    num_steps = math.ceil(num_batches / args.accum_steps)
    start = time.perf_counter()
    start_samples = totals[1].item()
    for batch_index, (images, labels) in enumerate(loader, start=first_batch):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        # Micro-batches form groups of accum_steps; the epoch's last group may be shorter.
        group_start = batch_index - batch_index % args.accum_steps
        group_size = min(args.accum_steps, num_batches - group_start)
        last_in_group = batch_index == group_start + group_size - 1
        # DDP decides during the forward whether the coming backward all-reduces, so no_sync must
        # cover the forward and the backward of every micro-batch but the group's last.
        sync_context = contextlib.nullcontext() if last_in_group else model.no_sync()
        with sync_context:
            with torch.autocast(device.type, dtype=AMP_DTYPES[args.amp], enabled=args.amp != "none"):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
            # Dividing by the group's size makes the summed gradients the mean over the group.
            scaler.scale(loss / group_size).backward()
        # A sum weighted by batch size, so a short last batch counts for what it holds.
        totals[0] += loss.detach().double() * labels.numel()
        totals[1] += labels.numel()
        if not last_in_group:
            continue
        if args.clip_grad_norm > 0:
            # Clip the true gradients: unscale_ divides out fp16's loss scale first (once per step).
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        # With fp16, step() skips the update when a gradient overflowed and update() adapts the scale;
        # without a scaler (none, bf16) they are a plain optimizer.step() and nothing.
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step = batch_index // args.accum_steps + 1
        state["step_in_epoch"] = step
        state["global_step"] += 1
        if step % args.log_interval == 0 or step == num_steps:
            elapsed = time.perf_counter() - start
            samples = totals[1].item()
            # Rank 0's own loss, and its throughput times the number of processes.
            log(f"epoch {epoch + 1}/{args.epochs} step {step}/{num_steps} "
                f"loss {totals[0].item() / samples:.4f} | "
                f"{(samples - start_samples) * dist.get_world_size() / elapsed:.0f} samples/s | "
                f"eta {format_seconds(elapsed / (step - first_batch // args.accum_steps) * (num_steps - step))}")
        if step == num_steps:
            break  # the epoch's end: validation and its checkpoint follow
        stop = should_stop(args, state, preemption)
        if stop or (args.ckpt_steps and state["global_step"] % args.ckpt_steps == 0):
            save()
        if stop:
            state["stop"] = stop
            return None
    # One all-reduce after the loop turns per-process sums into global ones.
    epoch_totals = totals.clone()
    dist.all_reduce(epoch_totals)
    return epoch_totals


def should_stop(args, state, preemption):
    """Why to stop now, the same on every process: "preempted" (SIGTERM seen by any process),
    "max-steps" (--max-steps reached), or None to go on."""
    if preemption.agreed():
        return "preempted"
    if args.max_steps > 0 and state["global_step"] >= args.max_steps:
        return "max-steps"
    return None


@torch.no_grad()
def evaluate(args, model, loader, device):
    """Return [sum of losses, number correct, number of samples] over the loader.

    Sums, not means: a mean over batches of different sizes is not the mean over samples.
    This process evaluates its shard; one all-reduce of the sums gives the whole set's.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=AMP_DTYPES[args.amp], enabled=args.amp != "none"):
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
    model.train()
    dist.all_reduce(totals)
    return totals


# --- checkpointing -----------------------------------------------------------------------------

def prepare_out_dir(args):
    """Create --out-dir and make sure a file can be written there, before any time goes into training."""
    try:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        # Writing a file is the one sure test: permissions, read-only mounts and a file standing
        # where the directory should be all fail here, in one line, instead of after the last epoch.
        with tempfile.TemporaryFile(dir=args.out_dir):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write to --out-dir {args.out_dir}: {err.strerror or err}")


def atomic_save(obj, path):
    """Write to a temporary file, then rename: a reader sees the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def rng_state():
    """This process's global random generators: Python's and torch's (CPU, and CUDA if used)."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(args, model, optimizer, scaler, state, rank, world_size):
    """Write everything an exact resume needs; every process calls this, rank 0 writes the file.

    The random generators and the partial sums differ between processes: rank 0 gathers them.
    """
    per_rank = {"rng": rng_state(), "loader_rng": state["loader_rng"], "train_totals": state["train_totals"].cpu()}
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(per_rank, gathered, dst=0)
    if rank != 0:
        return
    checkpoint = {
        # The unwrapped model: no "module." prefix, so it loads into the bare model too.
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": state["epoch"],
        "step_in_epoch": state["step_in_epoch"],
        "global_step": state["global_step"],
        "world_size": world_size,
        "config": {name: getattr(args, name) for name in RESUME_MUST_MATCH},
        "history": state["history"],
        "rank_states": gathered,
    }
    ckpt_dir = Path(args.out_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{state['global_step']:09d}.pt"
    atomic_save(checkpoint, path)
    for old in list_checkpoints(ckpt_dir)[args.keep_last:]:
        old.unlink()
    where = (f"epoch {state['epoch'] + 1} step {state['step_in_epoch']}" if state["step_in_epoch"]
             else f"end of epoch {state['epoch']}")
    log(f"checkpoint {path} ({where})")


def list_checkpoints(ckpt_dir):
    """Complete checkpoints, newest first. A write in progress has another name until its rename."""
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).glob("step_*.pt")
             if (m := CHECKPOINT_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path, args, world_size, device):
    """Read and check a checkpoint; anything wrong with it is a ConfigError naming the file."""
    try:
        # weights_only: tensors and plain containers only, so loading a file runs no code from it.
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "the file is empty or truncated"
        raise ConfigError(f"checkpoint {path} cannot be read: {reason}") from None
    if not isinstance(checkpoint, dict) or "rank_states" not in checkpoint:
        raise ConfigError(f"checkpoint {path} was not written by this script")
    for name in RESUME_MUST_MATCH:
        if checkpoint["config"].get(name) != getattr(args, name):
            raise ConfigError(f"checkpoint {path} is from a run with --{name.replace('_', '-')} "
                              f"{checkpoint['config'].get(name)}, this run has {getattr(args, name)}")
    if checkpoint["world_size"] != world_size:
        raise ConfigError(f"checkpoint {path} was written by {checkpoint['world_size']} processes, this run "
                          f"has {world_size}: resume with the same number (the data position and random "
                          f"state are per process)")
    return checkpoint


def find_checkpoint(args, world_size, device):
    """The checkpoint to resume from and its path, or (None, None) to start afresh."""
    if args.resume == "none":
        return None, None
    if args.resume != "auto":
        return load_checkpoint(args.resume, args, world_size, device), args.resume
    candidates = list_checkpoints(Path(args.out_dir) / "checkpoints")
    reasons = []
    for path in candidates:
        try:
            return load_checkpoint(path, args, world_size, device), path
        except ConfigError as err:
            # A torn or foreign file is reported and passed over for the one before it.
            log(f"skipping: {err}")
            reasons.append(str(err))
    if candidates:
        raise ConfigError(f"no usable checkpoint in {Path(args.out_dir) / 'checkpoints'} (newest: {reasons[0]}); "
                          f"use --resume none to start afresh (old checkpoints may then be deleted) or another "
                          f"--out-dir")
    return None, None


def restore(checkpoint, path, model, optimizer, scaler, rank, device):
    """Load a checkpoint into this process; return the training state it holds."""
    try:
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"checkpoint {path} does not fit this model: {str(err).strip().splitlines()[0]}") from None
    scaler.load_state_dict(checkpoint["scaler"])
    per_rank = checkpoint["rank_states"][rank]
    set_rng_state(per_rank["rng"])
    return {
        "epoch": checkpoint["epoch"],
        "step_in_epoch": checkpoint["step_in_epoch"],
        "global_step": checkpoint["global_step"],
        "history": checkpoint["history"],
        "loader_rng": per_rank["loader_rng"],
        "train_totals": per_rank["train_totals"].to(device, torch.float64),
    }


# --- main --------------------------------------------------------------------------------------

def train(args):
    rank, local_rank, world_size, device = setup_distributed(args)
    # Rank 0 writes the results: if it cannot, every process stops now, not after training.
    rank0_only(rank, prepare_out_dir, args)
    set_seed(args.seed)
    train_set, val_set, num_classes = rank0_first(rank, build_datasets, args)
    if len(train_set) < world_size:
        raise ConfigError(f"{world_size} processes but only {len(train_set)} training samples: "
                          f"every process needs at least one")
    train_loader, val_loader = build_loaders(args, train_set, val_set, device, rank, world_size)
    model = build_model(args, num_classes).to(device)
    # DDP broadcasts rank 0's weights at construction and averages gradients during backward.
    # device_ids names the one GPU this process drives; on CPU it must be left out.
    # Bucket size and gradient views change how gradients travel, not what is averaged (at most the
    # rounding of the sum on over 2 processes); bench/ shows they pay where all-reduces are large.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=args.weight_decay)
    # fp16 needs loss scaling (small gradients underflow in fp16); bf16 has fp32's range and does
    # not. A disabled scaler passes everything through, so one code path serves all three.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    # The weights came from the same seed everywhere; from here on each process draws its own
    # random numbers (dropout, augmentation), or all of them would repeat one draw.
    set_seed(args.seed + rank)
    # Every process reads the checkpoint itself (a shared file system), so all of them fail alike on
    # a bad one, and all of them restore their own random state.
    checkpoint, checkpoint_path = find_checkpoint(args, world_size, device)
    if checkpoint is None:
        state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "history": [],
                 "loader_rng": train_loader.generator.get_state(),
                 "train_totals": torch.zeros(2, dtype=torch.float64, device=device)}
    else:
        state = restore(checkpoint, checkpoint_path, model, optimizer, scaler, rank, device)
        train_loader.generator.set_state(state["loader_rng"])
        del checkpoint
    preemption = Preemption()

    def save():
        save_checkpoint(args, model, optimizer, scaler, state, rank, world_size)

    out_dir = Path(args.out_dir)
    metrics_path = out_dir / "metrics.jsonl"
    if rank == 0:
        # A resumed run rewrites the records of the epochs its checkpoint has seen, no more, no fewer.
        metrics_path.write_text("".join(json.dumps(record) + "\n" for record in state["history"]))
    log(f"device {device} | model {args.model} | {len(train_set)} train / {len(val_set)} val samples")
    # Read back from DDP itself, so the line shows what DDP was given.
    log(f"DDP buckets of {model.bucket_bytes_cap / 2**20:.3g} MB | gradients as bucket views: "
        f"{'yes' if model.gradient_as_bucket_view else 'no'}")
    log(f"global batch {args.batch_size * world_size * args.accum_steps} = {args.batch_size} per process "
        f"x {world_size} processes x {args.accum_steps} accumulation steps | amp {args.amp}")
    if checkpoint_path is not None:
        log(f"resumed from {checkpoint_path}: epoch {state['epoch'] + 1}, step {state['step_in_epoch']}")

    for epoch in range(state["epoch"], args.epochs):
        # Without set_epoch the sampler repeats epoch 0's order in every epoch.
        train_loader.sampler.set_epoch(epoch)
        # A resumed epoch skips the samples its first steps consumed, on every process.
        train_loader.sampler.set_start(state["step_in_epoch"] * args.accum_steps * args.batch_size)
        state["epoch"] = epoch
        # Starting an iterator draws from the loader's generator: a mid-epoch resume replays that draw.
        state["loader_rng"] = train_loader.generator.get_state()
        # Every process trains on as many samples: rank 0's count times world_size is the global one.
        samples_before = state["train_totals"][1].item() * world_size
        epoch_start = time.perf_counter()
        train_totals = train_one_epoch(args, model, train_loader, optimizer, scaler, device, epoch, state,
                                       save, preemption)
        train_seconds = time.perf_counter() - epoch_start
        if train_totals is None:
            return stopped(args, state)
        # Every process evaluates its shard through model.module: shards differ in length, and the
        # DDP wrapper's forward starts a collective (a buffer broadcast) that would then go unmatched.
        val_totals = evaluate(args, model.module, val_loader, device)
        record = {
            "epoch": epoch + 1,
            "train_loss": train_totals[0].item() / train_totals[1].item(),
            "val_loss": val_totals[0].item() / val_totals[2].item(),
            "val_acc": val_totals[1].item() / val_totals[2].item(),
            "val_samples": int(val_totals[2].item()),
            "samples_per_sec": (train_totals[1].item() - samples_before) / train_seconds,
        }
        state["history"].append(record)
        state.update(epoch=epoch + 1, step_in_epoch=0, loader_rng=train_loader.generator.get_state())
        state["train_totals"] = torch.zeros(2, dtype=torch.float64, device=device)
        stop = should_stop(args, state, preemption) if epoch + 1 < args.epochs else None
        if stop or epoch + 1 == args.epochs or (args.ckpt_epochs and (epoch + 1) % args.ckpt_epochs == 0):
            save()
        if rank == 0:
            write_metrics(metrics_path, record)
        log(f"epoch {record['epoch']}/{args.epochs} train_loss {record['train_loss']:.4f} "
            f"val_loss {record['val_loss']:.4f} val_acc {record['val_acc']:.2%} "
            f"({record['val_samples']} samples) | {record['samples_per_sec']:.0f} samples/s")
        if stop:
            state["stop"] = stop
            return stopped(args, state)

    if rank == 0:
        # Save the unwrapped model: its keys have no "module." prefix and load into the bare model.
        atomic_save(model.module.state_dict(), out_dir / "model.pt")
        log(f"saved {out_dir / 'model.pt'}")
    return 0


def stopped(args, state):
    """Report a stop before the last epoch's end; return the exit status a scheduler should see."""
    if state["stop"] == "preempted":
        log(f"preempted at step {state['global_step']}: checkpoint written; requeue with the same command "
            f"(exit status {EXIT_REQUEUE})")
        return EXIT_REQUEUE
    log(f"stopped after --max-steps {args.max_steps}: checkpoint written; the same command without "
        f"--max-steps continues the run")
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        check_args(args)
        status = train(args)
    except ConfigError as err:
        # Every process meets the same bad input; one line from rank 0 is enough.
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{Path(__file__).name}: error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        cleanup_distributed()
    return status


if __name__ == "__main__":
    sys.exit(main())
