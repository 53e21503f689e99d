"""Step 5 of the DDP ladder: exact distributed validation, checkpoints, exact resume, and clusters.

    torchrun --standalone --nproc_per_node=4 ddp_full.py
    python ddp_full.py                                          # a world of one process
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=N --nproc_per_node=4 \
        --rdzv-backend=c10d --rdzv-endpoint=FIRST_NODE:29500 --rdzv-id=JOB_ID --max-restarts=3 \
        ddp_full.py --out-dir /shared/run    # on each of N nodes; a restart resumes by itself
    (without the variable, restarts often fail on stale rendezvous keys: pytorch#135712)
    # [optional: legacy launcher]
    python -m torch.distributed.launch --nproc_per_node=4 ddp_full.py   # the legacy launcher

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
# [optional: primed buckets]
On 3 or more processes too: a throwaway step first has DDP sum in the buckets the run had.
# [optional: seeded samples]
With augmenting workers too: augmentation is seeded per sample, the same in any worker.
# [optional: preemption, mid-epoch]
SIGTERM (preemption) stops every process at the same batch, checkpoints and exits 75: requeue me.

A copier's map: a part tagged "# [optional: NAME]" may be deleted whole: a tag alone on its
line with the statement under it (in a docstring, the lines to a blank line), a tag ending a
line with that line. tools/strip_optional.py makes lean/ddp_full.py, which tests/test_copiers_map.py
shows to train the same weights, resume bitwise and validate exactly. What each NAME gives up:
    init-from         --init-from: fine-tuning from a model.pt, a state dict or pretrained weights
    sync-bn           --sync-bn: BatchNorm statistics of the global batch
    buckets           --bucket-cap-mb, --gradient-as-bucket-view: tuning DDP's buckets
    grad compression  --grad-compression: gradients all-reduced in 16 bits, half the bytes
    unused params     --find-unused-parameters: for a model whose steps leave parameters out
    legacy launcher   python -m torch.distributed.launch (--local-rank)
    model check       one line, not a traceback midway, for a model that cannot take the data
    section check     one line, not a NameError, where "your data and model" lacks a name used
    full disk         a failed write: one line, what is intact, exit 74 (goes with atomic writes)
    unreadable files  an image that cannot be read is skipped with a warning, not a fatal traceback
    seeded samples    random augmentation the same in any process or worker, after any resume
    mid-epoch         --ckpt-steps and --max-steps: checkpoints, stops and resumes within an epoch
    preemption        SIGTERM: a checkpoint at the next batch, exit status 75 (goes with mid-epoch)
    deterministic     --deterministic: runs and resumes that repeat bit for bit on GPUs (slower)
    flight recorder   a GPU timeout writes nccl's last collectives to --out-dir (troubleshooting.md)
    process failures  a restore failing in this process: its own line and exit 1, not exit 2
    error exchange    an error in rank0_only or rank0_first stops every process at once, in one line
    help formatter    --help stating each flag's default
    value checks      one line before any work for --lr nan, --epochs 0, an unwritable --out-dir
    cifar10           --data cifar10 and --download
    constant lr       --lr-schedule constant: --lr throughout, no warm-up
    atomic writes     the old file kept whole, not half a new one, when a write is cut short
    global batch      --global-batch-size: the global batch kept on any number of processes
    primed buckets    a resume on 3+ processes bitwise too (DDP re-buckets after a run's first step)
    divergence note   a restart after a divergence stops at once; a resume from it may lower --lr
    profile           --profile: a trace of a few steps per process, and where each one's time went
"""
import argparse
import atexit  # [optional: profile]
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import random
import re
import shutil  # [optional: full disk]
import signal  # [optional: preemption, mid-epoch]
import sys
import tempfile  # [optional: value checks]
import time
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
# [optional: grad compression]
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
                     "ckpt_steps", "max_steps",  # [optional: mid-epoch]
                     "bucket_cap_mb", "gradient_as_bucket_view",  # [optional: buckets]
                     "grad_compression",  # [optional: grad compression]
                     "find_unused_parameters",  # [optional: unused params]
                     "local_rank",  # [optional: legacy launcher]
                     "init_from",  # [optional: init-from]
                     "backend", "timeout_min", "compile", "channels_last", "tf32",
                     "cudnn_benchmark")
# [optional: divergence note]
# What tames a diverging run: a resume from the checkpoint before a divergence may change them.
TAMING = ("lr", "warmup_epochs", "clip_grad_norm", "amp")
CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.pt$")
EXIT_DIVERGED = 3  # a run stopped because it diverged, told from a crash (1) and bad input (2)
# [optional: full disk]
# sysexits.h's EX_IOERR: a failed write (full disk), told from bad input 2, crash 1, preemption 75.
EXIT_WRITE_FAILED = 74
# [optional: preemption, mid-epoch]
# sysexits.h's EX_TEMPFAIL, "try again later": a preempted run exits with it after its checkpoint.
EXIT_REQUEUE = 75
# [optional: unreadable files]
# What reading a broken file raises: OSError (PIL's UnidentifiedImageError, a truncated image, a
# file gone) and, from PIL for a PNG with a broken chunk, SyntaxError. Anything else is a bug.
UNREADABLE = (OSError, SyntaxError)
# [optional: unreadable files]
# More unreadable samples in a row than this, and the data set is broken, not a file in it.
MAX_UNREADABLE_IN_A_ROW = 16


# --- main -----------------------------------------------------------------------------------------

