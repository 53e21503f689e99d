"""fsdp.py's levers for models too big for one process: host memory, activation checkpointing, units.

    .venv/bin/python bench/fsdp_big_models.py     # docs/bench/fsdp/host.md, activations.md, collectives.md
    .venv/bin/python bench/fsdp_big_models.py --quick --out DIR   # the smoke test's tiny settings

1. host: peak host memory of each process at start-up (its resident set size when shard_model
   returns, the most it held until then) over what it held after importing torch, torchvision and
   the script, fsdp.py as it is against fsdp.py at --before (a git revision in which every process
   built the whole model). fsdp.py's own main() runs under torchrun, on 2 and 4 processes, for one
   step on tiny synthetic data; resnet50 (23.5 M parameters) and vit_b_16 (85.8 M).
2. activations: activations kept from forward to backward and seconds per step, with and without
   --activation-checkpointing (bench/fsdp_memory.py, resnet50, 2 processes, AdamW).
3. collectives: collectives per optimizer step, by kind, and FSDP units, with and without
   --amp bf16, fsdp.py as it is against fsdp.py at --norm-unit-before (a git revision in which
   BatchNorm's layers were one unit of float32 parameters under --amp); resnet50, 2 processes.

Figures of this machine's CPUs; on GPUs activation memory is device memory, the same bytes.
"""
import argparse
import datetime
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def launcher(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def worker(kind, script_path, records, argv):
    """Run a copy of fsdp.py's main() and write what this process measured to a file in the folder
    records (kind "host": peak host memory when shard_model returns; "collectives": the
    collectives of its one epoch of training, by name, and the number of FSDP units).

    Each process writes a file of its own: lines that several processes print to one pipe at the
    same moment can interleave, and a record cut by another is unreadable.
    """
    import importlib.util

    import torch.distributed as dist
    import torchvision  # noqa: F401 -- imported by build_model; before the baseline, not in the rise
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        """Counts the c10d operators (collectives) that run inside it, by name."""
        def __init__(self):
            super().__init__()
            self.counts = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func.__name__.split(".")[0]
                self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    spec = importlib.util.spec_from_file_location("fsdp_under_test", script_path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    shard_model, train_one_epoch = script.shard_model, script.train_one_epoch
    record = {}

    def write(**values):
        record.update(values, rank=dist.get_rank())
        (Path(records) / f"rank{record['rank']}.json").write_text(json.dumps(record))

    def measured(*args):
        units = shard_model(*args)
        # Resident now, by kind: anonymous memory (the process's own) and pages of mapped files (a
        # memory-mapped --init-from), which the kernel may drop and read again.
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        write(imported_mib=imported, units=units,
              peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              anon_mib=int(status["RssAnon"].split()[0]) / 1024, file_mib=int(status["RssFile"].split()[0]) / 1024)
        return units

    def counted(*args, **kwargs):
        with Collectives() as mode:
            totals = train_one_epoch(*args, **kwargs)
        write(collectives=mode.counts)
        return totals

    script.shard_model, script.train_one_epoch = measured, counted
    return script.main(argv)


def launch(kind, path, nproc, argv, tmp, label):
    """fsdp.py at path under torchrun, measured by worker(kind): every process's record, by rank."""
    records = Path(tmp) / f"records_{label}"
    records.mkdir()
    result = subprocess.run([*launcher(nproc), __file__, "--worker", kind, str(path), str(records), *argv],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"{label} on {nproc} processes failed:\n{result.stderr[-3000:]}")
    return [json.loads((records / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def revision(before, tmp):
    """fsdp.py as it was at the git revision before, written into the folder tmp; or before itself,
    where it is a file (a copy of the scripts without git history: the mutation check's)."""
    if Path(before).is_file():
        return Path(before)
    old = Path(tmp) / f"fsdp_{before}.py"
    old.write_text(subprocess.run(["git", "show", f"{before}:fsdp.py"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout)
    return old


def host_memory(models, nprocs, before, init_from_before):
    lines = ["", "## Host memory per process at start-up", "",
             "Peak resident set size of each process when `shard_model` returns (MiB), and its rise over the "
             "process after importing torch, torchvision and the script. `before`: fsdp.py at " + f"`{before}`" +
             ", where every process built the whole model; `now`: rank 0 alone builds it, the others build it "
             "on the meta device; `now, init_weights`: the section's init_weights sets each process's own "
             "shards (every layer's reset_parameters()), nothing built whole; `now, --init-from`: rank 0 reads "
             "a file of the model's weights, memory-mapped, instead of building the model (at " + f"`{init_from_before}`" +
             ", before it, rank 0 built the model at random, then loaded the file into it). Resident when "
             "`shard_model` returns, by kind: anonymous memory, and pages of mapped files (the kernel may drop "
             "those and read them again). Float32 parameters: "
             "resnet50 (10 classes) 94 MB, vit_b_16 343 MB.", "",
             "| model | processes | fsdp.py | rank 0 peak | rank 0 rise | rank 0 anonymous / file-backed | "
             "other ranks' peak (max) | other ranks' rise (max) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, nproc in ((m, n) for m in models for n in nprocs):
        lines += host_memory_rows(model, nproc, before, init_from_before)
    return lines


# The section's init_weights in a copy of fsdp.py: each process sets its own shards, as torchtitan's
# models do (every torch.nn layer has its reset_parameters()).
OWN_INIT = ("def init_weights(model):\n"
            "    for module in model.modules():\n"
            "        if hasattr(module, 'reset_parameters'):\n"
            "            module.reset_parameters()\n")


def with_own_init(tmp):
    """fsdp.py with a section that initialises each process's shards itself, written into tmp."""
    text = (ROOT / "fsdp.py").read_text()
    if text.count("\ninit_weights = None\n") != 1:
        raise SystemExit("fsdp.py's section has no line 'init_weights = None' to replace")
    path = Path(tmp) / "fsdp_own_init.py"
    path.write_text(text.replace("\ninit_weights = None\n", "\n" + OWN_INIT))
    return path


def host_memory_rows(model, nproc, before, init_from_before):
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        import torchvision

        weights = Path(tmp) / "weights.pt"  # what --init-from reads: the model's state dict
        torch.save(torchvision.models.get_model(model, num_classes=10).state_dict(), weights)
        init_from = ["--init-from", str(weights)]
        for label, path, extra in (("before", revision(before, tmp), []), ("now", ROOT / "fsdp.py", []),
                                   ("now, init_weights", with_own_init(tmp), []),
                                   (f"{Path(init_from_before).stem.removeprefix('fsdp_')}, --init-from",
                                    revision(init_from_before, tmp), init_from),
                                   ("now, --init-from", ROOT / "fsdp.py", init_from)):
            name = re.sub(r"\W+", "_", label) + str(nproc)
            argv = ["--model", model, "--train-samples", str(4 * nproc), "--val-samples", str(2 * nproc),
                    "--batch-size", "2", "--epochs", "1", "--max-steps", "1", "--workers", "0",
                    "--image-size", "224" if model.startswith("vit") else "32",
                    "--out-dir", str(Path(tmp) / name), *extra]
            records = launch("host", path, nproc, argv, tmp, name)
            first, others = records[0], records[1:]
            lines.append(f"| {model} | {nproc} | {label} | {first['peak_mib']:.0f} | "
                         f"{first['peak_mib'] - first['imported_mib']:.0f} | "
                         f"{first['anon_mib']:.0f} / {first['file_mib']:.0f} | "
                         f"{max(r['peak_mib'] for r in others):.0f} | "
                         f"{max(r['peak_mib'] - r['imported_mib'] for r in others):.0f} |")
    return lines


def collectives(model, blocks, before, amps):
    """Collectives per optimizer step (the difference of an epoch of 3 steps and one of 1, halved:
    the epoch's own, logging's sums, cancel) of fsdp.py, and of it at the revision before, 2
    processes, under each --amp of amps (bf16 alone where the units differ, for the smoke test)."""
    lines = ["", f"## Collectives per step ({model}, {blocks} blocks, 2 processes)", "",
             "Collectives one process issues per optimizer step, c10d's operators counted by a "
             "dispatch mode around `train_one_epoch`: an epoch of 3 steps less an epoch of 1, halved. "
             f"`before`: fsdp.py at `{before}`, where under --amp all of a model's BatchNorm layers were "
             "one unit of float32 parameters, inside every block; `now`: a model with BatchNorm keeps "
             "float32 parameters in every unit and runs under autocast, no unit of BatchNorm's own (its "
             "all-gathers move float32, twice bf16's bytes). Units: FSDP's, the root included "
             "(fsdp.py's log line). Same model.pt: after the 3 steps, bit for bit the weights and "
             "buffers `before` trained with the same --amp.", "",
             "| fsdp.py | --amp | units | all-gathers | reduce-scatters | all-reduces | other | same model.pt |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    kinds = {"all-gathers": "allgather", "reduce-scatters": "reduce_scatter", "all-reduces": "allreduce"}
    with tempfile.TemporaryDirectory() as tmp:
        rows, weights = [], {}
        for label, path in (("before", revision(before, tmp)), ("now", ROOT / "fsdp.py")):
            for amp in amps:
                counts = {}
                for steps in (1, 3):
                    out_dir = Path(tmp) / f"{label}_{amp}_{steps}"
                    argv = ["--model", model, "--train-samples", str(2 * 2 * steps), "--val-samples", "2",
                            "--batch-size", "2", "--epochs", "1", "--workers", "0", "--amp", amp,
                            "--image-size", "32", "--out-dir", str(out_dir)]
                    [record, *_] = launch("collectives", path, 2, argv, tmp, out_dir.name)
                    counts[steps] = record["collectives"]
                weights[label, amp] = torch.load(out_dir / "model.pt", map_location="cpu")
                per_step = {op: (counts[3].get(op, 0) - counts[1].get(op, 0)) / 2
                            for op in set(counts[1]) | set(counts[3])}
                named = [sum(n for op, n in per_step.items() if kind in op) for kind in kinds.values()]
                rows.append([label, amp, record["units"], *named, sum(per_step.values()) - sum(named)])
        for row in rows:
            before_weights, these = weights["before", row[1]], weights[row[0], row[1]]
            same = before_weights.keys() == these.keys() and all(
                torch.equal(before_weights[key], these[key]) for key in these)
            lines.append("| " + " | ".join(f"{cell:g}" if isinstance(cell, float) else str(cell)
                                           for cell in [*row, "yes" if same else "NO"]) + " |")
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
        return worker(argv[1], argv[2], argv[3], argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, for the smoke test")
    parser.add_argument("--parts", default="host,activations,collectives",
                        help="which parts to run: host, activations, collectives (default: all three)")
    parser.add_argument("--before", default="b04bc52",
                        help="the git revision of fsdp.py to compare with, or a file (default: b04bc52, the "
                             "last in which every process built the whole model)")
    parser.add_argument("--init-from-before", default="d85456f",
                        help="the git revision of fsdp.py, or a file, whose --init-from to compare with (default: "
                             "d85456f, the last whose rank 0 built the model at random, then loaded the file)")
    parser.add_argument("--norm-unit-before", default="95f5ded",
                        help="the git revision of fsdp.py, or a file, whose BatchNorm unit to compare with "
                             "(default: 95f5ded, the last with one)")
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
                                 [2] if args.quick else [2, 4], args.before, args.init_from_before)
        elif part == "collectives":
            lines += collectives(*(("resnet18", 8) if args.quick else ("resnet50", 16)), args.norm_unit_before,
                                 ("bf16",) if args.quick else ("none", "bf16"))
        else:
            lines += activations("resnet18" if args.quick else "resnet50",
                                 *((32, 2, 2, 1) if args.quick else (64, 16, 4, 3)))
        (out / f"{part}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
