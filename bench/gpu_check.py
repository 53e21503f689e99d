"""The GPU check: what the CPU suite can only stand in for, run in one command of at most 5 minutes.

    python bench/gpu_check.py runs/gpu_check          # the whole plan on the visible GPUs
    python bench/gpu_check.py --dry-run [--gpus N]    # the plan, its estimates and their total; no GPU

Its checks run in the order of what they prove that nothing else can:
  (a) every script's CUDA and nccl paths, and the sharded validations against model.pt;
  (b) exact resumes under --deterministic, and fsdp.py against ddp_full.py;
  (c) activation checkpointing against none, bit for bit, on resnet18 in bf16 and on a transformer;
  (d) fsdp.py in fp16: a GradScaler on sharded gradients;
  (e) speed last: the bare loop, ddp_full.py, and fsdp.py with and without --channels-last.

It runs on the torch it finds (nothing to install) and uses every visible GPU, one process per GPU.
Each row names the world it ran in. On one GPU that is one process, where nothing is sharded and no
collective crosses processes; there (a) adds ddp_full.py in two processes sharing the GPU, started
by two torchrun agents and joined over gloo (nccl takes one GPU per process), and fsdp.py the same
way as a trial, whose failure is a "not here" row, not a failure.

The seconds of each launch are estimates (see ESTIMATES), reported beside the seconds it took; a
launch never fails for time alone. --limit is a hard stop: at that total, counted from this
check's start, the launch running is stopped with all its processes, its row says so, and every
check after it is a "not run" row. Rows go to OUT_DIR/gpu_check.md, each written as its check
ends; every launch's output to logs/ in OUT_DIR/logs.tar.gz, packed anew as each launch ends (a
check stopped from outside still leaves what it finished; the two files are all it writes there).
Exit status: 0 all ok, 1 a check failed or the total cut the check off, 2 no CUDA or bad arguments.
"""
import argparse
import ast
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

START = time.monotonic()  # the total counts from the check's own start, torch's import included
ROOT = Path(__file__).resolve().parent.parent
# A 5-minute command on the GPU machine this was written for (about 15 minutes lent in all, cold
# start included, at most 10 a command): 10 s left for Python's and the machine's own start.
LIMIT_S = 290
VAL_SAMPLES = 500

# ESTIMATES: seconds on an H200 machine, reasoned, not measured (no GPU has run this check). A
# launch pays Python's start with torch and torchvision imported (3 s, the file cache warm),
# torchrun's agent (2 s: its own import of torch), CUDA's context with cuDNN's and cuBLAS's first
# loads (2 s), a process group's set-up and first collective (nccl 2 s on one GPU, 4 s on several;
# two agents' rendezvous and gloo 2 s), then its work. The first launch pays a cold file cache.
PYTHON_S, AGENT_S, CUDA_S, TWO_AGENTS_S, COLD_S = 3, 2, 2, 2, 10
RESNET18_S = 2      # 16 steps at 32 px, 500 samples validated, a checkpoint and model.pt
FSDP_S = 3          # the same, plus shards filled from rank 0's copy and dcp's sharded checkpoint
GLOO_S = 3          # resnet18's 45 MB of gradients a step through host memory, two processes
TRANSFORMER_S = 2   # 16 steps of a 4-block transformer, 16 tokens a sequence
BARE_S = 6          # resnet50, 40 steps of 64 at 224 px, cudnn.benchmark timing its algorithms
SPEED_S = 9         # 1,024 images made, 2 epochs of 15 steps at 224 px, resnet50's checkpoints
WEIGHTS_S = 1       # two state dicts loaded and compared in this process
VALIDATION_S = 2    # resnet18 scores 500 samples on this machine's CPU (torchvision imported once)


def nccl_s(gpus):
    """nccl's set-up and first collective: more GPUs, more to connect."""
    return 2 if gpus == 1 else 4


def plain_s(work):
    """A launch of one process without torchrun."""
    return PYTHON_S + CUDA_S + work


def torchrun_s(gpus, work):
    """A launch under torchrun over nccl, one process per GPU."""
    return PYTHON_S + AGENT_S + CUDA_S + nccl_s(gpus) + work


def two_agents_s(work):
    """Two torchrun agents of one process each, sharing one GPU over gloo."""
    return PYTHON_S + AGENT_S + CUDA_S + TWO_AGENTS_S + GLOO_S + work


def small(nproc):
    """resnet18 on the scripts' synthetic 32x32 data: 16 steps of 128 in each of nproc processes,
    enough for a resume mid-epoch whatever the number of GPUs."""
    return ["--model", "resnet18", "--train-samples", str(2048 * nproc), "--val-samples", str(VAL_SAMPLES),
            "--epochs", "1", "--batch-size", "128", "--log-interval", "8"]