def train(args):
    rank, local_rank, world_size, device = setup_distributed(args)
    args.accum_steps = accum_steps_for(args, world_size)  # [optional: global batch]
    configure_cuda(args, device)
    if args.accum_steps < 1:  # 0 divides by zero; below it no group ends, so no step is ever taken
        raise ConfigError(f"--accum-steps must be at least 1, got {args.accum_steps}")
    # Rank 0 writes the results: a folder it cannot make stops the run now, not after training.
    rank0_only(rank, prepare_out_dir, args)
    set_seed(args.seed)  # first: a random split the data section draws is the same in every run
    train_set, val_set, num_outputs = rank0_first(rank, build_datasets, args)
    # [optional: model check]
    check_model_fits(args, num_outputs, train_set, val_set, world_size)
    train_loader, val_loader = build_loaders(args, train_set, val_set, device, rank, world_size)
    # The checkpoint to resume from, or None: every process must find the same one.
    checkpoint, checkpoint_path = agreed_checkpoint(args, world_size)
    set_seed(args.seed)  # again: the weights start from the seed alone, whatever the data drew
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = build_model(args, num_outputs).to(device, memory_format=layout)
    # [optional: init-from]
    if args.init_from and checkpoint is None:
        # Rank 0 reads the weights; DDP hands them to every process when it wraps the model.
        rank0_only(rank, init_weights_from, args, model)
    log(f"device {device} | {describe(model)} | {len(train_set)} train / {len(val_set)} val")
    if args.compile:
        # In place, before DDP wraps it: dynamo skips torch.nn's code, so a compiled wrapper would
        # skip DDP's forward and an nn.Sequential model's. DDP cuts the compiled model at buckets.
        model.compile()
    model = sync_batchnorm(args, model, device)  # [optional: sync-bn]
    # DDP broadcasts rank 0's weights at construction and averages gradients during backward.
    model = DDP(model,
                bucket_cap_mb=args.bucket_cap_mb,  # [optional: buckets]
                gradient_as_bucket_view=args.gradient_as_bucket_view,  # [optional: buckets]
                find_unused_parameters=args.find_unused_parameters,  # [optional: unused params]
                device_ids=[local_rank] if device.type == "cuda" else None)  # its GPU; on CPU none
    compress_gradients(args, model)  # [optional: grad compression]
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer, math.ceil(len(train_loader) / args.accum_steps))
    # fp16 needs loss scaling (small gradients underflow in fp16); bf16 has fp32's range and does
    # not. A disabled scaler passes everything through, so one code path serves all three.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    # The weights came from the same seed everywhere; from here on each process draws its own
    # random numbers (dropout, augmentation), or all of them would repeat one draw.
    set_seed(args.seed + rank)
    start_profiler(args, optimizer, device, rank)  # [optional: profile]
    state = start_or_resume(args, checkpoint, checkpoint_path, model, optimizer, scheduler,
                            scaler, train_loader, rank)
    del checkpoint  # all it holds is restored now: free its memory
    # [optional: init-from]
    if args.init_from and checkpoint_path is None:
        # The starting weights' score, what fine-tuning must improve on: epoch 0 in metrics.jsonl.
        val_totals = evaluate(args, model.module, val_loader, device)
        state.history.append({"epoch": 0, **val_record(val_totals)})
        log_epoch(state.history[-1], args.epochs)
    log(f"process group {dist.get_backend()} | {world_size} processes | "
        f"timeout {args.timeout_min:g} min")
    # [optional: buckets]
    # They change how gradients travel, not what is averaged (the sum's rounding at most): bench/.
    log(f"DDP buckets of {model.bucket_bytes_cap / 2**20:.3g} MB | gradients as bucket views: "
        f"{'yes' if model.gradient_as_bucket_view else 'no'}")
    log(f"global batch {args.batch_size * world_size * args.accum_steps} = {args.batch_size} per "
        f"process x {world_size} processes x {args.accum_steps} accumulation steps | "
        f"amp {args.amp} | {recipe(args)}")
    out_dir = Path(args.out_dir)
    # A resumed run rewrites the records of the epochs its checkpoint has seen, no more.
    rank0_only(rank, write_metrics, out_dir / "metrics.jsonl", state.history)
    log_resume(args, checkpoint_path, state)
    # [optional: mid-epoch]
    if 0 < args.max_steps <= state.global_step:  # a requeued job: the same command, no step more
        log(f"nothing to train: the run already took {state.global_step} optimizer steps, "
            f"--max-steps {args.max_steps}; without it (or with a larger one) the run continues")
        return 0
    # [optional: preemption, mid-epoch]
    PREEMPTION.start(datetime.timedelta(minutes=args.timeout_min))

    for epoch in range(state.epoch, args.epochs):
        # Without set_epoch the sampler repeats epoch 0's order in every epoch.
        train_loader.sampler.set_epoch(epoch)
        # [optional: mid-epoch]
        # A resumed epoch skips the samples its first steps consumed, on every process.
        train_loader.sampler.set_start(state.epoch_position)
        epoch_start = time.perf_counter()
        epoch_start -= state.train_seconds  # [optional: mid-epoch]
        train_totals = train_one_epoch(args, model, train_loader, optimizer, scheduler, scaler,
                                       device, state)
        # [optional: mid-epoch]
        if train_totals is None:  # every process stops at this step: --max-steps, or SIGTERM
            return stop_run(args, model, optimizer, scheduler, scaler, state)
        # Every process evaluates its shard through model.module: shards differ in length, and
        # the DDP wrapper's forward starts a collective (a buffer broadcast) left unmatched.
        val_start = time.perf_counter()
        val_totals = evaluate(args, model.module, val_loader, device)
        # [optional: preemption, mid-epoch]
        if val_totals is None:  # SIGTERM in validation: the checkpoint has validation to come
            return stop_run(args, model, optimizer, scheduler, scaler, state)
        record = epoch_record(epoch, train_totals, val_totals, val_start - epoch_start,
                              time.perf_counter() - val_start, scheduler.get_last_lr()[0])
        state.history.append(record)
        # The next epoch begins: from here on a checkpoint resumes at its start.
        state.epoch, state.rng = epoch + 1, rng_state()
        # [optional: mid-epoch]
        state.step_in_epoch, state.epoch_position, state.train_seconds = 0, 0, 0.0
        state.train_unreadable = 0  # [optional: unreadable files]
        log_epoch(record, args.epochs)
        rank0_only(rank, write_metrics, out_dir / "metrics.jsonl", state.history)
        # [optional: mid-epoch]
        if epoch + 1 < args.epochs and 0 < args.max_steps <= state.global_step:
            return stop_run(args, model, optimizer, scheduler, scaler, state)
        if epoch + 1 == args.epochs or (args.ckpt_epochs and (epoch + 1) % args.ckpt_epochs == 0):
            save_checkpoint(args, model, optimizer, scheduler, scaler, state)

    # Save the unwrapped model: its keys have no "module." prefix and load into the bare model.
    stop_if_not_finite(args, model.module.state_dict().values(), "model.pt")
    rank0_only(rank, save_file, model.module.state_dict(), out_dir / "model.pt")
    log(f"saved {out_dir / 'model.pt'}")
    return 0


