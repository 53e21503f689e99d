"""The GPU check: what the CPU suite can only stand in for, a correctness verdict first and speed after.

    python bench/gpu_check.py runs/gpu_check                  # every group on the visible GPUs
    python bench/gpu_check.py runs/gpu_check --groups c,d     # only these groups (each carries its own runs)
    python bench/gpu_check.py --dry-run [--gpus N]            # the plan and its estimates; no GPU

Correctness, in the order of what it proves that nothing else can (its plan at most 240 s):
  (a) every script's CUDA and nccl paths (on one GPU also two processes sharing it, over gloo), and
      --profile's traces of CUDA kernels, drawn as the 2 -> 3 page's timeline (logs/ddp-timeline-gpu.png);
  (b) exact resumes: ddp_full.py and fsdp.py stopped by SIGTERM and restarted by torchrun, each
      against its run never stopped, bit for bit, and fsdp.py against ddp_full.py;
  (c) fsdp.py in fp16 with fused AdamW on sharded parameters, activation checkpointing against none;
  (d) attention under --deterministic: a transformer of 256 tokens in bf16, recomputed against not.
Then speed, reported apart: (e) the bare loop, ddp_full.py, fsdp.py with and without --channels-last.

A group's runs start together, each on GPUs of its own (one GPU: each a world of one on it), and
the group compares them: no group needs another's runs, so --groups reruns any of them alone. The
estimates are at least 1.5x the CPU-side part measured on the dev machine (bench/launch_costs.py:
Python with torch, torchrun's agent, set-up and teardown), printed beside it. Each launch has a cap
of CAP x its estimate: a launch past it is stopped with all its processes, a failed row, and the
checks after it run; multi-process runs wait at most TIMEOUT_MIN on a dead peer. --limit is the
hard stop of the whole: the launch running is stopped, the checks after it are "not run" rows.
Rows go to OUT_DIR/gpu_check.md (its header names the command), each written as its check ends;
every launch's output to logs/ in OUT_DIR/logs.tar.gz, packed anew as each launch ends.
Exit status: 0 every correctness check ok (speed is reported, its own line), 1 a correctness check
failed or was not run, 2 no CUDA or bad arguments.
"""
import argparse
import ast
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

START = time.monotonic()  # the total counts from the check's own start, torch's import included
ROOT = Path(__file__).resolve().parent.parent
# One command of at most 7 minutes: with the machine's start (minutes) and one partial rerun it fits
# the 15 minutes a GPU machine is lent, at most 10 a command. Correctness is planned first, in 4.
LIMIT_S, CORRECTNESS_S = 420, 240
VAL_SAMPLES, BATCH, STEPS = 500, 128, 16  # each run: STEPS steps of BATCH samples in each process
CAP = 4            # a launch is stopped at CAP x its estimate: a hang costs its own row only
TIMEOUT_MIN = 1    # --timeout-min of every run of several processes: a dead peer ends the run
MARGIN = 1.5       # each estimate's CPU-side part: at least 1.5x what it measured on the dev machine

# CPU_S: seconds of each launch's CPU-side part, measured by bench/launch_costs.py (the median of 3)
# on the dev machine, a 2-core AMD EPYC (family 25), torch 2.14.1, on 2026-12-07: the whole launch of
# a script with almost no work (2 steps of resnet18 on 32 images: its imports, torchrun's agent, the
# process group, teardown). The GPU machine has 16 cores: a group's runs import side by side.
CPU_S = {"cold import": 23.0,   # import torch, torchvision, the file cache dropped: 7.6 here; 23 s
                                # measured once on this machine kind (issue 62), the larger kept
         "agent": 3.0,          # torchrun's agent alone (--help: its own import of torch)
         "plain": 6.5,          # python single_gpu.py
         "plain fsdp": 7.3,     # python fsdp.py
         "torchrun": 8.7,       # torchrun ddp_full.py, one process
         "torchrun fsdp": 9.6,  # torchrun fsdp.py, one process
         "two agents": 11.7,    # two torchrun agents of ddp_full.py joined over gloo
         "compare": 0.2,        # two resnet18 model.pt files loaded and compared in this process
         "validation": 0.8,     # resnet18 scores 500 samples on the CPU in this process
         "timeline": 1.0}       # tools/draw_timeline.py on two resnet18 traces of 2.3 MB (CPU: 2 processes)