def dropout(nproc):
    """A model with dropout: every training step draws random numbers on the GPU."""
    return [*small(nproc), "--model", "mobilenet_v3_small"]


def transformer(nproc):
    """tests/test_seam.py's causal transformer: 16 steps of 8 sequences in each process."""
    return ["--sequences", str(128 * nproc), "--epochs", "1", "--batch-size", "8", "--lr", "0.05",
            "--log-interval", "1000"]


def speed(nproc):
    """resnet50 at 224 px in bf16: 2 epochs of 15 steps of 64 a process; the second epoch's rate
    is the steady one (the first holds cudnn.benchmark's timing)."""
    return ["--model", "resnet50", "--image-size", "224", "--amp", "bf16", "--batch-size", "64", "--epochs", "2",
            "--train-samples", str(64 * 15 * nproc), "--val-samples", "64", "--log-interval", "5", "--resume", "none"]


BARE = [sys.executable, "bench/bare.py", "--model", "resnet50", "--image-size", "224", "--batch-size", "64",
        "--steps", "30", "--warmup", "10", "--amp", "bf16", "--mode", "plain"]

# Validation compared with model.pt scored in float32 on this machine's CPU, by the precision the
# run validated in: (tie, loss). Counts of correct predictions must be equal but for the samples
# whose two highest logits lie within `tie` x the sample's largest |logit| of each other (a tie: the
# run's rounding may have put either first); the mean loss within `loss`, relative. Measured on CPU
# (resnet18 after this check's 16 steps, logits up to 53 in size), the largest distance of a
# sample's logits from their float64 values, over its largest |logit|:
# - none (float32; --deterministic turns TF32 off): 1.1e-6, whatever the batch size or layout. A
#   GPU's convolutions (Winograd and FFT among cuDNN's deterministic ones) may round ten times
#   more: tie 1e-4. Loss 1e-4: rounding moves it by about 1e-6, while a shard scored with its own
#   process's BatchNorm statistics moved it by 5e-3 (tests/test_validation.py).
# - bf16 autocast: 8.9e-3; 4 of 500 predictions flipped, at margins up to 8.5e-3; the loss moved
#   by 9.7e-4 (4.8e-3 under an older fsdp.py policy). A flip needs the two logits to move apart by
#   its margin, at most twice the largest distance: tie 2e-2 (18 of the 500 samples), loss 2e-2.
#   Weak checks, both: the float32 row guards the BatchNorm mistake above.
# - fp16 autocast: 1.2e-3, no flip, the loss moved by 1.3e-4: tie 4e-3, loss 2e-3.
VALIDATION = {"none": (1e-4, 1e-4), "bf16": (2e-2, 2e-2), "fp16": (4e-3, 2e-3)}
# fsdp.py against ddp_full.py, both float32 and --deterministic: the same arithmetic, summed in
# other orders (reduce-scatters and DTensor's foreach steps against all-reduces and plain ones):
# rounding, about 1e-7 relative a step, grown over 16 steps to well under 1e-5. A lost piece of
# state (momentum, the schedule's position, the data order) changes a whole step's update, about
# lr x gradient: 1e-3 of a weight's scale or more. Per tensor: |a - b| / |b| (norms).
FSDP_RTOL = 1e-4

# Warnings that mean FSDP or DTensor was misused, whatever the exit status: the run went on doing
# wrong or missing work. Any of them in a launch's output fails its row. Not FSDP2's "returned a
# view tensor": it fires whenever a unit's output is a view (a Linear over a sequence returns one:
# the check's transformer), and warns of a mistake an in-place op would make, not of one made.
MISUSE = {
    "did not run forward before backward": "FSDP: a unit's pre-backward logic never ran (its "
                                           "parameters not gathered again, its gradients not reduced)",
    "DTensor is synchronizing RNG states": "DTensor: processes seeded differently, overwritten by rank 0's",
}
# Under --deterministic an operation without a deterministic kernel warns and runs as it is
# (warn_only): noted in its row; the bitwise comparison after it says whether it changed anything.
NONDETERMINISTIC = re.compile(r"(\w+) does not have a deterministic implementation|"
                              r"(\w[\w ]*?) defaults to a non-deterministic algorithm")


class Launch:
    """A check that starts processes: its commands, started together (two torchrun agents are two),
    its estimated seconds, the world it runs in and what it shows. A trial asks whether this
    machine can do it at all: where it cannot, its row says "not here" and the check goes on.
    `prepare` makes what it needs first (a file); `speed`: its rate goes to the speed table."""

    def __init__(self, name, commands, estimate, world, shows, trial=False, prepare=None, speed=False):
        self.name, self.commands, self.estimate, self.world, self.shows = name, commands, estimate, world, shows
        self.trial, self.prepare, self.speed = trial, prepare, speed


