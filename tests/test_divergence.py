"""A run that diverges stops, says so in one line, and keeps what was finite.

Divergence itself is chaotic (a learning rate that diverges on one seed or world size trains on another:
torch-gloo-facts.md), so no verdict here waits for one: tests/divergence_probe.py plants it where a real
one shows first, on one process only (rank 1), in a run whose --lr is the probe's: a loss that is nan
from a chosen step on, one weight that is nan right after a chosen step (no loss shows it before the
run ends), or fp16 gradients that overflow at every step. The scripts' own code does the rest.

TINY on 2 processes x 8 is 12 optimizer steps an epoch (one process: 24); progress lines every 2 steps.
"""
import fcntl
import json
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import TINY, check, launch, metrics, script_traceback
from test_validation import load_script

SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]
ONE_PROCESS = ("single_gpu.py", "dataparallel.py")
CHECKPOINTING = ("ddp_full.py", "fsdp.py")
ARGS = [*TINY, "--batch-size", "8", "--log-interval", "2"]
EXIT_DIVERGED = 3


def tier2(*scripts):
    return [pytest.param(s, marks=pytest.mark.slow) for s in scripts]


def planted(script, out_dir, what, step, args=(), lr="0.03", torchrun_args=(), env=None):
    """The script run with a divergence planted at optimizer step `step` (counted in this launch)."""
    one = script.removeprefix("lean/") in ONE_PROCESS
    probe = {"PROBE_RANK": "0" if one else "1", "PROBE_STEP": str(step), "PROBE_LR": lr, "PROBE_WHAT": what}
    return launch("tests/divergence_probe.py", [script, *ARGS, "--lr", lr, *args, "--out-dir", str(out_dir)],
                  nproc=None if one else 2, torchrun_args=torchrun_args, env={**probe, **(env or {})})


def steps_per_epoch(script):
    return 24 if script.removeprefix("lean/") in ONE_PROCESS else 12


def assert_stopped(result, script, message):
    """Every process stopped with the exit status of a divergence and one line naming it, rank 0's."""
    name = script.removeprefix("lean/")
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"{name}: error: training diverged: {message}"), errors
    assert not script_traceback(result, name), result.stderr[-3000:]
    if name in ONE_PROCESS:
        assert result.returncode == EXIT_DIVERGED
    else:  # torchrun reports each worker's exit status: the divergence's, or its own SIGTERM once one exited
        codes = re.findall(r"exitcode\s*: (-?\d+)", result.stderr)
        assert result.returncode != 0 and str(EXIT_DIVERGED) in codes, result.stderr[-3000:]
        assert all(code in (str(EXIT_DIVERGED), f"-{signal.SIGTERM}") for code in codes), codes


def checkpoint_steps(out_dir):
    return sorted(p.name for p in (out_dir / "checkpoints").iterdir())


def assert_finite_checkpoint(out_dir, name, tmp_path):
    path = out_dir / "checkpoints" / name
    if path.is_dir():  # fsdp.py's, a directory of shards
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, tmp_path / "whole.pt")
        path = tmp_path / "whole.pt"
    state = torch.load(path, weights_only=False)
    tensors = [t for part in ("model", "optimizer") for t in tensors_in(state[part]) if t.is_floating_point()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)


def tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(value)


@pytest.mark.parametrize("script", ["ddp_amp_accum.py",
                                    *tier2("single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_full.py", "fsdp.py",
                                           *[f"lean/{s}" for s in SCRIPTS])])
def test_a_loss_that_is_not_finite_on_one_process_stops_every_process_in_one_line(script, tmp_path):
    # nan at a progress line's step (epoch 2 step 4), on rank 1 alone: only its sums are nan there,
    # the all-reduce tells every process, all stop with the status of a divergence, nothing more is
    # written, and the checkpoint of epoch 1 (--keep-last 1) is kept, finite.
    keep = ["--keep-last", "1"] if script.removeprefix("lean/") in CHECKPOINTING else []
    result = planted(script, tmp_path, "loss", steps_per_epoch(script) + 4, keep)
    assert_stopped(result, script, "loss nan at epoch 2 step 4")
    assert not (tmp_path / "model.pt").exists()
    if keep:
        newest = "step_000000012" + (".pt" if "ddp_full" in script else "")
        assert checkpoint_steps(tmp_path) == [newest]
        assert_finite_checkpoint(tmp_path, newest, tmp_path)
        if not script.startswith("lean/"):  # the part "divergence note" says where a resume goes on
            assert f"so changed, the same command goes on from {tmp_path / 'checkpoints' / newest}" in result.stderr
        assert len(metrics(tmp_path)) == 1  # epoch 1's record, no more


@pytest.mark.parametrize("script", ["ddp_full.py", *tier2(*[s for s in SCRIPTS if s != "ddp_full.py"])])
def test_weights_that_are_not_finite_are_never_written(script, tmp_path):
    # One weight nan on rank 1 after the run's last step, which no loss sees: the last checkpoint and
    # model.pt are refused, the checkpoint before them kept (--keep-last 1).
    checkpointing = script in CHECKPOINTING
    keep = ["--keep-last", "1"] if checkpointing else []
    result = planted(script, tmp_path, "weight", 2 * steps_per_epoch(script), keep)
    written = "step_000000024" + (".pt" if script == "ddp_full.py" else "") if checkpointing else "model.pt"
    assert_stopped(result, script, f"{written} would hold values that are not finite: not written")
    assert not (tmp_path / "model.pt").exists()
    if checkpointing:
        newest = "step_000000012" + (".pt" if script == "ddp_full.py" else "")
        assert checkpoint_steps(tmp_path) == [newest]
        assert_finite_checkpoint(tmp_path, newest, tmp_path)