TRACE_GROWTH = 3  # a GPU trace: each op's launch and its kernel beside it, about 3x a CPU trace's events
# GPU-side parts, reasoned, not measured (no GPU has run this check): CUDA's context with cuDNN's
# and cuBLAS's first loads, nccl's set-up and first collective, and the work itself.
CUDA_S = 3
PROFILE_S = 3  # --profile's CUDA activity (CUPTI's start) and its trace written
COLD_S = 10  # the first launch: cuDNN's libraries and torchvision read from a cold disk
WORK_S = {"resnet18": 3,        # 16 steps of 128 at 32 px, 500 samples validated, checkpoints
          "transformer": 3,     # 16 steps of 8 sequences of 256 tokens, math attention
          "bare": 6,            # resnet50, 40 steps of 64 at 224 px, cudnn.benchmark timing
          "speed": 9}           # 1,024 images made, 2 epochs of 15 steps at 224 px, checkpoints


def nccl_s(gpus):
    """nccl's set-up and first collective: more GPUs, more to connect."""
    return 2 if gpus == 1 else 4


def estimate(kind, gpus, work, runs=1, restart=False):
    """(estimate, CPU-side part) of a launch of `runs` runs of one kind started together, each on
    `gpus` GPUs of its own, or sharing one GPU where gpus is 1 and runs several: their GPU work adds
    up. A restart (torchrun's, after a SIGTERM) pays a worker's start again."""
    cpu = CPU_S[kind] + (CPU_S[kind] - CPU_S["agent"] if restart else 0)
    cpu *= 1 + 0.1 * (runs - 1)  # side by side on 16 cores: each run's imports slow the others a little
    gpu = (CUDA_S + (0 if kind.startswith("plain") else nccl_s(gpus))) * (2 if restart else 1)
    gpu += WORK_S[work] * (runs if gpus == 1 else 1)
    return math.ceil(MARGIN * cpu + gpu), cpu


def plus(planned, seconds):
    """An estimate with seconds more on its GPU side (its CPU-side part as measured)."""
    return planned[0] + seconds, planned[1]