class Compare:
    """A check in this process, no launch: `check()` returns (ok, text) from the outputs of the
    launches it needs, each of which must have ended ok; `describe` says what it compares."""

    def __init__(self, name, needs, check, estimate, world, shows, describe):
        self.name, self.needs, self.check, self.estimate = name, needs, check, estimate
        self.world, self.shows, self.describe = world, shows, describe


def torchrun(nproc, script, args):
    """torchrun of nproc processes on this machine, one per GPU."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def two_agents(script, args, port, rdzv_id):
    """Two torchrun agents of one process each, joined by a rendezvous on this machine: two
    processes of LOCAL_RANK 0, so both drive GPU 0."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}", script, *args]
    return [agent, list(agent)]


def world(nproc):
    """The world column of a run of nproc processes, one per GPU."""
    return "1 process (a world of one)" if nproc == 1 else f"{nproc} processes, 1 per GPU"


TWO_ON_ONE = "2 processes on 1 GPU (gloo)"


def weights(name, a, b, rtol, needs, where, shows):
    """A Compare of model.pt in run directories a and b: bit for bit (rtol 0), or each floating
    tensor within rtol of b's, relative to its norm."""
    how = "bit for bit" if rtol == 0 else f"each tensor within {rtol:g} of its norm"
    return Compare(name, needs, lambda: weights_agree(Path(a) / "model.pt", Path(b) / "model.pt", rtol),
                   WEIGHTS_S, where, shows, f"{a}/model.pt against {b}/model.pt, {how}")


def validation(name, run_dir, amp, needs, where, shows):
    """A Compare of a run's last validation with its model.pt scored here in float32."""
    tie, loss = VALIDATION[amp]
    return Compare(name, needs, lambda: validation_agrees(run_dir, amp), VALIDATION_S, where, shows,
                   f"{run_dir}/metrics.jsonl against {run_dir}/model.pt scored here in float32: correct counts "
                   f"equal but for ties within {tie:g}, the loss within {loss:g} ({amp})")


def fsdp_bf16(gpus):
    """fsdp.py's bf16 run: accumulation, clipping, fused AdamW, deterministic; on an even number of
    GPUs hybrid sharding (2 replicas)."""
    return [*small(gpus), "--amp", "bf16", "--accum-steps", "2", "--clip-grad-norm", "1", "--optimizer", "adamw",
            "--deterministic", *(["--replicas", "2"] if gpus % 2 == 0 else [])]


