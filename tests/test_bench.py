"""The benchmark runs and writes its table; the GPU check fits its budget, names only flags the
scripts accept and, without CUDA, stops with one line (smoke tests: behaviour only, never a timing
assertion)."""
import importlib.util
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT

SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]


@pytest.mark.slow
def test_benchmark_quick_run_writes_a_results_table(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--sections",
                             "overhead,profile,peers,seeding", "--scripts", "single_gpu.py", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "results.md").read_text()
    profile, overhead = text.split("## Whole runs, phase by phase")[1].split("## 1. Overhead")
    ratio = float(overhead.split("| single_gpu.py |")[1].split("|")[1])
    assert ratio > 0  # a measured number, not a placeholder; its size is the benchmark's business
    phases = [float(cell) for cell in profile.split("| single_gpu.py |")[1].split("|")[:7]]
    assert all(seconds >= -0.05 for seconds in phases) and phases[-1] > 0  # seconds of each phase, whole run
    # The peers at equal settings and at their own defaults (quick: the CNN, ddp_full.py and the bare loop).
    for setting in ("equal settings", "own defaults"):
        row = next(line for line in text.splitlines() if line.startswith(f"| cnn | {setting} | bare |"))
        assert float(row.split("|")[5]) > 0
    # Image loading beside the training step it feeds.
    step = next(line for line in text.splitlines() if line.startswith("| resnet18 |"))
    assert float(step.split("|")[2]) > 0


def gpu_check(*args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [1, 8])
@pytest.mark.parametrize("part", ["correctness", "resume", "speed"])
def test_each_part_of_the_gpu_check_plans_its_launches_within_five_minutes(part, gpus):
    # The GPU machine lent to this project: about 15 minutes in all, start-up included, and 10 a
    # command. Each part's launches have budgets (each stopped when it spends its own) that must add
    # up to at most 300 s, so both parts and a rerun fit.
    result = gpu_check(part, "--dry-run", "--gpus", str(gpus))
    assert result.returncode == 0, result.stdout[-2000:]
    budgets = [int(b) for b in re.findall(r"^# \S+: budget (\d+) s", result.stdout, re.M)]
    assert budgets and sum(budgets) <= 300, budgets


def test_a_gpu_check_part_whose_budgets_pass_its_limit_fails_the_dry_run():
    result = gpu_check("speed", "--dry-run", "--limit", "100")
    assert result.returncode == 1 and "of 100 s" in result.stdout


def test_gpu_check_runs_every_script_with_flags_it_accepts():
    # The check itself needs CUDA, which CI does not have; its dry run prints the commands it would
    # run, so a renamed or removed flag fails here instead of on the next machine with a GPU.
    checked = set()
    for part in ("correctness", "resume", "speed"):
        for gpus in ("1", "2"):
            for line in gpu_check(part, "--dry-run", "--gpus", gpus).stdout.splitlines():
                words = [] if line.startswith("#") else shlex.split(line)
                names = [w for w in words if w in SCRIPTS]
                if not names:
                    continue
                name = names[0]
                spec = importlib.util.spec_from_file_location(f"gpu_check_{name[:-3]}", ROOT / name)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.parse_args(words[words.index(name) + 1:])  # argparse exits (the test fails) on a bad flag
                checked.add(name)
    assert checked == set(SCRIPTS)


def test_gpu_check_names_a_world_of_one_and_adds_two_processes_sharing_the_gpu():
    one = gpu_check("correctness", "--dry-run", "--gpus", "1").stdout
    assert "a world of one" in one and "2 processes on 1 GPU (gloo)" in one
    assert one.count("--nnodes=2 --nproc_per_node=1") == 4  # two agents of one process each, twice
    assert "# two_on_one_gpu_fsdp:" in one and "a trial" in one
    two = gpu_check("correctness", "--dry-run", "--gpus", "2").stdout
    assert "a world of one" not in two and "two_on_one_gpu" not in two and "--nproc_per_node=2" in two


