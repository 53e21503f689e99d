"""fsdp.py's levers for models too big for one process: host memory at start-up, activation checkpointing.

    .venv/bin/python bench/fsdp_big_models.py          # docs/bench/fsdp/host.md and activations.md
    .venv/bin/python bench/fsdp_big_models.py --quick --out DIR   # the smoke test's tiny settings

1. host: peak host memory of each process at start-up (its resident set size when shard_model
   returns, the most it held until then) over what it held after importing torch, torchvision and
   the script, fsdp.py as it is against fsdp.py at --before (a git revision in which every process
   built the whole model). fsdp.py's own main() runs under torchrun, on 2 and 4 processes, for one
   step on tiny synthetic data; resnet50 (23.5 M parameters) and vit_b_16 (85.8 M).
2. activations: activations kept from forward to backward and seconds per step, with and without
   --activation-checkpointing (bench/fsdp_memory.py, resnet50, 2 processes, AdamW).

Figures of this machine's CPUs; on GPUs activation memory is device memory, the same bytes.
"""
import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launcher(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def worker(script_path, records, argv):
    """Run a copy of fsdp.py's main() and write this process's peak host memory when shard_model returns.

    Each process writes a file of its own in the folder records: lines that several processes print
    to one pipe at the same moment can interleave, and a record cut by another is unreadable.
    """
    import importlib.util

    import torch.distributed as dist
    import torchvision  # noqa: F401 -- imported by build_model; before the baseline, not in the rise

    spec = importlib.util.spec_from_file_location("fsdp_under_test", script_path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    shard_model = script.shard_model

    def measured(*args):
        units = shard_model(*args)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rank = dist.get_rank()
        (Path(records) / f"rank{rank}.json").write_text(
            json.dumps({"rank": rank, "imported_mib": imported, "peak_mib": peak}))
        return units

    script.shard_model = measured
    return script.main(argv)


def host_memory(models, nprocs, before):
    lines = ["", "## Host memory per process at start-up", "",
             "Peak resident set size of each process when `shard_model` returns (MiB), and its rise over the "
             "process after importing torch, torchvision and the script. `before`: fsdp.py at " + f"`{before}`" +
             ", where every process built the whole model; `now`: rank 0 alone builds it, the others build it "
             "on the meta device. Float32 parameters: resnet50 (10 classes) 94 MB, vit_b_16 343 MB.", "",
             "| model | processes | fsdp.py | rank 0 peak | rank 0 rise | other ranks' peak (max) | "
             "other ranks' rise (max) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, nproc in ((m, n) for m in models for n in nprocs):
        lines += host_memory_rows(model, nproc, before)
    return lines


def host_memory_rows(model, nproc, before):
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "fsdp_before.py"
        old.write_text(subprocess.run(["git", "show", f"{before}:fsdp.py"], cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout)
        for label, path in (("before", old), ("now", ROOT / "fsdp.py")):
            argv = ["--model", model, "--train-samples", str(4 * nproc), "--val-samples", str(2 * nproc),
                    "--batch-size", "2", "--epochs", "1", "--max-steps", "1", "--workers", "0",
                    "--image-size", "224" if model.startswith("vit") else "32",
                    "--out-dir", str(Path(tmp) / f"{label}{nproc}")]
            records = Path(tmp) / f"records_{label}{nproc}"
            records.mkdir()
            result = subprocess.run([*launcher(nproc), __file__, "--worker", str(path), str(records), *argv],
                                    cwd=ROOT, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                sys.exit(f"{label} on {nproc} processes failed:\n{result.stderr[-3000:]}")
            records = [json.loads((records / f"rank{rank}.json").read_text()) for rank in range(nproc)]
            first, others = records[0], records[1:]
            lines.append(f"| {model} | {nproc} | {label} | {first['peak_mib']:.0f} | "
                         f"{first['peak_mib'] - first['imported_mib']:.0f} | "
                         f"{max(r['peak_mib'] for r in others):.0f} | "
                         f"{max(r['peak_mib'] - r['imported_mib'] for r in others):.0f} |")
    return lines


def activations(model, size, batch, steps, rounds):
    lines = ["", f"## Activation checkpointing ({model}, 2 processes)", "",
             f"{size}x{size} synthetic images, batch {batch} per process, AdamW (bench/fsdp_memory.py). Activations: "
             "the bytes a forward leaves saved for its backward, per process. Seconds per optimizer step: median "
             f"of {steps} steps per round, median of {rounds} rounds (the two alternate).", "",
             "| --activation-checkpointing | activations MB | s / step | vs off | rounds |", "| --- | --- | --- | --- | --- |"]
    measured = {False: [], True: []}
    for _ in range(rounds):
        for checkpointing in (False, True):
            cmd = [*launcher(2), str(ROOT / "bench" / "fsdp_memory.py"), "--script", "fsdp.py", "--model", model,
                   "--image-size", str(size), "--batch-size", str(batch), "--steps", str(steps), "--warmup", "1",
                   *(["--activation-checkpointing"] if checkpointing else [])]
            result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                sys.exit(f"fsdp_memory.py failed:\n{result.stderr[-3000:]}")
            measured[checkpointing].append(json.loads(result.stdout.split("BENCH ", 1)[1].splitlines()[0])[0])
    off = [r["seconds_per_step"] for r in measured[False]]
    for checkpointing in (False, True):
        times = [r["seconds_per_step"] for r in measured[checkpointing]]
        lines.append(f"| {'on' if checkpointing else 'off'} | {measured[checkpointing][0]['activations_mb']:.1f} | "
                     f"{statistics.median(times):.3f} | {statistics.median(t / o for t, o in zip(times, off)):.2f}x | "
                     f"{', '.join(f'{t:.3f}' for t in times)} |")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, for the smoke test")
    parser.add_argument("--parts", default="host,activations",
                        help="which parts to run: host, activations (default: both)")
    parser.add_argument("--before", default="b04bc52",
                        help="the git revision of fsdp.py to compare with (default: b04bc52, the last in which "
                             "every process built the whole model)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "fsdp"),
                        help="output folder (default: docs/bench/fsdp)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts.split(","):
        lines = [f"# fsdp.py for models too big for one process: {part}", "",
                 f"Written by `bench/fsdp_big_models.py --parts {part}{' --quick' if args.quick else ''}` on "
                 f"{datetime.date.today()}; torch {__import__('torch').__version__}, {os.cpu_count()} CPUs, gloo."]
        if part == "host":
            lines += host_memory(["resnet18"] if args.quick else ["resnet50", "vit_b_16"],
                                 [2] if args.quick else [2, 4], args.before)
        else:
            lines += activations("resnet18" if args.quick else "resnet50",
                                 *((32, 2, 2, 1) if args.quick else (64, 16, 4, 3)))
        (out / f"{part}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