def small(nproc):
    """resnet18 on the scripts' synthetic 32x32 data: 16 steps of 128 in each of nproc processes,
    enough for a resume mid-epoch whatever the number of GPUs."""
    return ["--model", "resnet18", "--train-samples", str(STEPS * BATCH * nproc), "--val-samples",
            str(VAL_SAMPLES), "--epochs", "1", "--batch-size", str(BATCH), "--log-interval", str(STEPS // 2)]


def dropout(nproc):
    """A model with dropout and BatchNorm: every training step draws random numbers on the GPU."""
    return [*small(nproc), "--model", "mobilenet_v3_small"]


def transformer(nproc):
    """The causal transformer of tests/test_seam.py at 256 tokens (two key blocks of 128 and more):
    16 steps of 8 sequences in each process."""
    return ["--sequences", str(128 * nproc), "--epochs", "1", "--batch-size", "8", "--lr", "0.05",
            "--log-interval", "1000"]


def speed(nproc):
    """resnet50 at 224 px in bf16: 2 epochs of 15 steps of 64 a process; the second epoch's rate
    is the steady one (the first holds cudnn.benchmark's timing)."""
    return ["--model", "resnet50", "--image-size", "224", "--amp", "bf16", "--batch-size", "64", "--epochs", "2",
            "--train-samples", str(64 * 15 * nproc), "--val-samples", "64", "--log-interval", "5", "--resume", "none"]


BARE = [sys.executable, "bench/bare.py", "--model", "resnet50", "--image-size", "224", "--batch-size", "64",
        "--steps", "30", "--warmup", "10", "--amp", "bf16", "--mode", "plain"]


def sigterm():
    """SIGTERM as a scheduler sends it, to rank 0 as its loader draws the first sample of its 11th
    batch of 16 (tests/sigterm_at_sample.py): a checkpoint at an agreed step of 11 or 12, exit 75,
    and torchrun's restart resumes with 5 steps or fewer to go, too few samples to meet it again."""
    return {"SIGTERM_IN": "train", "SIGTERM_RANK": "0", "SIGTERM_AT_SAMPLE": str(STEPS * 5 // 8 * BATCH)}


# What the two runs stopped by SIGTERM and restarted print, each once: the checkpoint's line, torchrun's
# record of the exit status 75 (2.11's and 2.14.1's wording), the resume's line.
PREEMPTED = {"preempted at step": 2, "failed (exitcode: 75)": 2, "resumed from": 2}

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
# fsdp.py against ddp_full.py, both float32 SGD under --deterministic, the same seed and data order:
# the same arithmetic, summed in other orders across GPUs (reduce-scatters and DTensor's foreach
# steps against all-reduces and plain ones). What it allows: each tensor of the weights and
# buffers within FSDP_RTOL of ddp_full.py's, relative to its norm. Measured on CPU (gloo, this
# check's mobilenet_v3_small with dropout, 2 processes, 8 steps): 0, bit for bit. Rounding across
# GPUs adds about 1e-7 relative a step, under 1e-5 after 16 steps; a lost piece of state (momentum,
# the schedule's position, the data order, a dropout mask) changes a whole step's update, about
# lr x gradient: 1e-3 of a tensor's norm or more, ten times what it allows.
FSDP_RTOL = 1e-4

# Warnings that mean FSDP or DTensor was misused, whatever the exit status: the run went on doing
# wrong or missing work. Any of them in a launch's output fails its row. Each as the torch that
# runs writes it, read in its source (2.11.0 and 2.14.1):
# - "did not run forward before backward": torch 2.11's FSDPParamGroup state (_fsdp_state.py,
#   _finalize_backward, a warning_once) when a unit's pre-backward logic never ran; torch 2.14.1
#   has no such check (nothing to match there: the check's bitwise rows catch what it would).
# - "DTensor is synchronizing RNG states": both (tensor/_random.py), processes seeded differently.
# Not FSDP2's "returned a view tensor" (2.14.1): it fires whenever a unit's output is a view (a
# Linear over a sequence returns one) and warns of a mistake an in-place op would make.
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
    """A check that starts processes: its runs [(command, extra environment)], started together,
    its estimate and the CPU-side part of it, the world it runs in and what it shows. `expect`:
    {text: times} its output must hold; `prepare` makes what it needs first (a file); `speed`: its
    rate goes to the speed table. A port written {port} in a command is chosen as the launch starts."""

    def __init__(self, name, runs, estimate, world, shows, prepare=None, speed=False, expect=None):
        self.name, self.runs, self.world, self.shows = name, runs, world, shows
        self.estimate, self.cpu = estimate if isinstance(estimate, tuple) else (estimate, 0.0)
        self.prepare, self.speed, self.expect = prepare, speed, expect or {}

    @property
    def commands(self):
        return [command for command, _ in self.runs]


class Compare:
    """A check in this process, no launch: `check()` returns (ok, text) from the outputs of the
    launches it needs, each of which must have ended ok; `describe` says what it compares."""

    def __init__(self, name, needs, check, estimate, world, shows, describe, cpu=0.0):
        self.name, self.needs, self.check, self.estimate = name, needs, check, estimate
        self.world, self.shows, self.describe, self.cpu = world, shows, describe, cpu


# The workers reach their agent's store at this address, not at the machine's name (which an
# isolated machine may not resolve).
LOCAL_ADDR = "--local-addr=127.0.0.1"


def torchrun(nproc, script, args, restarts=0):
    """torchrun of nproc processes on this machine, one per GPU."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *([f"--max-restarts={restarts}"] if restarts else []), LOCAL_ADDR, script, *args]


def two_agents(script, args, rdzv_id):
    """Two torchrun agents of one process each, joined by a rendezvous on this machine (its port
    chosen as the launch starts): two processes of LOCAL_RANK 0, so both drive GPU 0."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", LOCAL_ADDR,
             "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}", script, *args]
    return [(agent, {}), (list(agent), {})]


def world(nproc):
    """The world column of a run of nproc processes, one per GPU."""
    return "1 process (a world of one)" if nproc == 1 else f"{nproc} processes, 1 per GPU"


TWO_ON_ONE = "2 processes on 1 GPU (gloo)"


def placement(gpus, runs):
    """[(CUDA_VISIBLE_DEVICES, processes)] for `runs` runs started together: each its own share of
    the GPUs, or, with fewer GPUs than runs, each a world of one, several to a GPU. No GPU is shared
    by runs of several processes (nccl takes one GPU per process)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(gpus)]
    share = gpus // runs
    if share == 0:
        return [(devices[i % gpus], 1) for i in range(runs)]
    return [(",".join(devices[i * share:(i + 1) * share]), share) for i in range(runs)]


def side_by_side(gpus, runs):
    """The world column of runs started together."""
    share = max(gpus // runs, 1)
    where = (f"{share} GPU{'s' if share > 1 else ''} each" if gpus >= runs else "sharing 1 GPU" if gpus == 1
             else f"on {gpus} GPUs, several to a GPU")
    return f"{runs} runs of {share} process{'es' if share > 1 else ''}, {where}"


def weights(name, a, b, rtol, needs, where, shows):
    """A Compare of model.pt in run directories a and b: bit for bit (rtol 0), or each floating
    tensor within rtol of b's, relative to its norm."""
    how = "bit for bit" if rtol == 0 else f"each tensor within {rtol:g} of its norm"
    return Compare(name, needs, lambda: weights_agree(Path(a) / "model.pt", Path(b) / "model.pt", rtol),
                   math.ceil(MARGIN * CPU_S["compare"]), where, shows, f"{a}/model.pt against {b}/model.pt, {how}",
                   CPU_S["compare"])


def validation(name, run_dir, amp, needs, where, shows, model="resnet18"):
    """A Compare of a run's last validation with its model.pt scored here in float32."""
    tie, loss = VALIDATION[amp]
    return Compare(name, needs, lambda: validation_agrees(run_dir, amp, model),
                   math.ceil(MARGIN * CPU_S["validation"]), where, shows,
                   f"{run_dir}/metrics.jsonl against {run_dir}/model.pt scored here in float32: correct counts "
                   f"equal but for ties within {tie:g}, the loss within {loss:g} ({amp})", CPU_S["validation"])


def paths_group(gpus, tmp):
    """(a) Every script's CUDA and nccl paths; on one GPU, two processes sharing it."""
    w, one = world(gpus), "1 process, 1 GPU"
    items = [
        Launch("single_gpu", [([sys.executable, "single_gpu.py", *small(1), "--out-dir", f"{tmp}/single"], {})],
               plus(estimate("plain", 1, "resnet18"), COLD_S), one,
               "CUDA device, pinned memory, channels-last, TF32, cudnn.benchmark; the first CUDA start-up"),
    ]
    if gpus > 1:  # on one GPU nn.DataParallel calls the model as it is: single_gpu.py's path
        items.append(Launch("dataparallel", [([sys.executable, "dataparallel.py", *small(1), "--out-dir",
                                               f"{tmp}/dp"], {})], estimate("plain", 1, "resnet18"),
                            f"1 process, {gpus} GPUs", "nn.DataParallel over every visible GPU"))
    items += [
        Launch("amp_fp16_accum_nccl", [(torchrun(gpus, "ddp_amp_accum.py", [
            *small(gpus), "--backend", "nccl", "--amp", "fp16", "--accum-steps", "2", "--clip-grad-norm", "1",
            "--optimizer", "adamw", "--profile", "--timeout-min", str(TIMEOUT_MIN), "--out-dir", f"{tmp}/amp"]), {})],
            plus(estimate("torchrun", gpus, "resnet18"), PROFILE_S), w,
            "DDP over nccl (ddp_basic.py's path and more): set_device, DistributedSampler, fp16 autocast "
            "with a GradScaler, no_sync accumulation, clipping after unscale_, fused AdamW; --profile with CUDA",
            expect={"3 steps profiled:": gpus}),
        Compare("gpu_timeline", ["amp_fp16_accum_nccl"], lambda: gpu_timeline(f"{tmp}/amp", gpus, tmp / "logs"),
                math.ceil(MARGIN * TRACE_GROWTH * CPU_S["timeline"]), w,
                "--profile on a GPU: each process's trace holds CUDA kernels (nccl's among them on 2 GPUs or "
                "more), drawn as the 2 -> 3 page's picture",
                f"{tmp}/amp/profile_rank*.json drawn by tools/draw_timeline.py into logs/ddp-timeline-gpu.png",
                CPU_S["timeline"]),
    ]
    if gpus == 1:
        items += [
            Launch("two_on_one_gpu_full", two_agents("ddp_full.py", [
                *small(2), "--backend", "gloo", "--sync-bn", "--amp", "bf16", "--deterministic",
                "--timeout-min", str(TIMEOUT_MIN), "--out-dir", f"{tmp}/two"], "gpu-check"),
                   estimate("two agents", 1, "resnet18", runs=2), TWO_ON_ONE,
                   "ddp_full.py across processes on a GPU: DDP's all-reduce of CUDA tensors, SyncBatchNorm, "
                   "rank 0's buffers broadcast, validation over two shards (gloo, not nccl)"),
            validation("two_on_one_gpu_validation", f"{tmp}/two", "bf16", ["two_on_one_gpu_full"], TWO_ON_ONE,
                       "that run's validation over two shards scores model.pt as one process does"),
        ]
    return items


def resume_group(gpus, tmp):
    """(b) Exact resumes on the GPU: ddp_full.py and fsdp.py with dropout (mobilenet_v3_small),
    each stopped by SIGTERM and restarted by torchrun, against the same run never stopped; fsdp.py
    against ddp_full.py. Four runs started together."""
    (d1, n), (d2, _), (d3, _), (d4, _) = placement(gpus, 4)
    args = [*dropout(n), "--deterministic", "--timeout-min", str(TIMEOUT_MIN)]
    w = side_by_side(gpus, 4)
    runs = [(torchrun(n, "ddp_full.py", [*args, "--out-dir", f"{tmp}/ddp"]), {"CUDA_VISIBLE_DEVICES": d1}),
            (torchrun(n, "tests/sigterm_at_sample.py", ["ddp_full.py", *args, "--out-dir", f"{tmp}/ddp_stopped"],
                      restarts=1), {"CUDA_VISIBLE_DEVICES": d2, **sigterm()}),
            (torchrun(n, "fsdp.py", [*args, "--out-dir", f"{tmp}/fsdp"]), {"CUDA_VISIBLE_DEVICES": d3}),
            (torchrun(n, "tests/sigterm_at_sample.py", ["fsdp.py", *args, "--out-dir", f"{tmp}/fsdp_stopped"],
                      restarts=1), {"CUDA_VISIBLE_DEVICES": d4, **sigterm()})]
    return [
        Launch("resumes", runs, estimate("torchrun fsdp", n if gpus >= 4 else 1, "resnet18", runs=4, restart=True),
               w, "ddp_full.py and fsdp.py, float32 under --deterministic, each straight and stopped by SIGTERM "
                  "mid-epoch (checkpoint, exit 75) then restarted by torchrun (--max-restarts=1): random "
                  "states, BatchNorm statistics and the sharded checkpoint (dcp) restored on the GPU",
               expect=PREEMPTED),
        weights("ddp_full_resume_is_bitwise", f"{tmp}/ddp_stopped", f"{tmp}/ddp", 0, ["resumes"], w,
                "resumed and straight weights equal bit for bit: dropout drew the same numbers after the resume"),
        weights("fsdp_resume_is_bitwise", f"{tmp}/fsdp_stopped", f"{tmp}/fsdp", 0, ["resumes"], w,
                "the same for fsdp.py, resumed from its sharded checkpoint"),
        weights("fsdp_trains_what_ddp_trains", f"{tmp}/fsdp", f"{tmp}/ddp", FSDP_RTOL, ["resumes"], w,
                f"fsdp.py's weights within {FSDP_RTOL:g} of ddp_full.py's, per tensor (other orders of "
                "summing are rounding; a lost piece of state moves a step's update, 1e-3 or more)"),
        validation("ddp_full_validation", f"{tmp}/ddp", "none", ["resumes"], w,
                   "ddp_full.py's sharded validation with rank 0's BatchNorm statistics scores model.pt as one "
                   "process does", model="mobilenet_v3_small"),
        validation("fsdp_validation", f"{tmp}/fsdp", "none", ["resumes"], w,
                   "fsdp.py's validation against model.pt gathered to rank 0", model="mobilenet_v3_small"),
    ]


def fp16_group(gpus, tmp):
    """(c) fsdp.py in fp16 with fused AdamW on sharded parameters, with activation checkpointing
    and without: two runs started together (on one GPU, plain python: a world of one)."""
    (d1, n), (d2, _) = placement(gpus, 2)
    args = [*small(n), "--amp", "fp16", "--accum-steps", "2", "--clip-grad-norm", "1", "--optimizer", "adamw",
            "--deterministic", "--timeout-min", str(TIMEOUT_MIN), *(["--replicas", "2"] if n % 2 == 0 else [])]

    def run(out, devices, *extra):
        command = ([sys.executable, "fsdp.py"] if n == 1 else torchrun(n, "fsdp.py", []))
        return [*command, *args, *extra, "--out-dir", f"{tmp}/{out}"], {"CUDA_VISIBLE_DEVICES": devices}

    w = side_by_side(gpus, 2)
    return [
        Launch("fsdp_fp16_adamw", [run("fp16_ac", d1, "--activation-checkpointing"), run("fp16", d2)],
               estimate("plain fsdp" if n == 1 else "torchrun fsdp", n, "resnet18", runs=2), w,
               ("plain `python fsdp.py` on one GPU: " if n == 1 else "")
               + "fp16 autocast with a GradScaler (unscale_ and its inf check on DTensor gradients), fused AdamW "
                 "on sharded parameters, accumulation, the global-norm clip, the model built on the meta device "
                 "and filled from rank 0's copy" + (", hybrid sharding: 2 replicas" if n % 2 == 0 else "")
               + "; with and without activation checkpointing"),
        weights("recompute_is_bitwise_fp16", f"{tmp}/fp16_ac", f"{tmp}/fp16", 0, ["fsdp_fp16_adamw"], w,
                "recomputed blocks repeat the same arithmetic on the GPU: BatchNorm's statistics kept once"),
        validation("fsdp_fp16_validation", f"{tmp}/fp16", "fp16", ["fsdp_fp16_adamw"], w,
                   "fsdp.py's fp16 validation against model.pt"),
    ]


def attention_group(gpus, tmp):
    """(d) Attention's backward under --deterministic: tests/test_seam.py's causal transformer at 256
    tokens in bf16 (FSDP's bf16 policy), recomputed and not: two runs started together."""
    (d1, n), (d2, _) = placement(gpus, 2)
    copy = f"{tmp}/fsdp_transformer.py"
    args = [*transformer(n), "--amp", "bf16", "--deterministic", "--timeout-min", str(TIMEOUT_MIN)]
    w = side_by_side(gpus, 2)
    return [
        Launch("transformer_bf16", [
            (torchrun(n, copy, [*args, "--activation-checkpointing", "--out-dir", f"{tmp}/tr_ac"]),
             {"CUDA_VISIBLE_DEVICES": d1}),
            (torchrun(n, copy, [*args, "--out-dir", f"{tmp}/tr"]), {"CUDA_VISIBLE_DEVICES": d2})],
               estimate("torchrun fsdp", n, "transformer", runs=2), w,
               "a copy of fsdp.py with tests/test_seam.py's causal transformer as its section, 256 tokens "
               "(several key blocks), bf16 under FSDP's policy, its blocks recomputed in one run: "
               "scaled_dot_product_attention's backward under --deterministic",
               prepare=lambda: transformer_copy(Path(copy), length=256)),
        weights("attention_is_bitwise", f"{tmp}/tr_ac", f"{tmp}/tr", 0, ["transformer_bf16"], w,
                "the transformer's weights equal bit for bit: attention's backward summed in one order"),
    ]


def speed_group(gpus, tmp):
    """(e) Speed last, side by side: the ceiling (the bare loop on one batch already on the GPU),
    ddp_full.py, and fsdp.py with and without --channels-last (FSDP2 keeps parameters contiguous:
    there the flag reorders only the inputs). --compile is left out: a cold inductor compile takes
    minutes."""
    w = world(gpus)
    return [
        Launch("bare", [(BARE, {})], estimate("plain", 1, "bare"), "1 process, 1 GPU",
               "the ceiling: forward, backward, step on one batch already on the GPU", speed=True),
        Launch("ddp_full_speed", [(torchrun(gpus, "ddp_full.py", [*speed(gpus), "--out-dir", f"{tmp}/s1"]), {})],
               estimate("torchrun", gpus, "speed"), w, "ddp_full.py at its defaults: channels-last, synthetic "
                                                       "224-px data in memory through its loader", speed=True),
        Launch("fsdp_speed", [(torchrun(gpus, "fsdp.py", [*speed(gpus), "--out-dir", f"{tmp}/s2"]), {})],
               estimate("torchrun fsdp", gpus, "speed"), w, "fsdp.py on the same work, channels-last inputs "
                                                            "(its default)", speed=True),
        Launch("fsdp_speed_contiguous", [(torchrun(gpus, "fsdp.py", [*speed(gpus), "--no-channels-last",
                                                                      "--out-dir", f"{tmp}/s3"]), {})],
               estimate("torchrun fsdp", gpus, "speed"), w, "fsdp.py with --no-channels-last", speed=True),
    ]


GROUPS = {"a": ("every script's CUDA and nccl paths", paths_group),
          "b": ("exact resumes after SIGTERM; fsdp.py against ddp_full.py", resume_group),
          "c": ("fsdp.py in fp16 with fused AdamW; activation checkpointing against none", fp16_group),
          "d": ("attention under --deterministic, bit for bit", attention_group),
          "e": ("speed", speed_group)}
SPEED = {"e"}  # reported apart: not part of the correctness verdict


def plan(gpus, tmp, keys=tuple(GROUPS)):
    """The check's groups in order: [(key, title, [Launch or Compare])], those of `keys` only."""
    return [(key, title, group(gpus, tmp)) for key, (title, group) in GROUPS.items() if key in keys]


def transformer_copy(path, length=None):
    """fsdp.py with its section "your data and model" replaced by the TRANSFORMER section of
    tests/test_seam.py (its sequences `length` tokens long where given), written to path. The section
    is read from that file's text: importing the test module needs pytest, which a GPU machine may
    lack."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import ladder  # the seam's replacement, as the tests make their copies (standard library only)

    tree = ast.parse((ROOT / "tests" / "test_seam.py").read_text())
    section = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(target, "id", None) == "TRANSFORMER" for target in node.targets))
    if length is not None:
        constants = "VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 32, 16, 32, 4, 4"
        assert constants in section, "tests/test_seam.py's TRANSFORMER no longer sets its sizes in one line"
        section = section.replace(constants, f"VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 32, {length}, 32, 4, 4")
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


def gpu_timeline(run_dir, gpus, logs):
    """--profile's traces of a run over nccl: every process's holds CUDA kernels; the first two
    processes' step drawn into logs/ddp-timeline-gpu.png, their traces copied beside it."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import draw_timeline
    traces = [Path(run_dir) / f"profile_rank{rank}.json" for rank in range(gpus)]
    counts = []
    for trace in traces:
        kernels = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
        counts.append((len(kernels), sum("nccl" in name.lower() for name in kernels)))
    if not all(kernels for kernels, _ in counts):
        return False, f"a trace without CUDA kernels (kernels, nccl's, per process: {counts})"
    for trace in traces[:2]:
        shutil.copy(trace, logs / trace.name)
    draw_timeline.draw(traces[:2], logs / "ddp-timeline-gpu.png", f"ddp_amp_accum.py --model resnet18 --amp fp16 "
                       f"--accum-steps 2 --profile, {gpus} GPU{'s' if gpus > 1 else ''} over nccl")
    return True, f"kernels, nccl's among them, per process: {counts}; drew logs/ddp-timeline-gpu.png"


def reference_logits(run_dir, model_name="resnet18", samples=None):
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
    samples = samples or VAL_SAMPLES
    images, labels = make_synthetic(samples, 0, "val", 32).tensors
    with torch.no_grad():
        logits = torch.cat([model(images[i:i + 100]) for i in range(0, samples, 100)])
    return logits.double(), labels


def judge_validation(record, logits, labels, amp):
    """(ok, text): a run's validation record (metrics.jsonl) against reference logits: the same
    number of samples; its count of correct predictions the logits', give or take the samples whose
    two highest logits are a tie (within VALIDATION's tie x the sample's largest |logit|); its mean
    loss within VALIDATION's loss tolerance, relative, or within tie x the logits' scale (the mean of
    each sample's largest |logit|): logits that each move by at most half a tie move a sample's
    cross-entropy by at most tie x its largest |logit|, which large logits make more than the loss."""
    import torch.nn.functional as F
    tie, loss_rtol = VALIDATION[amp]
    top_two = logits.topk(2, dim=1).values
    ties = int((top_two[:, 0] - top_two[:, 1] <= tie * logits.abs().amax(dim=1)).sum())
    correct = int((logits.argmax(dim=1) == labels).sum())
    reported = round(record["val_acc"] * len(labels))
    loss = F.cross_entropy(logits, labels).item()
    scale = logits.abs().amax(dim=1).mean().item()
    moved, allowed = abs(record["val_loss"] - loss), max(loss_rtol * abs(loss), tie * scale)
    ok = record["val_samples"] == len(labels) and abs(reported - correct) <= ties and moved <= allowed
    return ok, (f"{record['val_samples']} samples, {reported} correct against {correct} here ({ties} ties within "
                f"{tie:g}); loss {moved:.1e} apart (allowed {allowed:.1e}: {loss_rtol:g} of it or {tie:g} of the "
                f"logits' scale)")


def validation_agrees(run_dir, amp, model_name="resnet18"):
    """(ok, text): the last validation of the run in run_dir against its model.pt scored here."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return judge_validation(json.loads(lines[-1]), *reference_logits(run_dir, model_name), amp)


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
        if fields[0] != "Z":  # a zombie is dead already, its parent yet to reap it
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(process):
    """SIGKILL a launch's process with everything below it, each worker's group (its loader
    workers) included. The process is stopped first: torchrun restarting its workers meanwhile
    would leave the new ones, unlisted, running on the GPU."""
    try:
        os.kill(process.pid, signal.SIGSTOP)
    except OSError:  # gone already
        pass
    for _ in range(10):
        below = descendants(process.pid)
        for pid in below:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:  # not a group leader, or gone already
                    pass
        if not below:
            break
        time.sleep(0.1)
    for kill in (os.killpg, os.kill):
        try:
            kill(process.pid, signal.SIGKILL)
        except OSError:
            pass
    process.wait()


def run_launch(launch, logs, deadline, limit):
    """Start the launch's runs together (a {port} in a command chosen now) and wait for them, until
    its cap (CAP x its estimate) or the deadline, where they are stopped with all their processes.
    Returns (result, seconds, output)."""
    log_path = logs / f"{launch.name}.log"
    start = time.monotonic()
    cap = start + CAP * launch.estimate
    try:
        if launch.prepare:
            launch.prepare()
    except Exception as err:  # what it needs could not be made: the launch cannot start
        log_path.write_text(f"{type(err).__name__}: {err}\n")
        return f"FAILED: not started ({type(err).__name__}: {err})", time.monotonic() - start, str(err)
    port = str(free_port())
    with open(log_path, "w") as log:
        processes = [subprocess.Popen([word.replace("{port}", port) for word in command], cwd=ROOT,
                                      env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True) for command, env in launch.runs]
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(min(cap, deadline) - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for process, code in zip(processes, codes):
            if code is None:
                stop(process)
    seconds, output = time.monotonic() - start, log_path.read_text(errors="replace")
    if None in codes and deadline <= cap:
        return f"cut off at the total of {limit:g} s (logs/{log_path.name})", seconds, output
    if None in codes:
        return (f"FAILED: cut off at its cap of {CAP * launch.estimate:g} s ({CAP} x its estimate; "
                f"logs/{log_path.name})"), seconds, output
    misuse = misuse_in(output)
    missing = [f"{text!r} {times} times" for text, times in launch.expect.items() if output.count(text) != times]
    if any(codes) or misuse or missing:
        failed = [f"exit {code} from {([w for w in command if w.endswith('.py') and 'tests/' not in w] or command)[0]}"
                  for (command, _), code in zip(launch.runs, codes) if code]
        why = failed + [f"warned: {text}" for text in misuse] + [f"did not print {text}" for text in missing]
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
    after it are "not run" rows. Returns (whether every correctness check passed, whether every
    speed check did, {launch: (samples/s, peak GiB)})."""
    deadline = start + limit
    table = out / "gpu_check.md"
    table.write_text("\n".join([*header, "| check | world | result | seconds | what it shows |",
                                "| --- | --- | --- | --- | --- |"]) + "\n")
    results, speeds, passed, spent = {}, {}, {True: True, False: True}, False
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
            passed[key in SPEED] = passed[key in SPEED] and result.startswith("ok")
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
    return passed[False], passed[True], speeds


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


def header(gpus, limit, command):
    """The table's heading: the command, the machine, the torch it ran on, the date, how to read it."""
    import torch
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a torch built without nccl
        nccl = "none"
    return ["# GPU check", "",
            f"`{command}` on {time.strftime('%Y-%m-%d', time.gmtime())}: {gpus} x "
            f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}, nccl {nccl}), Python {sys.version.split()[0]}.", "",
            "Rows in the order they ran, each written as it ended, by the command above. The world column says how "
            "many processes a check ran in: in a world of one no collective crosses processes and nothing is "
            "sharded; two processes on one GPU cross processes over gloo, not nccl. Seconds beside each estimate; "
            f"a launch fails at {CAP} x its estimate, and the check stops at the total of {limit:g} s. Speed (e) "
            "is reported, not part of the verdict.", ""]


def free_port():
    """A port free on this machine now, for two agents' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planned(groups):
    """(seconds the correctness groups plan, seconds the whole plans)."""
    correctness = sum(item.estimate for key, _, items in groups if key not in SPEED for item in items)
    return correctness, correctness + sum(item.estimate for key, _, items in groups if key in SPEED
                                          for item in items)


def dry_run(groups, limit):
    """Print the plan: each check's estimate beside its CPU-side part, its world, what it shows and
    its commands (or what it compares), and the totals. Returns the exit status: 0 when correctness
    fits CORRECTNESS_S and the whole the limit."""
    print(f"# this process: import torch and torchvision, cold: est. {math.ceil(MARGIN * CPU_S['cold import'])} s "
          f"(CPU-side {CPU_S['cold import']:g} s measured)")
    for key, title, group in groups:
        print(f"## ({key}) {title}" + (" (speed: reported apart)" if key in SPEED else ""))
        for item in group:
            where = "in this process, " if isinstance(item, Compare) else ""
            print(f"# ({key}) {item.name}: est. {item.estimate:g} s (CPU-side {item.cpu:.1f} s measured), "
                  f"{where}{item.world}: {item.shows}")
            if isinstance(item, Compare):
                print(f"#   compares {item.describe}")
            for command, env in getattr(item, "runs", []):
                print(" ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(command)]))
    correctness, whole = planned(groups)
    correctness += math.ceil(MARGIN * CPU_S["cold import"])
    whole += math.ceil(MARGIN * CPU_S["cold import"])
    items = [item for _, _, group in groups for item in group]
    launches = sum(isinstance(item, Launch) for item in items)
    print(f"# {len(items)} checks ({launches} launches) in {len(groups)} groups: correctness {correctness:g} s "
          f"of {CORRECTNESS_S} s, the whole {whole:g} s of {limit:g} s")
    return 0 if correctness <= CORRECTNESS_S and whole <= limit else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", help="where gpu_check.md and logs.tar.gz go (required unless --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimates; run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: those visible; 1 in a dry run)")
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help=f"the groups to run, each with its own runs (default: {','.join(GROUPS)})")
    parser.add_argument("--limit", type=float, default=LIMIT_S,
                        help=f"the total in seconds: a hard stop, and what the estimates must fit (default: {LIMIT_S})")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        parser.error("--gpus must be at least 1")
    keys = args.groups.split(",")
    if not keys or set(keys) - set(GROUPS):
        parser.error(f"--groups takes a comma-separated list of {', '.join(GROUPS)}")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_{os.getpid()}"
    if args.dry_run:
        return dry_run(plan(args.gpus or 1, tmp, keys), args.limit)
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
    command = shlex.join(["python", "bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        correct, fast, _ = run_plan(plan(gpus, tmp, keys), out, logs, args.limit, gpus,
                                    header=header(gpus, args.limit, command))
        pack(logs, out)  # with what the checks after the last launch wrote there (the timeline)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the runs' checkpoints and models: what they showed is in the table
    print((out / "gpu_check.md").read_text())
    if SPEED & set(keys):
        print(f"gpu_check: speed {'measured' if fast else 'NOT all measured (see its rows)'}; not part of the verdict")
    print(f"gpu_check: correctness {'ok' if correct else 'FAILED'}")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
