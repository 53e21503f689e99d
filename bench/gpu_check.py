"""The GPU check: what the CPU suite can only stand in for, in three parts of at most 5 minutes each.

    python bench/gpu_check.py correctness OUT_DIR    # every script's CUDA paths, validation
    python bench/gpu_check.py resume OUT_DIR         # exact resumes, fsdp.py against ddp_full.py
    python bench/gpu_check.py speed OUT_DIR          # samples/s and peak memory, resnet50 at 224 px
    python bench/gpu_check.py correctness --dry-run [--gpus N]   # the plan and its budget, no GPU

It runs on the torch it finds (nothing to install) and uses every visible GPU: the DDP and FSDP runs
are one process per GPU (torchrun --nproc_per_node=<all>). Each result names the world it ran in. On
a machine with one GPU that world is one process, where nothing is sharded and no collective crosses
processes; there the correctness part adds runs of ddp_full.py in two processes sharing the GPU,
started by two torchrun agents and joined over gloo with CUDA tensors: DDP's all-reduce,
SyncBatchNorm and sharded validation, which nccl cannot do on one GPU; and fsdp.py the same way,
where gloo can carry FSDP's collectives for CUDA tensors (a row says whether it could).

The resume part compares runs exactly, under deterministic kernels (bench/deterministic.py): a run
stopped and resumed against one never stopped, with dropout (mobilenet_v3_small: random draws on
the GPU, whose generator's state the checkpoint carries) and with fsdp.py's sharded checkpoints; and
fsdp.py against ddp_full.py in float32 on the same seed, equal to rounding (other sums).

Every launch has a budget of seconds and is stopped when it spends it; the budgets of a part add up
to at most PART_LIMIT_S. Results go to OUT_DIR/<part>.md, a row written as each launch ends (a part
stopped from outside still leaves what it finished), and each launch's output to logs/ in
OUT_DIR/logs.tar.gz, packed anew as each launch ends (two files to carry back from a machine).
Exit status: 0 all ok, 1 a check failed or ran over its budget, 2 no CUDA or bad arguments.
"""
import argparse
import json
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

ROOT = Path(__file__).resolve().parent.parent
# The GPU machine this check was written for lends about 15 minutes in all, start-up included, and
# at most 10 a command: each part must leave room for the other and for a rerun.
PART_LIMIT_S = 300
# resnet18 on the scripts' synthetic 32x32 data: 16 optimizer steps, enough for a resume mid-epoch.
SMALL = ["--model", "resnet18", "--train-samples", "2048", "--val-samples", "500", "--epochs", "1",
         "--batch-size", "128", "--log-interval", "8"]
# Bitwise settings for the runs that are compared: no TF32, cuDNN's default kernels, no autotuning.
EXACT = ["--no-tf32", "--no-cudnn-benchmark"]
# A model with dropout: every training step draws random numbers on the GPU.
DROPOUT = [*SMALL, "--model", "mobilenet_v3_small"]
# resnet50 at 224 px, bf16, channels-last (the scripts' default on CUDA): the speed part's work.
BIG = ["--model", "resnet50", "--image-size", "224", "--amp", "bf16", "--batch-size", "64"]
BIG_RUN = [*BIG, "--epochs", "2", "--train-samples", "1920", "--val-samples", "64", "--log-interval", "10",
           "--resume", "none"]
BARE = [sys.executable, "bench/bare.py", "--model", "resnet50", "--image-size", "224", "--batch-size", "64",
        "--steps", "30", "--warmup", "10", "--amp", "bf16"]
# A resumed run and a straight one, both with EXACT settings, may still differ where a CUDA kernel
# adds in a varying order (atomics in convolution backward): rounding, about 1e-7 relative per
# step, grown over 16 steps to well under 1e-5. A resume that lost a piece of state (momentum, the
# schedule's position, the data order) changes a whole step's update, about lr x gradient, 1e-3 of
# a weight's scale or more. Compared per tensor: |a - b| / |b| (norms), the largest reported.
RESUME_RTOL = 1e-4