def main(argv=None):
    try:
        # [optional: section check]
        check_task()
        args = parse_args(argv)
        check_args(args)  # [optional: value checks]
        return train(args)
    except ConfigError as err:
        # Rank 0 reports bad input, which all meet; err.rank names a process that met one alone.
        rank = int(os.environ.get("RANK", 0))
        if err.rank == rank or (err.rank is None and rank == 0):
            who = "" if err.rank is None else f"rank {err.rank}: "
            message = f"{Path(__file__).name}: error: {who}{err}"
            # [optional: full disk]
            message += f"; {what_is_intact(args)}" if err.status == EXIT_WRITE_FAILED else ""
            # [optional: divergence note]
            message += note_divergence(args, err) if err.status == EXIT_DIVERGED else ""
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
    """Train one epoch; return [loss sum, samples] over the epoch, all processes.
    # [optional: mid-epoch]
    A resumed epoch, its rest. None: all stop at this step (--max-steps, SIGTERM); `state` holds it.
    """
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    num_steps = math.ceil(len(loader) / args.accum_steps)
    start = time.perf_counter()
    # [optional: mid-epoch]
    # A resumed epoch goes on from its checkpoint's step: its steps, sums and time come first.
    first_step, num_steps, start = (state.step_in_epoch, state.step_in_epoch + num_steps,
                                    start - state.train_seconds)
    totals += state.train_totals.to(device) if first_step else 0  # [optional: mid-epoch]
    group_count = torch.zeros((), dtype=torch.float64, device=device)  # the group's, so far
    for batch_index, batch in enumerate(loader):
        # [optional: unreadable files]
        batch, state.train_unreadable = report_unreadable(
            batch, state.train_unreadable, "trained on the next readable sample in its place")
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
        # [optional: preemption, mid-epoch]
        PREEMPTION.poll()  # every batch, so that all agree soon; they stop after the group's step
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
        # [optional: mid-epoch]
        # `state` follows every optimizer step: a checkpoint within the epoch holds the last one.
        state.epoch_position += args.accum_steps * args.batch_size * dist.get_world_size()
        # [optional: mid-epoch]
        step, state.train_totals, state.rng, state.train_seconds = (
            first_step + step, totals.clone(), rng_state(), time.perf_counter() - start)
        state.step_in_epoch = step  # [optional: mid-epoch]
        if step % args.log_interval == 0 or step == num_steps:
            where = f"epoch {state.epoch + 1} step {step}"
            mean, seen = stop_if_diverged(args, totals, grad_norm, scaler, per_sample, where)
            elapsed = time.perf_counter() - start  # read after the wait for the GPU
            norm = "" if grad_norm is None else f" | grad norm {grad_norm.item():.3g}"
            log(f"epoch {state.epoch + 1}/{args.epochs} step {step}/{num_steps} "
                f"loss {mean:.4f} | lr {lr:.6g}{norm} | "
                f"{seen / elapsed:.0f} samples/s{peak_memory(device)} | "
                f"eta {datetime.timedelta(seconds=round(elapsed / step * (num_steps - step)))}")
        # [optional: preemption, mid-epoch]
        if PREEMPTION.agreed:  # after the step: the forwards' BatchNorm statistics are the step's
            return None
        # [optional: mid-epoch]
        # Mid-epoch only: at the epoch's end validation and the epoch's checkpoint come first.
        if step < num_steps and 0 < args.max_steps <= state.global_step:
            return None
        # [optional: mid-epoch]
        if step < num_steps and args.ckpt_steps and state.global_step % args.ckpt_steps == 0:
            save_checkpoint(args, model, optimizer, scheduler, scaler, state)
    # [optional: unreadable files]
    totals = torch.cat([totals, totals.new_tensor([state.train_unreadable])])
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
    """The sums of EVAL_METRICS and the sample count: each process scores a shard, all-reduced.
    # [optional: preemption, mid-epoch]
    None: every process stops at this batch (SIGTERM).
    """
    # Every process scores its shard with rank 0's buffers (BatchNorm's running statistics), those
    # of the model saved: each has updated its own since DDP last broadcast them.
    broadcast_buffers(model)
    model.eval()
    totals = torch.zeros(len(EVAL_METRICS) + 1, dtype=torch.float64, device=device)
    unreadable = 0  # [optional: unreadable files]
    for batch in loader:
        # [optional: preemption, mid-epoch]
        if PREEMPTION.poll():  # before every batch: as often on every process, see below
            return None
        # [optional: unreadable files]
        batch, unreadable = report_unreadable(batch, unreadable, "left out of validation")
        # [optional: unreadable files]
        if batch is None:  # none of its files could be read
            continue
        with autocast(args, device):
            sums, count = evaluate_batch(model, to_device(batch, device, args.channels_last))
        totals[:-1] += sums
        totals[-1] += count
    # [optional: preemption, mid-epoch]
    # Shards differ by one sample at most: one a batch shorter than the longest polls once more.
    if len(loader) < math.ceil(len(loader.dataset) / (dist.get_world_size() * args.batch_size)) \
            and PREEMPTION.poll():
        return None
    # [optional: unreadable files]
    totals = torch.cat([totals, totals.new_tensor([unreadable])])
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
    record["val_unreadable"] = int(val_totals[-1].item())  # [optional: unreadable files]
    return {**record, "val_samples": int(count)}


