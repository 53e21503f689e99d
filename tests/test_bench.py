"""The benchmark runs and writes its table; the GPU check names only flags the scripts accept and,
without CUDA, stops with one line (smoke tests: behaviour only, never a timing assertion)."""
import importlib.util
import os
import shlex
import subprocess
import sys

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


def test_gpu_check_runs_every_script_with_flags_it_accepts(tmp_path):
    # The check itself needs CUDA, which CI does not have; its dry run prints the commands it would
    # run, so a renamed or removed flag fails here instead of on the next machine with a GPU.
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path)], cwd=ROOT,
                            env=dict(os.environ, DRY_RUN="1", PYTHON=sys.executable),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    checked = set()
    for line in result.stdout.splitlines():
        words = shlex.split(line)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="about machines without CUDA; with it the check runs for real")
def test_gpu_check_without_cuda_is_one_clear_error_and_writes_nothing(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path / "out")], cwd=ROOT,
                            env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "gpu_check: no CUDA device visible"
    assert not (tmp_path / "out").exists()


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