def diverged_under_restarts(runs, script):
    """(The launch's output, its --out-dir): 3 epochs, nan at epoch 2 step 4 on rank 1, under torchrun
    --max-restarts 2; launched once a session, shared by the two tests below."""
    out_dir = runs.root / f"diverged_{script}"
    with open(runs.root / f"diverged_{script}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (runs.root / f"diverged_{script}.txt").exists():
            shutil.rmtree(out_dir, ignore_errors=True)
            result = planted(script, out_dir, "loss", 16, ["--epochs", "3"], torchrun_args=["--max-restarts", "2"],
                             env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
            (runs.root / f"diverged_{script}.txt").write_text(json.dumps([result.returncode, result.stdout,
                                                                           result.stderr]))
    returncode, stdout, stderr = json.loads((runs.root / f"diverged_{script}.txt").read_text())
    return subprocess.CompletedProcess([], returncode, stdout, stderr), out_dir


@pytest.mark.slow
@pytest.mark.parametrize("script", CHECKPOINTING)
def test_a_restart_does_not_replay_a_divergence(script, runs):
    # torchrun restarts a failed group: from the same checkpoint with the same settings the run would
    # diverge again, each time. Each restart stops at once instead, saying how to go on.
    result, out_dir = diverged_under_restarts(runs, script)
    output = result.stdout + result.stderr
    assert output.count("error: training diverged: loss nan at epoch 2 step 4") == 1, output[-3000:]
    assert output.count("error: this run diverged from here before (loss nan at epoch 2 step 4) and would again: "
                        "change --lr") == 2, output[-3000:]
    assert result.returncode != 0 and not script_traceback(result, script)
    assert checkpoint_steps(out_dir) == ["step_000000012" + (".pt" if script == "ddp_full.py" else "")]


@pytest.mark.slow
@pytest.mark.parametrize("script", CHECKPOINTING)
def test_after_a_divergence_a_lower_lr_goes_on_from_the_checkpoint_before_it(script, runs, tmp_path):
    # 3 epochs, warm-up 1: the rate at the end of epoch 2 is half the peak. The resume goes on from
    # epoch 1's checkpoint with the new peak, which a resume otherwise refuses.
    _, diverged = diverged_under_restarts(runs, script)
    shutil.copytree(diverged, tmp_path / "run")
    resumed = check(launch(script, [*ARGS, "--epochs", "3", "--lr", "0.015", "--out-dir", str(tmp_path / "run")],
                           nproc=2))
    assert "resumed from" in resumed.stdout and "step_000000012" in resumed.stdout
    records = metrics(tmp_path / "run")
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert records[1]["lr"] == pytest.approx(0.5 * 0.015, rel=1e-9), records[1]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_amp_accum.py", "fsdp.py"])  # ddp_full.py's check is ddp_amp_accum.py's
def test_fp16_skips_steps_whose_gradients_overflow_until_the_loss_scale_falls_below_1(script, tmp_path):
    # Every step overflows (on every process, as a real overflow of the all-reduced gradients does):
    # each is skipped and halves the scale, 65536 -> 0.5 in 17 steps, and then the run stops: below 1
    # even the unscaled gradients overflow fp16. The 16 skips before are training as usual.
    result = launch("tests/divergence_probe.py", [script, *ARGS, "--amp", "fp16", "--log-interval", "1",
                                                  "--out-dir", str(tmp_path)], nproc=2,
                    env={"PROBE_RANK": "-1", "PROBE_STEP": "1", "PROBE_LR": "0.03", "PROBE_WHAT": "overflow"})
    assert_stopped(result, script, "fp16's loss scale fell to 0.5 at epoch 2 step 5")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["single_gpu.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"])
def test_the_checks_read_nothing_from_the_device_but_at_progress_lines(script, tmp_path, monkeypatch):
    # On a GPU a value read on the host (.item(), .tolist(), bool(), float(), a format) waits for every
    # kernel queued before it. The scripts' own code may read at progress lines, validation and writes,
    # not per step: in one process, with clipping and accumulation (the checks' every path but fp16's),
    # a run of 8 steps reads exactly as often as one of 4. Not counted: the preemption
    # check's flag, a CPU tensor on a gloo group by design (Preemption.poll), and GradScaler's own read
    # per fp16 step, torch's (a fused optimizer avoids it).
    module = load_script(script)
    reads = []

    def counting(method):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename == module.__file__ and caller.co_name != "poll":
                reads.append(method)
            return getattr(torch.Tensor, f"_counted_{method}")(self, *args, **kwargs)
        return read

    for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, f"_counted_{method}", getattr(torch.Tensor, method), raising=False)
        monkeypatch.setattr(torch.Tensor, method, counting(method))
    counts = []
    for samples in (32, 64):
        reads.clear()
        extra = [] if script == "single_gpu.py" else ["--accum-steps", "2", "--clip-grad-norm", "1"]
        args = [*TINY, "--train-samples", str(samples), "--val-samples", "8", "--epochs", "1", "--batch-size", "4",
                *extra]
        assert module.main([*args, "--out-dir", str(tmp_path / str(samples))]) in (0, None)
        counts.append(sorted(reads))
    assert counts[0] == counts[1] and counts[0], counts