def epoch_record(epoch, train_totals, val_totals, train_seconds, val_seconds, lr):
    """One line of metrics.jsonl: means over all samples, val_samples, timings, the lr reached."""
    return {"epoch": epoch + 1, "train_loss": train_totals[0].item() / train_totals[1].item(),
            "train_unreadable": int(train_totals[-1].item()),  # [optional: unreadable files]
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
RESUME_MAY_CHANGE_TASK += ("download",)  # [optional: cifar10]


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
    # [optional: flight recorder]
    if device.type == "cuda":
        flight_recorder(args)  # read when the group starts: set before it
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


# [optional: flight recorder]
def flight_recorder(args):
    """nccl's flight recorder: each process keeps its last collectives and, when one times out,
    writes them to --out-dir/nccl_trace_rank_<rank> (docs/troubleshooting.md). A variable the user
    set is kept. torch 2.11 reads TORCH_FR_*, the recorder on; older torch TORCH_NCCL_*, off."""
    dump = str(Path(args.out_dir).resolve() / "nccl_trace_rank_")
    if tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 11):
        wanted = {("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): dump}
    else:
        wanted = {("TORCH_NCCL_TRACE_BUFFER_SIZE",): "2000", ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
                  ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",): dump}
    for names, value in wanted.items():
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = value


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
    # [optional: preemption, mid-epoch]
    PREEMPTION.close()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# [optional: preemption, mid-epoch]
class Preemption:
    """SIGTERM turned into a stop that every process makes at the same batch. Schedulers send
    SIGTERM before SIGKILL; torchrun forwards it to every worker, and SIGKILLs them after
    --shutdown-timeout (30 s). At each batch the processes all-reduce the flag on a CPU (gloo)
    group; each poll reads the previous batch's result and starts its own, so none waits, and all
    agree at the same batch, at most two batches after the signal."""

    def __init__(self):
        self.requested = self.agreed = False
        self.group = self.pending = self.previous_handler = None

    def start(self, timeout):
        self.requested = self.agreed = False
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.previous_handler = signal.signal(signal.SIGTERM, self.request)

    def request(self, _signum, _frame):
        self.requested = True

    def poll(self):
        """Whether all processes have agreed to stop, for good (False before start)."""
        if self.pending is not None:
            work, flag = self.pending
            self.pending = None  # waited for here, not again in close(), if the wait fails
            work.wait()
            self.agreed = flag.item() > 0
        if self.group is not None and not self.agreed:
            flag = torch.tensor([float(self.requested)])
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.pending = work, flag
        return self.agreed

    def close(self):
        """Finish the last all-reduce, which every process started, and give SIGTERM back: a handler
        left installed keeps this group alive to the interpreter's exit, too late for gloo."""
        if self.group is None:
            return
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        signal.signal(signal.SIGTERM, self.previous_handler or signal.SIG_DFL)
        dist.destroy_process_group(self.group)
        self.group = None


# [optional: preemption, mid-epoch]
# The process's one SIGTERM handler, started by train().
PREEMPTION = Preemption()


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
        collate_fn=collate_readable,  # [optional: unreadable files]
        # The loaders' one generator seeds their workers, leaving the global RNG to the model.
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    # Every process draws the same permutation of (seed, epoch) and takes every world_size-th
    # sample of it from position rank: together they see what one process would see. It pads
    # with repeated samples until the set divides evenly, so every process runs as many steps.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed)
    # [optional: mid-epoch]
    train_sampler = ResumableSampler(train_set, world_size, rank, seed=args.seed)
    # [optional: unreadable files]
    train_set, val_set = readable_sets(train_set, val_set)
    # [optional: seeded samples]
    # Each index comes as (epoch, index), the key of its sample's random augmentation.
    train_sampler, train_set = EpochKeys(train_sampler), SeededSamples(train_set, args.seed)
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


# [optional: mid-epoch]
class ResumableSampler(DistributedSampler):
    """DistributedSampler's epoch from position `start` of the epoch's order, counted over all
    processes: an epoch resumed part-way through, on any number of processes."""
    start = 0

    def set_start(self, start):
        self.start = start

    def __iter__(self):
        # The order of (seed, epoch) dealt as DistributedSampler deals it: every num_replicas-th
        # sample from position rank, padded with the order's first until it divides. On as many
        # processes as before, its own dealing's tail; on another, the rest afresh, each once.
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        rest = order[self.start:]
        padding = -len(rest) % self.num_replicas
        rest += (order * math.ceil(padding / len(order)))[:padding]
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self):
        return math.ceil(max(len(self.dataset) - self.start, 0) / self.num_replicas)


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
    step_in_epoch: int = 0  # [optional: mid-epoch]
    # [optional: mid-epoch]
    epoch_position: int = 0  # samples of the epoch's order consumed by all processes together
    # Each process's own (rank 0 gathers them):
    rng: dict = None  # Python's and torch's random states
    train_totals: torch.Tensor = None  # [optional: mid-epoch]
    train_seconds: float = 0.0  # [optional: mid-epoch]
    train_unreadable: int = 0  # [optional: unreadable files]


SHARED_STATE = ("epoch", "global_step", "history", "train_set_size")
SHARED_STATE += ("step_in_epoch", "epoch_position")  # [optional: mid-epoch]
PER_PROCESS_STATE = ("rng",)
PER_PROCESS_STATE += ("train_totals", "train_seconds")  # [optional: mid-epoch]
PER_PROCESS_STATE += ("train_unreadable",)  # [optional: unreadable files]


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
    per_process["train_totals"] = state.train_totals.cpu()  # [optional: mid-epoch]
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
    # [optional: constant lr]
    # --epochs too, with a constant schedule only: the cosine schedule is laid over --epochs.
    if args.lr_schedule == "constant":
        may_change += ("epochs",)
    # [optional: global batch]
    if args.global_batch_size == checkpoint["world_size"] * saved["accum_steps"] * args.batch_size:
        may_change += ("accum_steps", "global_batch_size")  # the run's global batch, kept
    # [optional: divergence note]
    if divergence_note(args, path):  # the checkpoint before a divergence: other TAMING settings
        may_change += TAMING
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
        stop_if_repeating(args, path)  # [optional: divergence note]
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


# [optional: divergence note]
def note_divergence(args, err):
    """Note a divergence in --out-dir, where a restart finds it (stop_if_repeating); return where
    the same command, its settings changed, goes on from."""
    if not str(err).startswith("training diverged: "):
        return ""  # a restart that stop_if_repeating stopped: the note stays
    newest = list_checkpoints(Path(args.out_dir) / "checkpoints")[:1]
    note = {"problem": str(err).split(";")[0].removeprefix("training diverged: "),
            "checkpoint": newest[0].name if newest else None,
            "config": json.loads(json.dumps(vars(args), default=str))}
    try:
        save_file(json.dumps(note).encode(), Path(args.out_dir) / "diverged.json")
    except (OSError, ConfigError):  # a disk that is full too: no note, the line as it is
        return ""
    return f"; so changed, the same command goes on from {(newest or ['scratch'])[0]}"


# [optional: divergence note]
def divergence_note(args, path):
    """What a run that diverged from the checkpoint at path (None: the start) noted, or None."""
    try:
        note = json.loads((Path(args.out_dir) / "diverged.json").read_text())
    except (OSError, ValueError):
        return None
    return note if note.get("checkpoint") == (path and Path(path).name) else None


# [optional: divergence note]
def stop_if_repeating(args, path):
    """Stop at once, in one line, where this run would repeat a divergence, as torchrun's restart of
    it would: from the checkpoint it went on from (path), with the settings that decide it."""
    note, settings = divergence_note(args, path), json.loads(json.dumps(vars(args), default=str))
    if note and all(note.get("config", {}).get(name) == value for name, value in settings.items()
                    if name not in RESUME_MAY_CHANGE + RESUME_MAY_CHANGE_TASK):
        raise ConfigError(f"this run diverged from here before ({note['problem']}) and would "
                          f"again: change --lr, --warmup-epochs, --clip-grad-norm or --amp (a "
                          f"resume after a divergence may), or start afresh in another --out-dir",
                          status=EXIT_DIVERGED)


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
        # [optional: process failures]
        if (failure := process_failure(err, path, rank)) is not None:
            raise failure from None
        raise ConfigError(f"checkpoint {path} does not fit this model: {first_line(err)}") from None
    if checkpoint["scaler"]:  # empty from a run without fp16's scaler: nothing to restore
        scaler.load_state_dict(checkpoint["scaler"])
    rank_states = checkpoint["rank_states"]
    if len(rank_states) == dist.get_world_size():
        own = rank_states[rank]
    else:
        # Another number of processes: each keeps its own random states (seed + rank).
        own = {"rng": rng_state()}
        # [optional: mid-epoch]
        # Rank 0 takes the epoch's partial sums of all processes, whole again, and its own time.
        for name in rank_states[0].keys() - own.keys():
            own[name] = sum(r[name] for r in rank_states) * (rank == 0)
        own["train_seconds"] = rank_states[0]["train_seconds"]  # [optional: mid-epoch]
    state = TrainState(**{name: checkpoint[name] for name in SHARED_STATE}, **own)
    set_rng_state(state.rng)
    return state


# [optional: process failures]
def process_failure(err, path, rank):
    """The line for a restore that failed in this process or its group, not in the checkpoint (a
    collective, nccl, the GPU: exit 1, naming the rank); None for a checkpoint that does not fit."""
    # dcp.load's CheckpointException holds each rank's exception.
    for cause in [cause for cause, _ in getattr(err, "failures", {}).values()] or [err]:
        failed = isinstance(cause, (dist.DistError, torch.cuda.OutOfMemoryError))
        if failed or "CUDA error" in str(cause):
            return ConfigError(f"restoring {path} failed in this process, not in the checkpoint: "
                               f"{type(cause).__name__}: {first_line(cause)}", status=1, rank=rank)
    return None


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
    # [optional: primed buckets]
    if dist.get_world_size() > 2:  # DDP re-buckets after a first step: one thrown away here
        device, batch = next(model.parameters()).device, next(iter(train_loader))
        batch = batch[0]  # [optional: unreadable files]
        batch = to_device(batch, device, args.channels_last)
        with autocast(args, device):
            loss, _ = batch_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)  # the restore below undoes the rest (BatchNorm, RNG)
    state = restore(checkpoint, path, model.module, optimizer, scheduler, scaler, rank)
    # [optional: divergence note]
    # This run's --lr and warm-up, which a resume after a divergence may change: its rate.
    set_base_rate(scheduler, args.lr, checkpoint["config"]["lr"])
    if checkpoint["world_size"] != dist.get_world_size():
        # Another number of processes: the schedule goes on from the same fraction of the run.
        steps_per_epoch = math.ceil(len(train_loader) / args.accum_steps)
        scheduler.last_epoch = state.epoch * steps_per_epoch - 1
        # [optional: mid-epoch]
        scheduler.last_epoch += round(state.epoch_position / len(train_loader.dataset)
                                      * steps_per_epoch)
        scheduler.step()
        was = checkpoint["world_size"] * checkpoint["config"]["accum_steps"] * args.batch_size
        log(f"written by {checkpoint['world_size']} processes, resumed by {dist.get_world_size()}: "
            f"global batch {was} -> {args.batch_size * args.accum_steps * dist.get_world_size()}; "
            f"fresh random states (dropout), rank 0's BatchNorm statistics: the rest stays behind")
    return state


# [optional: divergence note]
def set_base_rate(scheduler, lr, saved):
    """The schedule's base rates scaled from the checkpoint's --lr (saved) to this run's, and the
    rate of its current step recomputed (another --warmup-epochs too): the same where neither is."""
    if lr != saved:
        scheduler.base_lrs = [base * lr / saved for base in scheduler.base_lrs]
    scheduler.last_epoch -= 1
    scheduler.step()


# [optional: mid-epoch]
def stop_run(args, model, optimizer, scheduler, scaler, state):
    """Every process stops at the same step: checkpoint it; return the exit status."""
    save_checkpoint(args, model, optimizer, scheduler, scaler, state)
    # [optional: preemption, mid-epoch]
    if PREEMPTION.agreed:
        log(f"preempted at step {state.global_step}: checkpoint written; requeue with the same "
            f"command (exit status {EXIT_REQUEUE})")
        return EXIT_REQUEUE
    log(f"stopped after --max-steps {args.max_steps}: checkpoint written; the same command "
        f"without --max-steps continues the run")
    return 0


# --- samples --------------------------------------------------------------------------------------
# Skip on a first reading: augmentation the same whatever the workers; unreadable files.

# [optional: seeded samples]
class EpochKeys(Sampler):
    """The wrapped sampler's indices as (epoch, index): the keys SeededSamples seeds from."""

    def __init__(self, sampler):
        self.sampler, self.epoch = sampler, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return ((self.epoch, index) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)

    def __getattr__(self, name):
        """Anything else is the wrapped sampler's (set_start)."""
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


# [optional: seeded samples]
class SeededSamples(torch.utils.data.Dataset):
    """The training set, each sample loaded with random draws that are a pure function of
    (seed, epoch, index): the same crop and flip whichever process or worker loads it, with any
    --workers, any world size, and after a resume. Left alone, a transform draws from the loading
    process's generators: a worker's, seeded once when it starts (a resumed run starts new ones), or
    the main process's. Seeded here: torch's and Python's global generators, which torchvision's
    transforms draw from (numpy's is not); the loading process's own are left as they were."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        seed = ((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63
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


# [optional: unreadable files]
class ReadableSamples(torch.utils.data.Dataset):
    """Each item (sample, [] or [its file, which could not be read]). In training (stand_in), a
    sample whose file cannot be read (truncated, corrupt, gone) gives its place to the next readable
    one in index order: a choice made from the index alone, so that every exactness promise holds.
    In validation it is left out (None): a stand-in would count another sample twice."""

    def __init__(self, dataset, stand_in):
        self.dataset, self.stand_in = dataset, stand_in

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        unreadable = []
        tries = min(MAX_UNREADABLE_IN_A_ROW + 1, len(self.dataset)) if self.stand_in else 1
        for offset in range(tries):
            try:
                return self.dataset[(index + offset) % len(self.dataset)], unreadable
            except UNREADABLE as err:
                # Its own file is reported (once an epoch); those tried in its place, by their keys.
                unreadable = unreadable or [describe_unreadable(self.dataset, index, err)]
        if not self.stand_in:
            return None, unreadable
        raise OSError(f"{tries} samples in a row cannot be read, from {unreadable[0]}")


# [optional: unreadable files]
def readable_sets(train_set, val_set):
    """The sets as ReadableSamples, training's with stand-ins. A set none of whose first samples can
    be read is no data set: one line, before any work."""
    for dataset in (train_set, val_set):
        try:
            ReadableSamples(dataset, stand_in=True)[0]
        except OSError as err:
            raise ConfigError(f"the data cannot be read: {err}") from None
    return ReadableSamples(train_set, stand_in=True), ReadableSamples(val_set, stand_in=False)


# [optional: unreadable files]
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


# [optional: unreadable files]
def collate_readable(items):
    """(the batch of the readable samples, or None if there is none, the files that were not)."""
    samples = [sample for sample, _ in items if sample is not None]
    unreadable = [name for _, names in items for name in names]
    return (torch.utils.data.default_collate(samples) if samples else None), unreadable


# [optional: unreadable files]
def report_unreadable(item, count, instead):
    """(The batch of a (batch, unreadable files) pair, count + its files), each file warned of."""
    batch, unreadable = item
    for name in unreadable:
        warn(f"cannot read {name}: {instead}")
    return batch, count + len(unreadable)


# --- model ----------------------------------------------------------------------------------------
# Skip on a first reading: the model tried on the data before the first step; starting weights.

# [optional: model check]
def check_model_fits(args, num_outputs, train_set, val_set, world_size):
    """A sample through the model on the meta device (shapes only: no memory, no arithmetic), then
    the smallest training batch. A model that cannot take the data (a ViT built for 224 pixels, fed
    32; BatchNorm given one value per channel) is one line here, not a traceback midway."""
    try:
        sample = val_set[0]
        with torch.device("meta"):
            model = build_model(args, num_outputs).eval()
    except (OSError, SyntaxError, RuntimeError, NotImplementedError):
        return  # a file that cannot be read, a model that reads values as it is built: no verdict
    # BatchNorm cannot train on one value per channel (a ValueError): the smallest batch is tried.
    per_process = math.ceil(len(train_set) / world_size)
    smallest = per_process % args.batch_size or args.batch_size
    why = "" if smallest == args.batch_size else \
        f", the last of {per_process} samples per process in batches of {args.batch_size}"
    where = ""
    try:
        evaluate_batch(model, to_device(torch.utils.data.default_collate([sample]), "meta", False))
        where = f" (a training batch of {smallest}{why}: try another --batch-size)"
        batch = torch.utils.data.default_collate([sample] * smallest)
        batch_loss(model.train(), to_device(batch, "meta", False))
    except NotImplementedError:
        return  # an operation with no meta implementation: no verdict, the first step will tell
    except (RuntimeError, ValueError, AssertionError, TypeError, IndexError) as err:
        if "meta tensors" in str(err):
            return  # a value read (.item(), int() of a count): no verdict, the first step will tell
        reason = first_line(err)
        hint = where if isinstance(err, ValueError) else where and " (in training mode)"
        raise ConfigError(f"the model does not fit the data: {reason}{hint}") from None


# [optional: init-from]
def read_state_dict(path):
    """The weights in a file: a model.pt, a plain state dict, or a checkpoint holding "model"."""
    try:
        # weights_only: tensors and plain containers only, so loading a file runs no code from it.
        # mmap: tensors stay the file's pages, read as used, not copied (torch.save's zip format).
        state = torch.load(path, map_location="cpu", weights_only=True,
                           mmap=zipfile.is_zipfile(path))
    except Exception as err:  # weights_only runs nothing from the file: what fails is the file
        reason = f"{type(err).__name__} {(str(err).strip().splitlines() or [''])[0]}"
        raise ConfigError(f"--init-from {path} cannot be read: {reason}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a training checkpoint
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--init-from {path} holds no state dict")
    # The prefixes wrappers put before every key (DDP's, DataParallel's; torch.compile's): off.
    prefixes = ("module.", "_orig_mod.")
    while state and (prefix := next((p for p in prefixes if all(k.startswith(p) for k in state)),
                                    None)):
        state = {key.removeprefix(prefix): value for key, value in state.items()}
    return state


# [optional: init-from]
def init_weights_from(args, model):
    """Load --init-from into the model before training: fine-tuning. Every key must fit, but
    pretrained layers of another shape (a classifier for other classes) keep their fresh weights."""
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


# --- machinery ------------------------------------------------------------------------------------
# Skip on a first reading: the GPU's speed settings, files, flags, and what a run prints.

def configure_cuda(args, device):
    # Tensor cores' convolutions take channels-last tensors: on GPUs, the layout by default.
    if args.channels_last is None:
        args.channels_last = device.type == "cuda"
    # [optional: deterministic]
    if args.deterministic:
        # The same kernels and sums on every run: cuBLAS's fixed workspace (read at its first use),
        # deterministic algorithms (torch warns where it has none), no TF32, no autotuning.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        args.tf32 = args.cudnn_benchmark = False
        if device.type == "cuda":  # attention's fused backwards sum in any order: its math kernel
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
    # TF32: float32 matmuls and convolutions on tensor cores, several times faster from Ampere on.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    # cuDNN times its algorithms per input shape and keeps the fastest: a GPU run's bits may vary.
    torch.backends.cudnn.benchmark = args.cudnn_benchmark


# [optional: grad compression]
def compress_gradients(args, model):
    """With --grad-compression, DDP's buckets travel in 16 bits: torch's communication hook, in
    place of DDP's own all-reduce, divides each by the processes, casts, sums, casts back."""
    if args.grad_compression != "none":
        hook = getattr(default_hooks, f"{args.grad_compression}_compress_hook")
        model.register_comm_hook(None, hook)
        log(f"DDP all-reduces gradients in {args.grad_compression}")


# [optional: sync-bn]
def sync_batchnorm(args, model, device):
    """--sync-bn: BatchNorm's statistics of the global batch, all-reduced in every forward."""
    if args.sync_bn and device.type != "cuda":
        raise ConfigError("--sync-bn needs CUDA GPUs: SyncBatchNorm runs on GPUs only")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model


def prepare_out_dir(args):
    """Create --out-dir: a file standing where it should be stops the run now, in one line."""
    try:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        # [optional: value checks]
        # A file written there: permissions and read-only mounts stop it now, not after training.
        tempfile.TemporaryFile(dir=args.out_dir).close()
    except OSError as err:
        raise ConfigError(f"cannot write to --out-dir {args.out_dir}: {err.strerror or err}")


# [optional: atomic writes]
def atomic(save):
    """save(obj, path) under another name, synced to the disk, then renamed: never half a file."""
    def atomic_save(obj, path):
        tmp = Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}")
        try:
            save(obj, tmp)
            with open(tmp, "r+b") as f:  # writable: Windows syncs no read-only file
                os.fsync(f.fileno())  # the data on the disk before the rename names it
            os.replace(tmp, path)
        # [optional: full disk]
        except (OSError, RuntimeError) as err:
            # torch.save's RuntimeError ("unexpected pos") hides the file's OSError (errno 28).
            cause = err if isinstance(err, OSError) else err.__context__
            if not isinstance(cause, OSError):
                raise
            raise ConfigError(f"cannot write {path}: {cause.strerror or cause} "
                              f"({free_space(path)}); the files already in --out-dir are whole",
                              status=EXIT_WRITE_FAILED) from None
        finally:
            tmp.unlink(missing_ok=True)
    return atomic_save