def paths_group(gpus, tmp):
    """(a) Every script's CUDA and nccl paths; the sharded validations against model.pt; on one GPU,
    two processes sharing it."""
    w, one = world(gpus), "1 process, 1 GPU"
    items = [
        Launch("single_gpu", [[sys.executable, "single_gpu.py", *small(1), "--out-dir", f"{tmp}/single"]],
               plain_s(RESNET18_S) + COLD_S, one,
               "CUDA device, pinned memory, channels-last, TF32, cudnn.benchmark; the first CUDA start-up"),
        Launch("dataparallel", [[sys.executable, "dataparallel.py", *small(1), "--out-dir", f"{tmp}/dp"]],
               plain_s(RESNET18_S), f"1 process, {gpus} GPU{'s' if gpus > 1 else ''}",
               "nn.DataParallel over every visible GPU" + ("" if gpus > 1 else " (one GPU: no split)")),
        Launch("amp_fp16_accum_nccl", [torchrun(gpus, "ddp_amp_accum.py", [
            *small(gpus), "--backend", "nccl", "--amp", "fp16", "--accum-steps", "2", "--clip-grad-norm", "1",
            "--optimizer", "adamw", "--out-dir", f"{tmp}/amp"])], torchrun_s(gpus, RESNET18_S), w,
               "DDP over nccl (ddp_basic.py's path and more): set_device, DistributedSampler, fp16 autocast "
               "with a GradScaler, no_sync accumulation, clipping after unscale_, fused AdamW"),
        Launch("full", [torchrun(gpus, "ddp_full.py", [*small(gpus), "--deterministic", "--out-dir", f"{tmp}/full"])],
               torchrun_s(gpus, RESNET18_S), w,
               "ddp_full.py in float32 under --deterministic: checkpoints, sharded validation"),
        validation("full_validation", f"{tmp}/full", "none", ["full"], w,
                   "sharded validation with rank 0's BatchNorm statistics scores model.pt as one process does"),
        Launch("fsdp_bf16_accum", [torchrun(gpus, "fsdp.py", [*fsdp_bf16(gpus), "--activation-checkpointing",
                                                               "--out-dir", f"{tmp}/fsdp_bf16"])],
               torchrun_s(gpus, FSDP_S), w,
               "the model built on the meta device, shards filled from rank 0's copy on the GPU; fully_shard "
               "with BatchNorm's float32 parameters under bf16 autocast, a reduce-scatter per micro-batch, the "
               "global-norm clip, activation checkpointing, fused AdamW on sharded parameters (DTensors)"
               + (" (a world of one: one shard)" if gpus == 1 else
                  ", hybrid sharding: 2 replicas (a 2-D mesh over nccl)" if gpus % 2 == 0 else "")),
        validation("fsdp_validation", f"{tmp}/fsdp_bf16", "bf16", ["fsdp_bf16_accum"], w,
                   "fsdp.py's bf16 validation against model.pt gathered to rank 0"),
    ]
    if gpus == 1:
        items += [
            Launch("two_on_one_gpu_full", two_agents("ddp_full.py", [
                *small(2), "--backend", "gloo", "--sync-bn", "--amp", "bf16", "--deterministic",
                "--out-dir", f"{tmp}/two"], free_port(), "gpu-check"), two_agents_s(RESNET18_S), TWO_ON_ONE,
                   "across processes with CUDA tensors: DDP's all-reduce, SyncBatchNorm, rank 0's buffers "
                   "broadcast, validation over two shards (gloo, not nccl)"),
            validation("two_on_one_gpu_validation", f"{tmp}/two", "bf16", ["two_on_one_gpu_full"], TWO_ON_ONE,
                       "that run's validation over two shards scores model.pt as one process does"),
            Launch("two_on_one_gpu_fsdp", two_agents("fsdp.py", [
                *small(2), "--backend", "gloo", "--out-dir", f"{tmp}/two_fsdp"], free_port(), "gpu-check-fsdp"),
                   two_agents_s(FSDP_S), TWO_ON_ONE,
                   "a trial: FSDP's all-gathers and reduce-scatters of CUDA tensors over gloo; where gloo "
                   "cannot, the row says so", trial=True),
        ]
    return items


def resume_group(gpus, tmp):
    """(b) Exact resumes under --deterministic, and fsdp.py against ddp_full.py in float32."""
    w = world(gpus)
    exact, drop = [*small(gpus), "--deterministic"], [*dropout(gpus), "--deterministic"]
    run, fsdp_run = torchrun_s(gpus, RESNET18_S), torchrun_s(gpus, FSDP_S)
    return [
        Launch("dropout_stopped", [torchrun(gpus, "ddp_full.py", [*drop, "--max-steps", "6", "--out-dir",
                                                                  f"{tmp}/d1"])], run, w,
               "ddp_full.py with dropout (mobilenet_v3_small) stops at step 6 of 16, the GPU's random state "
               "in its checkpoint"),
        Launch("dropout_resumed", [torchrun(gpus, "ddp_full.py", [*drop, "--out-dir", f"{tmp}/d1"])], run, w,
               "the same command without --max-steps resumes: random states restored on the GPU"),
        Launch("dropout_straight", [torchrun(gpus, "ddp_full.py", [*drop, "--out-dir", f"{tmp}/d2"])], run, w,
               "the run never stopped"),
        weights("dropout_resume_is_bitwise", f"{tmp}/d1", f"{tmp}/d2", 0, ["dropout_resumed", "dropout_straight"], w,
                "resumed and straight weights equal bit for bit: dropout drew the same numbers after the resume"),
        Launch("fsdp_stopped", [torchrun(gpus, "fsdp.py", [*exact, "--max-steps", "6", "--out-dir", f"{tmp}/f1"])],
               fsdp_run, w, "fsdp.py stops at step 6 and writes its sharded checkpoint (dcp.save)"),
        Launch("fsdp_resumed", [torchrun(gpus, "fsdp.py", [*exact, "--out-dir", f"{tmp}/f1"])], fsdp_run, w,
               "the same command resumes from it (dcp.load into the shards on the GPU)"),
        Launch("fsdp_straight", [torchrun(gpus, "fsdp.py", [*exact, "--out-dir", f"{tmp}/f2"])], fsdp_run, w,
               "fsdp.py never stopped, float32, on ddp_full.py's seed and settings (a)"),
        weights("fsdp_resume_is_bitwise", f"{tmp}/f1", f"{tmp}/f2", 0, ["fsdp_resumed", "fsdp_straight"], w,
                "resumed and straight weights equal bit for bit"),
        weights("fsdp_trains_what_ddp_trains", f"{tmp}/f2", f"{tmp}/full", FSDP_RTOL, ["fsdp_straight", "full"], w,
                f"fsdp.py's weights within {FSDP_RTOL:g} of ddp_full.py's, per tensor (other orders of "
                "summing: rounding; a lost piece of state moves a step's update, 1e-3 or more)"),
    ]


