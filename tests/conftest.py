"""Shared helpers: launch a ladder script the way a user does, and read what it wrote.

Every run here is on CPU with gloo, tiny settings and OMP_NUM_THREADS=1 in every process, so that
one-process and multi-process runs use the same kernels (a different thread count alone changes
the float rounding) and runs are bitwise repeatable.
"""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import random

# The suite runs on the CPU wherever it runs, a laptop or a GPU machine: the scripts pick CUDA
# and nccl when they see a GPU, and on a GPU machine the tests would then need one GPU per process,
# and bitwise comparisons would meet CUDA's nondeterministic kernels. Hidden before torch starts,
# for this process (in-process tests) and every launch (base_env copies os.environ).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

# LADDER_ROOT points the harness at another copy of the scripts (tools/mutation_check.py uses it to
# show that each test fails when the pitfall it guards is put back).
ROOT = Path(os.environ.get("LADDER_ROOT") or Path(__file__).resolve().parent.parent)

# Small enough to run dozens of launches in minutes on 2 cores; the sizes are chosen so that the
# global batches used below (8, 16, 32) divide the training set, and no tested world size (2, 3, 4)
# divides the validation set.
TRAIN_SAMPLES = 192
VAL_SAMPLES = 103
TINY = ["--model", "cnn", "--workers", "0", "--train-samples", str(TRAIN_SAMPLES),
        "--val-samples", str(VAL_SAMPLES), "--epochs", "2", "--log-interval", "1000"]

# Seconds: a hung collective fails the test instead of the whole suite.
LAUNCH_TIMEOUT = int(os.environ.get("LADDER_LAUNCH_TIMEOUT", 240))


def base_env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="default",
               CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def command(script, args, nproc=None, torchrun_args=()):
    """`python script args` for nproc None; `torchrun --standalone --nproc_per_node=N script args` else."""
    path = str(ROOT / script) if not os.path.isabs(script) else script
    if nproc is None:
        return [sys.executable, path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *torchrun_args, path, *args]


def end(processes):
    """Kill launches started in sessions of their own, with their workers: those are found first,
    before torchrun goes (they would then be init's), and killed one by one, for torchrun starts
    them in sessions of their own, which killing its process group leaves running."""
    workers = [pid for process in processes for pid in descendants(process.pid)]
    for pid in [*(-process.pid for process in processes), *workers]:
        try:
            os.kill(pid, signal.SIGKILL)  # a negative pid: the process group
        except ProcessLookupError:
            pass


# Launches a test starts to run beside it (test_cluster.py's start): any still running when the test
# ends, passed or failed, are ended with their workers, so that none outlives it.
STARTED = []


@pytest.fixture(autouse=True)
def no_started_launch_outlives_its_test():
    yield
    running = [process for process in STARTED if process.poll() is None]
    STARTED.clear()
    end(running)
    for process in running:
        process.wait()


def descendants(pid):
    """Every process below pid, children first: torchrun starts its workers in sessions of their own,
    which killing its process group leaves running (and holding the pipes a launch reads)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def stacks(pids):
    """Each process's Python and native stacks, by py-spy (requirements-dev.txt): where a hang waits."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not installed)"
    dumps = []
    for pid in pids:
        try:
            dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=30)
            dumps.append(dump.stdout + dump.stderr)
        except (OSError, subprocess.TimeoutExpired) as err:
            dumps.append(f"process {pid}: {err}")
    return "\n".join(dumps)


def launch(script, args, nproc=None, env=None, torchrun_args=(), timeout=LAUNCH_TIMEOUT, wrap=()):
    """Run the script as a user does (see command); `wrap` goes before the command (a program that
    runs it)."""
    full_env = base_env()
    full_env.update(env or {})
    cmd = [*wrap, *command(script, args, nproc, torchrun_args)]
    # A session of its own, so that a launch that hangs is ended with all its workers.
    process = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = stacks([process.pid, *descendants(process.pid)])
        end([process])
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s (a hung collective?)\n{stdout[-3000:]}\n"
                    f"{stderr[-3000:]}\n--- where each process waited\n{where}")
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def check(result):
    """The run must have succeeded; show its output if it did not."""
    notable = [line for line in (result.stdout + result.stderr).splitlines()
               if "terminate called" in line or "Error" in line or "error:" in line]
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- notable lines\n" + "\n".join(notable[:40]) +
        f"\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def run_ok(script, out_dir, args=(), nproc=None, **kwargs):
    return check(launch(script, [*TINY, *args, "--out-dir", str(out_dir)], nproc=nproc, **kwargs))


def weights(out_dir):
    return torch.load(Path(out_dir) / "model.pt", map_location="cpu", weights_only=True)


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def max_weight_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def script_traceback(result, script):
    """Traceback frames that point into the script itself (torchrun's own report is not the script's)."""
    return re.findall(rf'File "[^"]*{re.escape(script)}", line \d+', result.stdout + result.stderr)


class Runs:
    """Runs shared by several tests, each launched once per session on first use.

    Under pytest-xdist the workers share one directory: a file lock per run makes the first worker
    that needs a run launch it and any other wait for it, so no run is launched twice.
    """

    def __init__(self, root):
        self.root = root

    def get(self, name, script, args=(), nproc=None, tiny=True, **kwargs):
        """The output directory of the run, launched once; tiny=False leaves out TINY's settings."""
        out_dir = self.root / name
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = self.root / f"{name}.done"
            if not done.exists():
                shutil.rmtree(out_dir, ignore_errors=True)
                args = [*(TINY if tiny else ()), *args, "--out-dir", str(out_dir)]
                check(launch(script, args, nproc=nproc, **kwargs))
                done.touch()
        return out_dir


@pytest.fixture(scope="session")
def runs(tmp_path_factory, worker_id):
    # The parent of the base temporary directory is common to all xdist workers of this session.
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "shared-runs"
    root.mkdir(exist_ok=True)
    return Runs(root)


CLASSES = ["circle", "square", "triangle"]
# An image tree of 3 classes x 8 train and 3 val images with random crops and flips, each sample's
# seeded from (seed, epoch, index); loaded in the main process (--workers 0) unless a test says
# otherwise: 2 processes x 4, 3 optimizer steps per epoch.
IMAGEFOLDER = ["--data", "imagefolder", "--image-size", "16", "--batch-size", "4", "--epochs", "2",
               "--workers", "0", "--log-interval", "1000"]


def write_image_tree(root, per_class):
    """<root>/<split>/<class>/<n>.png: small RGB images of a class colour under noise."""
    from PIL import Image

    rng = random.Random(0)
    for split, count in per_class.items():
        for index, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for n in range(count):
                colour = tuple(min(255, max(0, 80 * (index + 1) + rng.randint(-40, 40))) for _ in range(3))
                image = Image.new("RGB", (20, 20), colour)
                image.putpixel((rng.randrange(20), rng.randrange(20)), (255, 255, 255))
                image.save(root / split / name / f"{n}.png")


@pytest.fixture(scope="session")
def image_tree(runs):
    root = runs.root / "images"
    with open(runs.root / "images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (runs.root / "images.done").exists():
            shutil.rmtree(root, ignore_errors=True)
            write_image_tree(root, {"train": 8, "val": 3})
            (runs.root / "images.done").touch()
    return root