@atomic  # [optional: atomic writes]
def save_file(obj, path):
    """Write obj (bytes, or what torch.save takes) to path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)


# [optional: full disk]
def free_space(path):
    try:
        return f"{shutil.disk_usage(Path(path).parent).free / 2**20:.2f} MiB free there"
    except OSError:
        return "free space unknown"


# [optional: full disk]
def what_is_intact(args):
    """After a write that failed: what the same command, run again, starts from."""
    newest = list_checkpoints(Path(args.out_dir) / "checkpoints")[:1]
    start = f"the newest complete checkpoint is {newest[0]}" if newest else "no checkpoint yet"
    return f"{start}: fix that, then run the same command again"


def write_metrics(path, history):
    save_file("".join(json.dumps(record) + "\n" for record in history).encode(), path)


class ConfigError(Exception):
    """An error the user can act on: one line and a non-zero exit, not a traceback. Rank 0 reports
    it (bad input, met by all), or the process it names by rank (met alone: a GPU it cannot see)."""

    def __init__(self, message, status=2, rank=None):
        super().__init__(message)
        self.status, self.rank = status, rank


# [optional: section check]
# What the rest of the script takes from the section "your data and model", and what each must be.
TASK_HOOKS = {
    "build_datasets": "build_datasets(args) returns (train_set, val_set, num_outputs)",
    "build_model": "build_model(args, num_outputs) returns the model",
    "batch_loss": "batch_loss(model, batch) returns (the mean loss to train on, what it averages)",
    "evaluate_batch": "evaluate_batch(model, batch) returns (its sums of EVAL_METRICS, its count)",
    "EVAL_METRICS": "EVAL_METRICS names the metrics whose sums evaluate_batch returns",
    "add_task_arguments": "add_task_arguments(parser) adds the task's flags (it may add none)",
    "pretrained_weights": "pretrained_weights(args) returns a state dict",  # [optional: init-from]
    "RESUME_MAY_CHANGE_TASK": "RESUME_MAY_CHANGE_TASK names the task's flags a resume may change",
}


# [optional: section check]
def check_task():
    """Before any work, not as a NameError midway: names the section "your data and model" lacks."""
    missing = [f"{name}: {what}" for name, what in TASK_HOOKS.items() if name not in globals()]
    if missing:
        raise ConfigError(f"the section \"your data and model\" has no {'; no '.join(missing)}")


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
                        help="samples per process per micro-batch: the global batch is it times "
                             "the processes and the accumulation steps")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="SGD with momentum, or AdamW")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: 0.03 with sgd, 1e-3 with adamw)")
    # [optional: constant lr]
    parser.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                        help="cosine: warm-up to --lr, then cosine decay to 0 at the last step; "
                             "constant: --lr throughout (a resume may then change --epochs)")
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
    # [optional: deterministic]
    parser.add_argument("--deterministic", action="store_true", help="CUDA: deterministic "
                        "kernels (attention's math one, not its fused ones), no TF32, no "
                        "autotuning: runs and resumes repeat bit for bit; slower (attention most)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model: faster "
                        "GPU steps after minutes of compiling, slower on CPU (default: off)")
    # [optional: profile]
    parser.add_argument("--profile", action="store_true", help="profile optimizer steps 4-6: "
                        "each process's trace in --out-dir, and where its time went (default: off)")
    # [optional: init-from]
    parser.add_argument("--init-from", default=None,
                        help="start from these weights: a model.pt of any step, a state dict, or "
                             "'pretrained': the task's published weights (pretrained_weights)")
    add_task_arguments(parser)
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                        help="autocast the forward to this precision; fp16 adds a GradScaler")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="4-D inputs and weights in channels-last order (default: on GPUs)")
    parser.add_argument("--accum-steps", type=int, default=1,
                        help="micro-batches averaged into each optimizer step (default: 1)")
    # [optional: global batch]
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="samples per optimizer step, all processes: sets --accum-steps")
    parser.set_defaults(accum_steps=None)  # [optional: global batch]
    parser.add_argument("--clip-grad-norm", type=float, default=0.0,
                        help="clip the global gradient norm to this value; 0 turns clipping off")
    parser.add_argument("--resume", default="auto", help="auto: the newest readable checkpoint "
                        "in <out-dir>/checkpoints, afresh if empty; none: afresh; or a checkpoint's"
                        " path (none and a path refuse an --out-dir holding later checkpoints)")
    parser.add_argument("--ckpt-epochs", type=int, default=1,
                        help="checkpoint every this many epochs and after the last; 0: the last")
    parser.add_argument("--keep-last", type=int, default=3, help="checkpoints kept; older go")
    # [optional: mid-epoch]
    parser.add_argument("--ckpt-steps", type=int, default=0,
                        help="also checkpoint every this many optimizer steps; 0: off")
    # [optional: mid-epoch]
    parser.add_argument("--max-steps", type=int, default=0,
                        help="stop after this many optimizer steps, with a checkpoint; 0: no limit")
    # [optional: sync-bn]
    parser.add_argument("--sync-bn", action="store_true",
                        help="BatchNorm statistics of the global batch (SyncBatchNorm; CUDA)")
    # [optional: buckets]
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP's gradient bucket size (its default): bigger, fewer all-reduces")
    # [optional: buckets]
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="gradients in DDP's buckets: a copy less (default: off, as in DDP)")
    # [optional: grad compression]
    parser.add_argument("--grad-compression", choices=["none", "bf16", "fp16"], default="none",
                        help="DDP all-reduces gradients in 16 bits: half the bytes for a slow "
                             "network, the sum rounded to 16 bits (fp16 overflows sooner)")
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
            "warmup_epochs": 0, "accum_steps": 1, "clip_grad_norm": 0,
            "ckpt_steps": 0, "max_steps": 0,  # [optional: mid-epoch]
            "keep_last": 1, "ckpt_epochs": 0}

# [optional: value checks]
POSITIVE = ("lr",
            "bucket_cap_mb",  # [optional: buckets]
            "timeout_min")


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


# [optional: global batch]
def accum_steps_for(args, world_size):
    """--accum-steps (1 by default), or --global-batch-size / (--batch-size x processes)."""
    if args.global_batch_size is None:
        return 1 if args.accum_steps is None else args.accum_steps
    steps = args.global_batch_size / (args.batch_size * world_size)
    if steps < 1 or steps != int(steps) or args.accum_steps not in (None, steps):
        raise ConfigError(f"--global-batch-size {args.global_batch_size} / (--batch-size "
                          f"{args.batch_size} x {world_size} processes) = {steps:g} accumulation "
                          f"steps: must be a whole number >= 1, and --accum-steps, if given, equal")
    return int(steps)


def set_seed(seed):
    """Seed every generator the training code draws from (Python's and torch's, CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


def log(message):
    """Print on rank 0 only: every process runs this code, and one copy of each line is enough."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


# [optional: unreadable files]
def warn(message):
    """A warning from whichever process meets it, not rank 0 alone (another process's files are
    not rank 0's to see): one line on stderr, naming the process."""
    # One write: the lines of processes that warn at once never run together.
    sys.stderr.write(f"{Path(__file__).name}: warning: rank {dist.get_rank()}: {message}\n")


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


def log_resume(args, checkpoint_path, state):
    """Say where a resumed run goes on, or that it already completed every epoch."""
    if checkpoint_path is not None:
        log(f"resumed from {checkpoint_path}: "
            f"step {state.step_in_epoch} of "  # [optional: mid-epoch]
            f"epoch {state.epoch + 1}")
    if state.epoch >= args.epochs:
        log(f"nothing to train: the run already completed {state.epoch} epochs; start afresh in "
            f"another --out-dir")


def log_epoch(record, epochs):
    metrics = " ".join(f"val_{name} {record[f'val_{name}']:.4f}" for name in EVAL_METRICS)
    # [optional: init-from]
    if record["epoch"] == 0:  # the starting weights of a fine-tuning run: no training yet
        log(f"epoch 0/{epochs} (starting weights) {metrics} ({record['val_samples']} samples)")
        return
    log(f"epoch {record['epoch']}/{epochs} train_loss {record['train_loss']:.4f} {metrics} "
        f"({record['val_samples']} samples) | {record['samples_per_sec']:.0f} samples/s")
    # [optional: unreadable files]
    if unreadable := record["train_unreadable"] + record["val_unreadable"]:
        log(f"epoch {record['epoch']}: unreadable files skipped: {unreadable}")


if __name__ == "__main__":
    sys.exit(main())