def recompute_group(gpus, tmp):
    """(c) Activation checkpointing against none, bit for bit under --deterministic: resnet18 in bf16
    (against (a)'s run with it) and tests/test_seam.py's causal transformer."""
    w = world(gpus)
    copy = f"{tmp}/fsdp_transformer.py"
    exact = [*transformer(gpus), "--deterministic"]
    return [
        Launch("fsdp_bf16_no_recompute", [torchrun(gpus, "fsdp.py", [*fsdp_bf16(gpus), "--out-dir",
                                                                         f"{tmp}/fsdp_bf16_plain"])],
               torchrun_s(gpus, FSDP_S), w, "(a)'s fsdp.py run without --activation-checkpointing"),
        weights("recompute_is_bitwise_resnet18", f"{tmp}/fsdp_bf16", f"{tmp}/fsdp_bf16_plain", 0,
                ["fsdp_bf16_accum", "fsdp_bf16_no_recompute"], w,
                "recomputed blocks repeat the same arithmetic on the GPU: BatchNorm's statistics kept once, "
                "bf16 autocast, accumulation and clipping"),
        Launch("transformer_recompute", [torchrun(gpus, copy, [*exact, "--activation-checkpointing",
                                                              "--out-dir", f"{tmp}/tr_ac"])],
               torchrun_s(gpus, TRANSFORMER_S), w,
               "a copy of fsdp.py with tests/test_seam.py's causal transformer as its section, its blocks "
               "recomputed: scaled_dot_product_attention's kernels on the GPU",
               prepare=lambda: transformer_copy(Path(copy))),
        Launch("transformer_plain", [torchrun(gpus, copy, [*exact, "--out-dir", f"{tmp}/tr_plain"])],
               torchrun_s(gpus, TRANSFORMER_S), w, "the same without --activation-checkpointing",
               prepare=lambda: transformer_copy(Path(copy))),
        weights("recompute_is_bitwise_transformer", f"{tmp}/tr_ac", f"{tmp}/tr_plain", 0,
                ["transformer_recompute", "transformer_plain"], w, "the transformer's weights equal bit for bit"),
    ]


def fp16_group(gpus, tmp):
    """(d) fsdp.py in fp16: a GradScaler on sharded gradients."""
    w = world(gpus)
    return [
        Launch("fsdp_fp16", [torchrun(gpus, "fsdp.py", [*small(gpus), "--amp", "fp16", "--clip-grad-norm", "1",
                                                         "--deterministic", "--out-dir", f"{tmp}/fsdp_fp16"])],
               torchrun_s(gpus, FSDP_S), w,
               "fp16 autocast with a GradScaler: unscale_ and its inf check on DTensor gradients, the clip, "
               "skipped steps"),
        validation("fsdp_fp16_validation", f"{tmp}/fsdp_fp16", "fp16", ["fsdp_fp16"], w,
                   "fsdp.py's fp16 validation against model.pt"),
    ]


def speed_group(gpus, tmp):
    """(e) Speed last, side by side: the ceiling (the bare loop on one batch already on the GPU),
    ddp_full.py, and fsdp.py with and without --channels-last (FSDP2 keeps parameters contiguous:
    there the flag reorders only the inputs). --compile is left out: a cold inductor compile takes
    minutes."""
    w = world(gpus)
    return [
        Launch("bare", [BARE], plain_s(BARE_S), "1 process, 1 GPU",
               "the ceiling: forward, backward, step on one batch already on the GPU", speed=True),
        Launch("ddp_full_speed", [torchrun(gpus, "ddp_full.py", [*speed(gpus), "--out-dir", f"{tmp}/s1"])],
               torchrun_s(gpus, SPEED_S), w, "ddp_full.py at its defaults: channels-last, synthetic 224-px data "
                                             "in memory through its loader", speed=True),
        Launch("fsdp_speed", [torchrun(gpus, "fsdp.py", [*speed(gpus), "--out-dir", f"{tmp}/s2"])],
               torchrun_s(gpus, SPEED_S), w, "fsdp.py on the same work, channels-last inputs (its default)",
               speed=True),
        Launch("fsdp_speed_contiguous", [torchrun(gpus, "fsdp.py", [*speed(gpus), "--no-channels-last",
                                                                     "--out-dir", f"{tmp}/s3"])],
               torchrun_s(gpus, SPEED_S), w, "fsdp.py with --no-channels-last", speed=True),
    ]