@pytest.mark.skipif(torch.cuda.is_available(), reason="about machines without CUDA; with it the check runs for real")
def test_gpu_check_without_cuda_is_one_clear_error_and_writes_nothing(tmp_path):
    result = gpu_check("correctness", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip() == "gpu_check: no CUDA device visible"
    assert not (tmp_path / "out").exists()


def test_the_resume_part_compares_bitwise_under_deterministic_kernels_and_fsdp_with_ddp_to_rounding():
    plan = load_gpu_check().resume_plan(1, Path("/tmp/x"))
    compares = {launch.name: launch.commands[0] for launch in plan if launch.commands[0][0] == "compare"}
    assert {name: command[3] for name, command in compares.items()} == {
        "dropout_resume_is_bitwise": "0", "fsdp_resume_is_bitwise": "0", "fsdp_trains_what_ddp_trains": "0.0001"}
    runs = [launch.commands[0] for launch in plan if launch.commands[0][0] != "compare"]
    assert all("bench/deterministic.py" in command and "--no-cudnn-benchmark" in command for command in runs)
    assert any("mobilenet_v3_small" in command for command in runs)  # dropout: random draws on the GPU


def test_the_deterministic_wrapper_runs_a_script_unchanged_with_deterministic_kernels(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys, torch\n"
                      "print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,\n"
                      "      os.environ['CUBLAS_WORKSPACE_CONFIG'], sys.argv[1:], __name__)\n")
    result = subprocess.run([sys.executable, "bench/deterministic.py", str(script), "--flag", "x"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "True True :4096:8 ['--flag', 'x'] __main__"


def test_a_gpu_check_trial_that_cannot_run_here_is_a_row_that_says_so_not_a_failure(tmp_path):
    gpu = load_gpu_check()
    failing = [sys.executable, "-c", "raise RuntimeError('gloo does not support reduce_scatter on CUDA')"]
    result, _, _ = gpu.run(gpu.Launch("trial", [failing], 20, "-", "-", trial=True), tmp_path)
    assert result == "not here: RuntimeError: gloo does not support reduce_scatter on CUDA", result
    result, _, _ = gpu.run(gpu.Launch("check", [failing], 20, "-", "-"), tmp_path)
    assert result.startswith("FAILED: exit 1"), result


def test_a_gpu_check_launch_past_its_budget_is_stopped_with_all_its_processes(tmp_path):
    gpu = load_gpu_check()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    result, seconds, _ = gpu.run(gpu.Launch("sleepy", [sleeper, list(sleeper)], 2, "-", "-"), tmp_path)
    assert result.startswith("OVER BUDGET: stopped at 2 s") and seconds < 10, (result, seconds)


@pytest.mark.slow  # 20 s of a sleeping torchrun worker: second tier
def test_a_gpu_check_launch_past_its_budget_stops_torchruns_workers_too(tmp_path):
    # torchrun starts each worker in a session of its own: stopping the agent's group alone would
    # leave the worker running (on a GPU, holding it while the next launch starts).
    gpu = load_gpu_check()
    marker = tmp_path / "sleeping_worker.py"
    marker.write_text("import time\ntime.sleep(120)\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(marker)]
    result, seconds, _ = gpu.run(gpu.Launch("sleeping_worker", [command], 20, "-", "-"), tmp_path)
    assert result.startswith("OVER BUDGET"), result
    time.sleep(1)  # a killed process leaves /proc as its parent reaps it
    left = [cmdline for cmdline in Path("/proc").glob("[0-9]*/cmdline")
            if str(marker) in cmdline.read_text(errors="replace")]
    assert left == [], "worker still running after the launch was stopped"


def test_gpu_check_compares_resumed_weights_relative_to_each_tensors_scale(tmp_path):
    gpu = load_gpu_check()
    straight = {"big": torch.full((100,), 100.0), "small": torch.full((100,), 1e-3), "steps": torch.tensor(16)}
    torch.save(straight, tmp_path / "straight.pt")
    # Rounding: the same tiny relative error on a tensor of any scale (running_var's or a bias's) passes.
    rounded = {k: v * (1 + 1e-6) if v.is_floating_point() else v for k, v in straight.items()}
    # A lost piece of state: one tensor off by 1e-3 of its scale fails, however small its values.
    broken = dict(straight, small=straight["small"] * (1 + 1e-3))
    for name, state in (("rounded", rounded), ("broken", broken), ("steps", dict(straight, steps=torch.tensor(15)))):
        torch.save(state, tmp_path / f"{name}.pt")
    worst, equal = gpu.compare_weights(tmp_path / "rounded.pt", tmp_path / "straight.pt")
    assert worst <= gpu.RESUME_RTOL and equal
    worst, equal = gpu.compare_weights(tmp_path / "broken.pt", tmp_path / "straight.pt")
    assert worst > gpu.RESUME_RTOL and equal
    assert gpu.compare_weights(tmp_path / "steps.pt", tmp_path / "straight.pt")[1] is False


def test_gpu_check_reads_speed_and_peak_memory_from_each_programs_output():
    gpu = load_gpu_check()
    bench = 'BENCH {"samples_per_sec": 2500.0, "peak_memory_gib": 7.5}'
    script = ("epoch 2/2 step 20/30 loss 2.1 | lr 0.1 | 2400 samples/s | peak memory 8.25 GiB | eta 0:00:01\n"
              "epoch 2/2 step 30/30 loss 2.0 | lr 0.1 | 2450 samples/s | peak memory 8.31 GiB | eta 0:00:00\n"
              "epoch 2/2 train_loss 2.0 val_loss 2.3 val_acc 0.1 (64 samples) | 2450 samples/s")
    assert gpu.speed_of(bench) == (2500.0, 7.5)
    assert gpu.speed_of(script) == (2450.0, 8.31)


@pytest.mark.slow
def test_benchmark_fsdp_section_measures_half_the_memory_per_process_at_two_processes(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--sections", "fsdp",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {tuple(cell.strip() for cell in line.split("|")[2:4]): line.split("|")
            for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| resnet18 |")}
    ddp, fsdp, skip = rows[("ddp_full.py", "4")], rows[("fsdp.py", "4")], rows[("fsdp.py (skip reduce)", "4")]
    # Bytes of tensors, not timings: each process holds half of every parameter and moment, and the
    # variant that skips reduction holds the whole model's gradients between micro-batches.
    for column in (4, 6):  # parameters, AdamW's moments
        assert abs(float(fsdp[column]) - float(ddp[column]) / 2) <= 0.01 * float(ddp[column])
    assert float(fsdp[5]) < float(skip[5]) == float(ddp[5])
    assert float(fsdp[8]) > 0 and float(ddp[8]) > 0  # seconds per step: measured, whatever they are


def fsdp_at(revision, tmp_path):
    """fsdp.py at a git revision of this repository, as a file: ROOT may be a copy without history
    (the mutation check's)."""
    path = tmp_path / f"fsdp_{revision}.py"
    path.write_text(subprocess.run(["git", "show", f"{revision}:fsdp.py"], cwd=Path(__file__).parent,
                                   check=True, capture_output=True, text=True).stdout)
    return str(path)


@pytest.mark.slow
def test_fsdp_big_models_benchmark_writes_its_tables_and_checkpointing_keeps_fewer_activations(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "fsdp_big_models.py"), "--quick", "--parts",
                             "host,activations", "--before", fsdp_at("b04bc52", tmp_path), "--init-from-before",
                             fsdp_at("d85456f", tmp_path), "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    host = [[cell.strip() for cell in line.split("|")] for line in (tmp_path / "host.md").read_text().splitlines()
            if line.startswith("| resnet18 | 2 |")]
    assert [row[3] for row in host] == ["before", "now", "now, init_weights", "d85456f, --init-from",
                                        "now, --init-from"], host
    # Measured, whatever they are: the peaks, rank 0's anonymous and file-backed memory.
    assert all(float(cell) > 0 for row in host for cell in [row[4], *row[6].split(" / "), row[7]]), host
    rows = {line.split("|")[1].strip(): line.split("|") for line in (tmp_path / "activations.md").read_text().splitlines()
            if line.startswith(("| on |", "| off |"))}
    # Bytes saved for backward, counted, not timed: a block that recomputes keeps its input alone.
    assert 0 < float(rows["on"][2]) < float(rows["off"][2]), rows


@pytest.mark.slow
def test_fsdp_big_models_benchmark_counts_no_unit_of_batchnorms_own_and_trains_the_same_weights(tmp_path):
    # before: fsdp.py at the revision where BatchNorm's layers were one unit under --amp.
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "fsdp_big_models.py"), "--quick", "--parts",
                             "collectives", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {tuple(cells[:2]): cells[2:] for cells in (
        [cell.strip() for cell in line.strip("| ").split("|")] for line in (tmp_path / "collectives.md").read_text().splitlines()
        if line.startswith(("| before |", "| now |")))}
    assert set(rows) == {(label, amp) for label in ("before", "now") for amp in ("none", "bf16")}, rows
    blocks = 8  # resnet18's residual blocks
    units, all_gathers, reduce_scatters = (int(float(cell)) for cell in rows["now", "bf16"][:3])
    # Counted, not timed: the blocks and the root (before: one unit more, BatchNorm's).
    assert units == blocks + 1 and reduce_scatters == units, rows
    assert all_gathers == 2 * units - 1, rows  # forward and backward, the root's once: it stays gathered
    assert int(rows["before", "bf16"][0]) == blocks + 2, rows
    # The same arithmetic, grouped otherwise: bit for bit the weights of before.
    assert all(cells[-1] == "yes" for cells in rows.values()), rows


@pytest.mark.slow
def test_loader_benchmark_writes_both_ways_of_reading_in_memory_data(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "loader.py"), "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in (tmp_path / "loader.md").read_text().splitlines()
            if line.startswith(("| 32x32 |", "| 224x224 |"))]
    assert [row[0] for row in rows] == ["32x32", "224x224"], rows
    assert all(float(cell) > 0 for row in rows for cell in row[2:]), rows  # measured, whatever they are
