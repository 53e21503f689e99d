"""--profile (steps 3-6): torch.profiler records optimizer steps 4-6, each process writes its
trace into --out-dir in Chrome's format, and prints one line: the profiled step's time, its time in
collectives, and how much of that no computation hid. Profiling changes no number of the training.

The line is checked against the trace it was computed from: the step time is the mean of the three
ProfilerStep events to the line's 0.1 ms; the collectives' time lies between the longest of them
and their sum (their union), the part not hidden between 0 and that. The arithmetic itself (which
events count as collectives and as computation, overlaps counted once) is checked exactly on a
trace written here. What the figures say of a real run (how much DDP hides) is a measurement:
docs/troubleshooting.md and the 2 -> 3 page.
"""
import fcntl
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, TINY, check, launch
from test_resume import assert_bitwise_equal

# Each script's shared run on 2 processes (12 optimizer steps an epoch), profiled and not.
REFERENCES = {"ddp_basic.py": "basic_w2", "ddp_amp_accum.py": "accum_default_w2", "ddp_full.py": "full_w2",
              "fsdp.py": "fsdp_w2_b8"}
LINE = re.compile(r"rank (\d): 3 steps profiled: ([\d.]+) ms a step, collectives ([\d.]+) ms, "
                  r"not hidden ([\d.]+) ms \| (\S+)$")


def profiled(runs, script):
    """The out-dir of the script's reference run with --profile, its stdout in stdout.txt."""
    name = f"{REFERENCES[script]}_profiled"
    out_dir = runs.root / name
    with open(runs.root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (runs.root / f"{name}.done").exists():
            shutil.rmtree(out_dir, ignore_errors=True)
            args = [*TINY, "--batch-size", "8", "--profile", "--out-dir", str(out_dir)]
            result = check(launch(script, args, nproc=2))
            (out_dir / "stdout.txt").write_text(result.stdout)
            (runs.root / f"{name}.done").touch()
    return out_dir


def complete_events(path):
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.slow
@pytest.mark.parametrize("script", REFERENCES)
def test_a_profiled_run_trains_bit_for_bit_as_an_unprofiled_one(runs, script):
    reference = runs.get(REFERENCES[script], script, ["--batch-size", "8"], nproc=2)
    assert_bitwise_equal(reference, profiled(runs, script))


@pytest.mark.slow
@pytest.mark.parametrize("script", REFERENCES)
def test_every_process_writes_a_trace_of_three_steps_with_its_collectives_and_a_line_read_from_it(
        runs, script):
    out_dir = profiled(runs, script)
    matches = [LINE.match(line) for line in (out_dir / "stdout.txt").read_text().splitlines()
               if line.startswith("rank ")]
    assert sorted(m.group(1) for m in matches if m) == ["0", "1"], (out_dir / "stdout.txt").read_text()
    for match in matches:
        step_ms, comm_ms, exposed_ms = map(float, match.groups()[1:4])
        assert Path(match.group(5)) == out_dir / f"profile_rank{match.group(1)}.json"
        events = complete_events(match.group(5))
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        assert sorted(e["name"] for e in steps) == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
        assert step_ms == pytest.approx(sum(e["dur"] for e in steps) / 3e3, abs=0.051)
        # gloo runs each collective on a thread of its own, beside the training thread's backward.
        collectives = [e for e in events if e["name"].startswith("gloo:")]
        names = {e["name"] for e in collectives}
        assert ({"gloo:all_gather", "gloo:all_reduce"} if script == "fsdp.py" else {"gloo:all_reduce"}) <= names
        assert {e["tid"] for e in collectives}.isdisjoint({steps[0]["tid"]})
        durations = [e["dur"] / 3e3 for e in collectives]
        assert max(durations) - 0.051 <= comm_ms <= sum(durations) + 0.051
        assert 0 <= exposed_ms <= comm_ms


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"profiled_{name.removesuffix('.py')}", ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts run nothing at import
    return module


def event(name, start_ms, end_ms, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3}


STEPS = [event(f"ProfilerStep#{n}", 10 * (n - 3), 10 * (n - 2), cat="user_annotation") for n in (3, 4, 5)]


@pytest.mark.parametrize("script", REFERENCES)
def test_on_a_cpu_the_line_counts_gloo_time_the_training_thread_did_not_overlap_once(script, tmp_path):
    trace = [*STEPS,
             event("aten::convolution_backward", 0, 6), event("aten::mul", 1, 2),  # nested: counted once
             event("c10d::allreduce_", 6, 6.1),  # starts a collective: not computation
             event("aten::add", 12, 30),
             event("aten::add", 5, 9, tid=3),  # a data loader thread: not the training thread
             event("gloo:all_reduce", 5, 9, tid=2, cat="user_annotation"),  # 1 ms hidden, 3 not
             event("gloo:all_reduce", 8, 9, tid=4, cat="user_annotation"),  # overlaps: counted once
             event("gloo:all_reduce", 11, 13, tid=2, cat="user_annotation"),  # 1 hidden, 1 not
             event("gloo:broadcast", 25, 26, tid=2, cat="user_annotation")]  # all hidden
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": trace}))
    # 7 ms of collectives, 4 of them not hidden, in 3 steps of 10 ms
    assert load_script(script).summarize_trace(tmp_path / "trace.json") == \
        "3 steps profiled: 10.0 ms a step, collectives 2.3 ms, not hidden 1.3 ms"


@pytest.mark.parametrize("script", REFERENCES)
def test_on_a_gpu_the_line_counts_nccl_kernels_time_no_other_kernel_overlapped(script, tmp_path):
    trace = [*STEPS,
             event("void at::native::conv_kernel", 0, 5, tid=7, cat="kernel"),
             event("sm90_xmma_gemm", 5, 8, tid=7, cat="kernel"),
             event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7, 12, tid=8, cat="kernel"),  # 1 hidden
             event("aten::add", 8, 12),  # the CPU's work hides nothing of the GPU's
             event("nccl:all_reduce", 6, 14),  # the CPU's call that launches the kernel: not the collective
             event("nccl:all_reduce", 7, 13, tid=8, cat="gpu_user_annotation"),  # its mark on the stream: neither
             event("gloo:all_reduce", 0, 30, tid=2, cat="user_annotation")]  # a CPU group's: not the GPU's
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": trace}))
    assert load_script(script).summarize_trace(tmp_path / "trace.json") == \
        "3 steps profiled: 10.0 ms a step, collectives 1.7 ms, not hidden 1.3 ms"