def plan(gpus, tmp):
    """The check's groups in order: [(key, title, [Launch or Compare])]."""
    return [("a", "every script's CUDA and nccl paths", paths_group(gpus, tmp)),
            ("b", "exact resumes under --deterministic; fsdp.py against ddp_full.py", resume_group(gpus, tmp)),
            ("c", "activation checkpointing against none, bit for bit", recompute_group(gpus, tmp)),
            ("d", "fsdp.py in fp16", fp16_group(gpus, tmp)),
            ("e", "speed", speed_group(gpus, tmp))]


def transformer_copy(path):
    """fsdp.py with its section "your data and model" replaced by the TRANSFORMER section of
    tests/test_seam.py, written to path. The section is read from that file's text: importing the
    test module needs pytest, which a GPU machine may lack."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import ladder  # the seam's replacement, as the tests make their copies (standard library only)

    tree = ast.parse((ROOT / "tests" / "test_seam.py").read_text())
    section = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(target, "id", None) == "TRANSFORMER" for target in node.targets))
    path.write_text(ladder.replace_seam(ladder.read("fsdp.py", ROOT), section))


def compare_weights(a, b):
    """The largest |a - b| / |b| (norms) over the floating tensors of two state dicts, infinite
    where either holds a NaN or an infinity, and whether the keys and every other entry are equal."""
    import torch
    x, y = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    worst, equal = 0.0, x.keys() == y.keys()
    for key in x.keys() & y.keys():
        if x[key].is_floating_point():
            scale = y[key].double().norm().item() or 1.0
            difference = (x[key].double() - y[key].double()).norm().item() / scale
            worst = max(worst, difference if math.isfinite(difference) else math.inf)
        else:
            equal = equal and torch.equal(x[key], y[key])
    return worst, equal


def weights_agree(a, b, rtol):
    """(ok, text): two model.pt files equal bit for bit (rtol 0) or within rtol per tensor."""
    worst, equal = compare_weights(a, b)
    ok = equal and worst <= rtol
    return ok, f"largest relative difference {worst:.2e}; keys and integer entries {'equal' if equal else 'DIFFER'}"


def reference_logits(run_dir, model_name="resnet18", samples=VAL_SAMPLES):
    """run_dir/model.pt on the scripts' first `samples` validation samples, scored in float32 on
    this machine's CPU, in batches of 100: (logits in float64, labels)."""
    import torch
    import torchvision
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from ddp_full import make_synthetic

    model = torchvision.models.get_model(model_name, num_classes=10)
    model.load_state_dict(torch.load(Path(run_dir) / "model.pt", map_location="cpu", weights_only=True))
    model.eval()
    images, labels = make_synthetic(samples, 0, "val", 32).tensors
    with torch.no_grad():
        logits = torch.cat([model(images[i:i + 100]) for i in range(0, samples, 100)])
    return logits.double(), labels


def judge_validation(record, logits, labels, amp):
    """(ok, text): a run's validation record (metrics.jsonl) against reference logits: the same
    number of samples; its count of correct predictions the logits', give or take the samples whose
    two highest logits are a tie (within VALIDATION's tie x the sample's largest |logit|); its mean
    loss within VALIDATION's loss tolerance, relative."""
    import torch.nn.functional as F
    tie, loss_rtol = VALIDATION[amp]
    top_two = logits.topk(2, dim=1).values
    ties = int((top_two[:, 0] - top_two[:, 1] <= tie * logits.abs().amax(dim=1)).sum())
    correct = int((logits.argmax(dim=1) == labels).sum())
    reported = round(record["val_acc"] * len(labels))
    loss = F.cross_entropy(logits, labels).item()
    moved = abs(record["val_loss"] - loss) / abs(loss)
    ok = record["val_samples"] == len(labels) and abs(reported - correct) <= ties and moved <= loss_rtol
    return ok, (f"{record['val_samples']} samples, {reported} correct against {correct} here ({ties} ties within "
                f"{tie:g}); loss {moved:.1e} apart, relative (allowed {loss_rtol:g})")


