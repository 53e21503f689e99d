"""What a launch of the GPU check costs on the CPU side: Python with torch and torchvision, torchrun's
agent, the scripts' set-up and teardown, measured on this machine (no GPU needed), for the estimates
in bench/gpu_check.py (which must be at least 1.5x these).

    python bench/launch_costs.py            # a table of seconds, each the median of 3 runs
    python bench/launch_costs.py --cold     # also the first import after the file cache is dropped (root)

Each launch runs its script on the CPU with almost no work (resnet18, as the check's runs: 2 steps
of 32 images of 32x32): what is left is what every launch of that kind pays around its work.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "resnet18", "--train-samples", "64", "--val-samples", "32", "--epochs", "1", "--batch-size", "32"]


def torchrun(script, out):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script, *TINY,
            "--out-dir", out]


def agents(script, out, port):
    """Two torchrun agents of one process each, joined over gloo, as the check's two_on_one_gpu."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=costs", script, *TINY,
             "--backend", "gloo", "--out-dir", out]
    return [agent, list(agent)]


def timed(commands, env):
    """Seconds from starting the commands together to the last one's end; fails loudly on an error."""
    start = time.monotonic()
    processes = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands]
    for process in processes:
        output = process.communicate()[0]
        if process.returncode:
            sys.exit(f"launch_costs: {commands[0][:6]} exited {process.returncode}:\n{output[-2000:]}")
    return time.monotonic() - start


def in_process(tmp, repeats):
    """The GPU check's comparisons in its own process (torch imported): two resnet18 model.pt files
    compared, and one scored on 500 validation samples on the CPU."""
    import torch
    import torchvision
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    for name in ("a", "b"):
        (tmp / name).mkdir()
        torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp / name / "model.pt")
    rows = []
    for what, call in (("compare: two resnet18 model.pt", lambda: gpu_check.compare_weights(
            tmp / "a" / "model.pt", tmp / "b" / "model.pt")),
                       ("validation: resnet18 scores 500 samples", lambda: gpu_check.reference_logits(tmp / "a"))):
        seconds = []
        for _ in range(repeats):
            start = time.monotonic()
            call()
            seconds.append(time.monotonic() - start)
        rows.append((what, statistics.median(seconds)))
    return rows


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cold", action="store_true", help="also time an import after dropping the file cache")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, the median reported (default: 3)")
    args = parser.parse_args(argv)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    rows = []
    if args.cold:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        rows.append(("import torch, torchvision (cold file cache)",
                     timed([[sys.executable, "-c", "import torch, torchvision"]], env)))
    with tempfile.TemporaryDirectory() as tmp:
        kinds = [
            ("import torch, torchvision", lambda i: [[sys.executable, "-c", "import torch, torchvision"]]),
            ("import fsdp.py (its imports, nothing run)", lambda i: [[sys.executable, "-c", "import fsdp"]]),
            ("torchrun's agent alone (--help)", lambda i: [[sys.executable, "-m", "torch.distributed.run", "--help"]]),
            ("plain python single_gpu.py, whole", lambda i: [[sys.executable, "single_gpu.py", *TINY,
                                                              "--out-dir", f"{tmp}/p{i}"]]),
            ("plain python fsdp.py, whole", lambda i: [[sys.executable, "fsdp.py", *TINY, "--out-dir", f"{tmp}/q{i}"]]),
            ("torchrun ddp_full.py, 1 process, whole", lambda i: [torchrun("ddp_full.py", f"{tmp}/d{i}")]),
            ("torchrun fsdp.py, 1 process, whole", lambda i: [torchrun("fsdp.py", f"{tmp}/f{i}")]),
            ("two agents of ddp_full.py over gloo, whole", lambda i: agents("ddp_full.py", f"{tmp}/a{i}", free_port())),
        ]
        for name, commands in kinds:
            rows.append((name, statistics.median(timed(commands(i), env) for i in range(args.repeats))))
        rows += in_process(Path(tmp), args.repeats)
    print(f"| CPU-side part ({os.cpu_count()} cores) | seconds |\n| --- | --- |")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