class Launch:
    """One check: commands started together (two torchrun agents are two), its budget in seconds,
    the world it runs in, and what it shows. A trial (trial=True) asks whether this torch can do it
    at all: where it cannot, its row says so and the part does not fail."""

    def __init__(self, name, commands, budget, world, shows, trial=False):
        self.name, self.commands, self.budget, self.world, self.shows = name, commands, budget, world, shows
        self.trial = trial


def torchrun(nproc, script, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def deterministic(nproc, script, args):
    """torchrun of a script under bench/deterministic.py: deterministic kernels."""
    return torchrun(nproc, "bench/deterministic.py", [script, *args])


def two_agents(script, args, port, rdzv_id="gpu-check"):
    """Two torchrun agents of one process each, joined by a rendezvous on this machine: two
    processes of LOCAL_RANK 0, so both drive GPU 0."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}", script, *args]
    return [agent, list(agent)]


def eval_check(run_dir, amp):
    return [[sys.executable, "bench/gpu_eval_check.py", str(run_dir), "--val-samples", "500", "--amp", amp]]


def compare(a, b, rtol):
    """A launch-less check: the weights of model.pt at a against b, each tensor within rtol of b's
    norm (0: bitwise)."""
    return [["compare", str(a), str(b), str(rtol)]]


def correctness_plan(gpus, tmp, port):
    """The correctness part: every script on CUDA, sharded validation against model.pt, fsdp.py's
    precision policy, and on one GPU processes that share it."""
    w = f"{gpus} process{'es' if gpus > 1 else ''}, 1 per GPU" if gpus > 1 else "1 process (a world of one)"
    plan = [
        Launch("single_gpu", [[sys.executable, "single_gpu.py", *SMALL, "--out-dir", f"{tmp}/1"]], 35, "1 GPU",
               "CUDA device, pinned memory, TF32, cudnn.benchmark; the first CUDA start-up"),
        Launch("dataparallel", [[sys.executable, "dataparallel.py", *SMALL, "--out-dir", f"{tmp}/2"]], 20,
               f"{gpus} GPU{'s' if gpus > 1 else ''}, 1 process",
               "nn.DataParallel over every visible GPU" + ("" if gpus > 1 else " (one GPU: no split)")),
        Launch("ddp_basic_nccl", [torchrun(gpus, "ddp_basic.py", [*SMALL, "--backend", "nccl", "--out-dir", f"{tmp}/0"])],
               20, w, "DDP over nccl, set_device, DistributedSampler, rank 0 validating through model.module"),
        Launch("amp_fp16_accum_nccl", [torchrun(gpus, "ddp_amp_accum.py", [*SMALL, "--backend", "nccl", "--amp", "fp16",
                                                                           "--accum-steps", "2", "--clip-grad-norm", "1",
                                                                           "--optimizer", "adamw",
                                                                           "--out-dir", f"{tmp}/3"])], 25, w,
               "nccl, set_device, fp16 autocast with a GradScaler, no_sync accumulation, clipping after unscale_, "
               "fused AdamW stepped by the GradScaler"),
        Launch("full", [torchrun(gpus, "ddp_full.py", [*SMALL, "--out-dir", f"{tmp}/5"])], 25, w,
               "ddp_full.py at its defaults on CUDA: checkpoints, sharded validation"),
        Launch("full_validation_matches", eval_check(f"{tmp}/5", "none"), 15, w,
               "float32 sharded validation, rank 0's BatchNorm statistics: the same counts and loss as "
               "model.pt scored in one process"),
        Launch("fsdp_bf16_accum", [torchrun(gpus, "fsdp.py", [*SMALL, "--amp", "bf16", "--accum-steps", "2",
                                                               "--clip-grad-norm", "1", "--activation-checkpointing",
                                                               "--optimizer", "adamw",
                                                               *(["--replicas", "2"] if gpus % 2 == 0 else []),
                                                               "--out-dir", f"{tmp}/6"])],
               35, w, "the model built on the meta device, shards filled from rank 0's copy on the GPU (to_empty, "
                      "broadcast_from_rank0); fully_shard with bf16 policies and BatchNorm's float32 parameters "
                      "fed bf16 (all its layers one unit), a reduce-scatter per micro-batch, the global-norm "
                      "clip, activation checkpointing, fused AdamW on sharded parameters (DTensors)"
                      + (" (a world of one: one shard, collectives with itself)" if gpus == 1 else
                         ", hybrid sharding: 2 replicas (a 2-D mesh over nccl)" if gpus % 2 == 0 else "")),
        Launch("fsdp_validation_matches", eval_check(f"{tmp}/6", "bf16"), 15, w,
               "fsdp.py's bf16 validation against model.pt gathered to rank 0, scored in float32"),
    ]
    if gpus == 1:
        two = "2 processes on 1 GPU (gloo)"
        plan += [
            Launch("two_on_one_gpu_ddp_full", two_agents("ddp_full.py", [*SMALL, "--backend", "gloo", "--sync-bn",
                                                                         "--amp", "bf16", "--out-dir", f"{tmp}/7"],
                                                         port), 40, two,
                   "across processes with CUDA tensors: DDP's all-reduce, SyncBatchNorm, rank 0's buffers "
                   "broadcast, sharded validation (gloo, not nccl: nccl takes one GPU per process)"),
            Launch("two_on_one_gpu_validation_matches", eval_check(f"{tmp}/7", "bf16"), 15, two,
                   "that run's validation over two shards against model.pt in one process"),
            Launch("two_on_one_gpu_fsdp", two_agents("fsdp.py", [*SMALL, "--backend", "gloo",
                                                                 "--out-dir", f"{tmp}/8"], free_port(), "gpu-check-fsdp"),
                   35, two,
                   "a trial: FSDP's all-gathers and reduce-scatters of CUDA tensors over gloo; where gloo "
                   "cannot, the row says so", trial=True),
        ]
    return plan


def resume_plan(gpus, tmp):
    """The resume part, under deterministic kernels: ddp_full.py with dropout stopped and resumed
    against a straight run, bitwise; fsdp.py against ddp_full.py in float32; fsdp.py stopped and
    resumed from its sharded checkpoint against a straight run, bitwise."""
    w = f"{gpus} process{'es' if gpus > 1 else ''}, 1 per GPU" if gpus > 1 else "1 process (a world of one)"
    exact = [*SMALL, *EXACT]
    return [
        Launch("dropout_stopped", [deterministic(gpus, "ddp_full.py", [*DROPOUT, *EXACT, "--max-steps", "6",
                                                                       "--out-dir", f"{tmp}/d1"])], 30, w,
               "ddp_full.py with dropout stops at step 6 of 16 and checkpoints, the GPU's random state with it"),
        Launch("dropout_resumed", [deterministic(gpus, "ddp_full.py", [*DROPOUT, *EXACT, "--out-dir", f"{tmp}/d1"])],
               30, w, "the same command resumes: random states restored on the GPU"),
        Launch("dropout_straight", [deterministic(gpus, "ddp_full.py", [*DROPOUT, *EXACT, "--out-dir", f"{tmp}/d2"])],
               30, w, "the run never stopped"),
        Launch("dropout_resume_is_bitwise", compare(f"{tmp}/d1/model.pt", f"{tmp}/d2/model.pt", 0), 5, w,
               "resumed and straight weights equal, bit for bit: dropout drew the same numbers after the resume"),
        Launch("full_fp32", [deterministic(gpus, "ddp_full.py", [*exact, "--out-dir", f"{tmp}/f1"])], 30, w,
               "ddp_full.py in float32, for the comparison below"),
        Launch("fsdp_fp32", [deterministic(gpus, "fsdp.py", [*exact, "--out-dir", f"{tmp}/f2"])], 35, w,
               "fsdp.py on the same seed and settings"),
        Launch("fsdp_trains_what_ddp_trains", compare(f"{tmp}/f2/model.pt", f"{tmp}/f1/model.pt", RESUME_RTOL), 5, w,
               f"fsdp.py's weights within {RESUME_RTOL:g} of ddp_full.py's, relative to each tensor's norm "
               "(reduce-scatters sum in another order than all-reduces)"),
        Launch("fsdp_stopped", [deterministic(gpus, "fsdp.py", [*exact, "--max-steps", "6", "--out-dir", f"{tmp}/f3"])],
               35, w, "fsdp.py stops at step 6 and writes its sharded checkpoint (dcp.save)"),
        Launch("fsdp_resumed", [deterministic(gpus, "fsdp.py", [*exact, "--out-dir", f"{tmp}/f3"])], 35, w,
               "the same command resumes from it (dcp.load into the shards on the GPU)"),
        Launch("fsdp_resume_is_bitwise", compare(f"{tmp}/f3/model.pt", f"{tmp}/f2/model.pt", 0), 5, w,
               "resumed and straight weights equal, bit for bit"),
    ]


def speed_plan(gpus, tmp):
    """The speed part, side by side in one run: the bare loop on data already on the GPU (the
    ceiling), the bare DDP loop, ddp_full.py and fsdp.py at their defaults, and --compile."""
    w = f"{gpus} GPU{'s' if gpus > 1 else ''}"
    return [
        Launch("bare", [BARE + ["--mode", "plain"]], 45, "1 GPU",
               "the ceiling: forward, backward, step on one batch already on the GPU"),
        Launch("bare_ddp", [torchrun(gpus, BARE[1], [*BARE[2:], "--mode", "ddp"])], 45, w,
               "the same loop under DDP (nccl), one process per GPU"),
        Launch("ddp_full", [torchrun(gpus, "ddp_full.py", [*BIG_RUN, "--out-dir", f"{tmp}/s1"])], 60, w,
               "ddp_full.py at its defaults: synthetic 224-px data in memory through its loader"),
        Launch("fsdp", [torchrun(gpus, "fsdp.py", [*BIG_RUN, "--out-dir", f"{tmp}/s2"])], 60, w,
               "fsdp.py on the same work"),
        Launch("ddp_full_compile", [torchrun(gpus, "ddp_full.py", [*BIG_RUN, "--compile", "--out-dir", f"{tmp}/s3"])],
               90, w, "ddp_full.py with --compile: the first epoch holds the compiling, the second the speed"),
    ]


def compare_weights(a, b):
    """The largest |a - b| / |b| over the floating tensors of two state dicts, and whether every
    other entry is equal."""
    import torch
    x, y = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    worst, equal = 0.0, x.keys() == y.keys()
    for key in x.keys() & y.keys():
        if x[key].is_floating_point():
            scale = y[key].double().norm().item() or 1.0
            worst = max(worst, (x[key].double() - y[key].double()).norm().item() / scale)
        else:
            equal = equal and torch.equal(x[key], y[key])
    return worst, equal


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


def run(launch, logs):
    """Start the launch's commands together; stop them all when the budget is spent. Returns
    (result, seconds, output)."""
    if launch.commands[0][0] == "compare":
        start = time.perf_counter()
        a, b, rtol = launch.commands[0][1:]
        try:
            worst, equal = compare_weights(a, b)
        except Exception as err:  # a run before it failed: no model.pt to compare
            return f"FAILED ({type(err).__name__}: {err})", time.perf_counter() - start, str(err)
        ok = worst <= float(rtol) and equal
        text = f"largest relative difference {worst:.2e}; integer entries {'equal' if equal else 'DIFFER'}"
        return ("ok" if ok else "FAILED") + f" ({text})", time.perf_counter() - start, text
    log_path = logs / f"{launch.name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        processes = [subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True) for command in launch.commands]
        codes = []
        for process in processes:
            left = launch.budget - (time.perf_counter() - start)
            try:
                codes.append(process.wait(timeout=max(left, 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for process, code in zip(processes, codes):
            if code is None:
                stop(process)
    seconds = time.perf_counter() - start
    output = log_path.read_text()
    if launch.trial and (None in codes or any(codes)):
        errors = [line for line in output.splitlines() if "Error" in line or "error:" in line]
        return f"not here: {(errors or ['stopped at its budget'])[-1].strip()[:200]}", seconds, output
    if None in codes:
        return f"OVER BUDGET: stopped at {launch.budget} s (logs/{log_path.name})", seconds, output
    if any(codes):
        return f"FAILED: exit {max(codes)} (logs/{log_path.name})", seconds, output
    return "ok", seconds, output


def header(part, gpus):
    import torch
    name = torch.cuda.get_device_name(0)
    return [f"# GPU check: {part}", "",
            f"Run by `bench/gpu_check.py {part}` on {time.strftime('%Y-%m-%d', time.gmtime())}: {gpus} x {name}, "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}. "
            "The world column says how many processes each check ran in: a world of one shows no "
            "collective across processes.", ""]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["correctness", "resume", "speed"])
    parser.add_argument("out_dir", nargs="?", help="where <part>.md and logs.tar.gz go (required unless --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="print the launches and their budgets; run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: those visible; 1 in a dry run without CUDA)")
    parser.add_argument("--limit", type=int, default=PART_LIMIT_S,
                        help=f"seconds the part's budgets may add up to (default: {PART_LIMIT_S})")
    args = parser.parse_args(argv)
    if args.dry_run:
        gpus = args.gpus or 1
    else:
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible", file=sys.stderr)
            return 2
        if args.out_dir is None:
            parser.error("OUT_DIR is required, except with --dry-run")
        gpus = args.gpus or torch.cuda.device_count()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_{os.getpid()}"
    plan = {"correctness": lambda: correctness_plan(gpus, tmp, free_port()), "resume": lambda: resume_plan(gpus, tmp),
            "speed": lambda: speed_plan(gpus, tmp)}[args.part]()
    total = sum(launch.budget for launch in plan)
    if args.dry_run:
        for launch in plan:
            print(f"# {launch.name}: budget {launch.budget} s, {launch.world}: {launch.shows}")
            for command in launch.commands:
                print(shlex.join(command))
        print(f"# {len(plan)} launches, budgets adding up to {total} s of {args.limit} s")
        return 0 if total <= args.limit else 1
    if total > args.limit:
        print(f"gpu_check: the {args.part} part's budgets add up to {total} s, over --limit {args.limit}",
              file=sys.stderr)
        return 2
    out, logs = Path(args.out_dir), tmp / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    results = out / f"{args.part}.md"
    lines = header(args.part, gpus)
    lines += ["| check | world | result | seconds (budget) | what it shows |", "| --- | --- | --- | --- | --- |"]
    results.write_text("\n".join(lines) + "\n")
    failed, speeds = 0, {}
    try:
        for launch in plan:
            result, seconds, output = run(launch, logs)
            failed += result != "ok" and not result.startswith(("ok (", "not here: "))
            speeds[launch.name] = speed_of(output)
            with open(results, "a") as f:
                f.write(f"| {launch.name} | {launch.world} | {result} | {seconds:.0f} ({launch.budget}) | "
                        f"{launch.shows} |\n")
            print(f"gpu_check: {launch.name}: {result} in {seconds:.0f} s", flush=True)
            with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
                tar.add(logs, arcname="logs")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the runs' checkpoints and models: what they showed is in the table
    if args.part == "speed":
        ceiling = speeds["bare"][0]
        rows = ["", f"Samples/s and peak memory per process; the ceiling is the bare loop on one GPU times {gpus}.",
                "", "| program | samples/s | of the ceiling | peak memory (GiB) |", "| --- | --- | --- | --- |"]
        for name, (rate, peak) in speeds.items():
            share = f"{rate / (ceiling * gpus):.2f}" if rate and ceiling else "-"
            rows.append(f"| {name} | {rate if rate is not None else '-'} | {share} | {peak if peak is not None else '-'} |")
        with open(results, "a") as f:
            f.write("\n".join(rows) + "\n")
    print(results.read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