def validation_agrees(run_dir, amp):
    """(ok, text): the last validation of the run in run_dir against its model.pt scored here."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return judge_validation(json.loads(lines[-1]), *reference_logits(run_dir), amp)


def speed_of(log):
    """(samples/s, peak GiB) from a launch's output: the bare loop's BENCH line, or the last
    progress line of a script (the last epoch's steady speed)."""
    bench = [line for line in log.splitlines() if line.startswith("BENCH ")]
    if bench:
        result = json.loads(bench[-1][6:])
        return result["samples_per_sec"], result.get("peak_memory_gib")
    lines = [line for line in log.splitlines() if re.match(r"epoch \d+/\d+ step ", line)]
    if not lines:
        return None, None
    rate = re.search(r"\| (\d+) samples/s", lines[-1])
    peak = re.search(r"peak memory ([\d.]+) GiB", lines[-1])
    return (float(rate.group(1)) if rate else None), (float(peak.group(1)) if peak else None)


def misuse_in(log):
    """What MISUSE's warnings in a launch's output say, once each."""
    return [why for warning, why in MISUSE.items() if warning in log]


def nondeterministic_in(log):
    """The operations that warned they ran without a deterministic kernel, once each."""
    return sorted({(match.group(1) or match.group(2)).strip() for match in NONDETERMINISTIC.finditer(log)})


def descendants(pid):
    """Every process below pid (Linux's /proc). torchrun starts each worker in a session of its
    own, so stopping the agent's process group would leave its workers running on the GPU."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(process):
    """SIGKILL a launch's process with everything below it, each worker's group (its loader
    workers) included."""
    for pid in [process.pid, *descendants(process.pid)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, 9)
            except OSError:  # not a group leader, or gone already
                pass
    process.wait()


def run_launch(launch, logs, deadline, limit):
    """Start the launch's commands together and wait for them, until the deadline at most, where
    they are stopped with all their processes. Returns (result, seconds, output)."""
    log_path = logs / f"{launch.name}.log"
    start = time.monotonic()
    try:
        if launch.prepare:
            launch.prepare()
    except Exception as err:  # what it needs could not be made: the launch cannot start
        log_path.write_text(f"{type(err).__name__}: {err}\n")
        return f"FAILED: not started ({type(err).__name__}: {err})", time.monotonic() - start, str(err)
    with open(log_path, "w") as log:
        processes = [subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True) for command in launch.commands]
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for process, code in zip(processes, codes):
            if code is None:
                stop(process)
    seconds, output = time.monotonic() - start, log_path.read_text(errors="replace")
    if None in codes:
        return f"cut off at the total of {limit:g} s (logs/{log_path.name})", seconds, output
    misuse = misuse_in(output)
    if launch.trial and any(codes) and not misuse:
        errors = [line for line in output.splitlines() if "Error" in line or "error:" in line]
        return f"not here: {(errors or [f'exit {max(codes)}'])[-1].strip()[:200]}", seconds, output
    if any(codes) or misuse:
        why = ([f"exit {max(codes)}"] if any(codes) else []) + [f"warned: {text}" for text in misuse]
        return f"FAILED: {'; '.join(why)} (logs/{log_path.name})", seconds, output
    warned = nondeterministic_in(output)
    return "ok" + (f" (no deterministic kernel, warned: {', '.join(warned)})" if warned else ""), seconds, output


def run_compare(compare, results):
    """Run a Compare if the launches it needs ended ok. Returns (result, seconds)."""
    failed = [name for name in compare.needs if not results.get(name, "").startswith("ok")]
    if failed:
        return f"not run: {', '.join(failed)} did not end ok", 0.0
    start = time.monotonic()
    try:
        ok, text = compare.check()
    except Exception as err:  # a file missing or unreadable: the run before it did not write it
        ok, text = False, f"{type(err).__name__}: {err}"
    return f"{'ok' if ok else 'FAILED'} ({text})", time.monotonic() - start


def cell(text):
    """Text for a table cell: a log line's | would end the cell."""
    return text.replace("|", "\\|")


def pack(logs, out):
    """logs/ into out/logs.tar.gz, anew."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")


def run_plan(groups, out, logs, limit, gpus=1, start=START, header=()):
    """Run the plan's checks in order: a row appended to out/gpu_check.md as each ends, the logs
    packed as each launch ends. At start + limit the launch running is cut off, and the checks
    after it are "not run" rows. Returns (whether all passed, {launch: (samples/s, peak GiB)})."""
    deadline = start + limit
    table = out / "gpu_check.md"
    table.write_text("\n".join([*header, "| check | world | result | seconds | what it shows |",
                                "| --- | --- | --- | --- | --- |"]) + "\n")
    results, speeds, passed, spent = {}, {}, True, False
    for key, _, items in groups:
        for item in items:
            output, estimate = "", f"est. {item.estimate:g}"
            # A launch starts while any time is left (the total cuts it off); a compare, which is not
            # stopped midway, only where its estimate fits.
            left = deadline - time.monotonic()
            if spent or left <= 0 or isinstance(item, Compare) and left < item.estimate:
                spent, result, seconds = True, "not run: the total was spent", None
            elif isinstance(item, Compare):
                result, seconds = run_compare(item, results)
                seconds = None if result.startswith("not run") else seconds
            else:
                result, seconds, output = run_launch(item, logs, deadline, limit)
                spent = result.startswith("cut off")
                pack(logs, out)
            results[item.name] = result
            passed = passed and result.startswith(("ok", "not here"))
            if isinstance(item, Launch) and item.speed and output:
                speeds[item.name] = speed_of(output)
            took = f"{seconds:.0f} ({estimate})" if seconds is not None else f"- ({estimate})"
            with open(table, "a") as f:
                f.write(f"| ({key}) {item.name} | {item.world} | {cell(result)} | {took} | {cell(item.shows)} |\n")
            print(f"gpu_check: ({key}) {item.name}: {result}" + (f" in {seconds:.0f} s" if seconds is not None else ""),
                  flush=True)
    if speeds:
        with open(table, "a") as f:
            f.write("\n".join(speed_table(speeds, gpus)) + "\n")
    return passed, speeds


def speed_table(speeds, gpus):
    """Samples/s and peak memory of the speed rows, each as a share of the bare loop's rate times
    the number of GPUs (the ceiling)."""
    ceiling = (speeds.get("bare") or (None, None))[0]
    rows = ["", f"Samples/s (all processes) and peak memory per process; the ceiling is the bare loop on one GPU "
                f"times {gpus}.", "", "| program | samples/s | of the ceiling | peak memory (GiB) |",
            "| --- | --- | --- | --- |"]
    for name, (rate, peak) in speeds.items():
        share = f"{rate / (ceiling * gpus):.2f}" if rate and ceiling else "-"
        rows.append(f"| {name} | {rate if rate is not None else '-'} | {share} | {peak if peak is not None else '-'} |")
    return rows


def header(gpus, limit):
    """The table's heading: the machine, the torch it ran on, the date, how to read the rows."""
    import torch
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a torch built without nccl
        nccl = "none"
    return ["# GPU check", "",
            f"`python bench/gpu_check.py` on {time.strftime('%Y-%m-%d', time.gmtime())}: {gpus} x "
            f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}, nccl {nccl}), Python {sys.version.split()[0]}.", "",
            "Rows in the order they ran, each written as it ended. The world column says how many processes a "
            "check ran in: in a world of one no collective crosses processes and nothing is sharded; two "
            "processes on one GPU cross processes over gloo, not nccl. Seconds beside each estimate; no launch "
            f"fails for time alone, but the check stops at the total of {limit:g} s.", ""]


def free_port():
    """A port free on this machine now, for two agents' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dry_run(groups, limit):
    """Print the plan: each check's estimate, world, what it shows and its commands (or what it
    compares), and the total. Returns the exit status: 0 when the estimates fit the limit."""
    items = [item for _, _, group in groups for item in group]
    for key, title, group in groups:
        print(f"## ({key}) {title}")
        for item in group:
            where = "in this process, " if isinstance(item, Compare) else ""
            print(f"# ({key}) {item.name}: est. {item.estimate:g} s, {where}{item.world}: {item.shows}")
            if isinstance(item, Compare):
                print(f"#   compares {item.describe}")
            for command in getattr(item, "commands", []):
                print(shlex.join(command))
    total = sum(item.estimate for item in items)
    launches = sum(isinstance(item, Launch) for item in items)
    print(f"# {len(items)} checks ({launches} launches) in {len(groups)} groups, estimates adding up to "
          f"{total:g} s of {limit:g} s")
    return 0 if total <= limit else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", help="where gpu_check.md and logs.tar.gz go (required unless --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimates; run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: those visible; 1 in a dry run)")
    parser.add_argument("--limit", type=float, default=LIMIT_S,
                        help=f"the total in seconds: a hard stop, and what the estimates must fit (default: {LIMIT_S})")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        parser.error("--gpus must be at least 1")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_{os.getpid()}"
    if args.dry_run:
        return dry_run(plan(args.gpus or 1, tmp), args.limit)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible", file=sys.stderr)
        return 2
    if args.out_dir is None:
        parser.error("OUT_DIR is required, except with --dry-run")
    gpus = args.gpus or torch.cuda.device_count()
    out, logs = Path(args.out_dir), tmp / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        passed, _ = run_plan(plan(gpus, tmp), out, logs, args.limit, gpus, header=header(gpus, args.limit))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the runs' checkpoints and models: what they showed is in the table
    print((out / "gpu_check.md").read_text())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
