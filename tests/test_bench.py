"""The benchmark runs and writes its table; the GPU check plans its groups in order within its
total, names only flags the scripts accept, writes a row as each check ends, stops at its total
leaving the rows before, and without CUDA stops with one line (smoke tests of the benchmarks:
behaviour only, never an assertion on this machine's speed)."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))

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


def gpu_check(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planned(output):
    """[(group, check, estimated seconds, CPU-side seconds)] from a dry run's output, in its order."""
    return [(group, name, float(seconds), float(cpu)) for group, name, seconds, cpu
            in re.findall(r"^# \((\w)\) (\S+): est\. ([\d.]+) s \(CPU-side ([\d.]+) s measured\)", output, re.M)]


def totals(output):
    """(correctness, whole, limit) in seconds from a dry run's last line."""
    return tuple(float(x) for x in re.search(r"correctness ([\d.]+) s of 240 s, the whole ([\d.]+) s of ([\d.]+) s$",
                                             output.splitlines()[-1]).groups())


# The plan's order: what only a GPU proves, the most important first; speed last, apart.
PLAN = {
    "a": ["single_gpu", "amp_fp16_accum_nccl", "gpu_timeline"],
    "b": ["resumes", "ddp_full_resume_is_bitwise", "fsdp_resume_is_bitwise", "fsdp_trains_what_ddp_trains",
          "ddp_full_validation", "fsdp_validation"],
    "c": ["fsdp_fp16_adamw", "recompute_is_bitwise_fp16", "fsdp_fp16_validation"],
    "d": ["transformer_bf16", "attention_is_bitwise"],
    "e": ["bare", "ddp_full_speed", "fsdp_speed", "fsdp_speed_contiguous"],
}
ONE_GPU = {"a": ["single_gpu", "amp_fp16_accum_nccl", "gpu_timeline", "two_on_one_gpu_full",
               "two_on_one_gpu_validation"]}
SEVERAL = {"a": ["single_gpu", "dataparallel", "amp_fp16_accum_nccl", "gpu_timeline"]}


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_gpu_check_plans_correctness_within_240_s_and_the_whole_within_its_limit(gpus):
    # The GPU machine lent to this project: about 15 minutes in all, a cold start of minutes
    # included, at most 10 a command. One command gives the correctness verdict in at most 240 s of
    # estimates, this process's cold import included; speed after it, the whole within the default
    # --limit of 420 s, so that the machine's start and one partial rerun fit the 15 minutes.
    result = gpu_check("--dry-run", "--gpus", str(gpus))
    assert result.returncode == 0, result.stdout[-2000:]
    assert re.findall(r"^## \((\w)\) ", result.stdout, re.M) == ["a", "b", "c", "d", "e"]
    expected = dict(PLAN, **(ONE_GPU if gpus == 1 else SEVERAL))
    assert [(group, name) for group, name, _, _ in planned(result.stdout)] == [
        (group, name) for group, names in expected.items() for name in names]
    correctness, whole, limit = totals(result.stdout)
    cold = re.search(r"^# this process: .* est\. ([\d.]+) s \(CPU-side ([\d.]+) s measured\)", result.stdout, re.M)
    assert float(cold.group(1)) >= 1.5 * float(cold.group(2))
    assert correctness == float(cold.group(1)) + sum(s for g, _, s, _ in planned(result.stdout) if g != "e")
    assert whole == correctness + sum(s for g, _, s, _ in planned(result.stdout) if g == "e")
    assert correctness <= 240 and whole <= limit == 420


@pytest.mark.parametrize("gpus", [1, 8])
def test_every_gpu_check_estimate_is_at_least_one_and_a_half_times_its_measured_cpu_side(gpus):
    # The CPU-side part of each launch (Python with torch, torchrun's agent, teardown; and each
    # comparison in the check's own process) was measured by bench/launch_costs.py: the estimate
    # beside it holds it 1.5 times over, plus the GPU's part.
    rows = planned(gpu_check("--dry-run", "--gpus", str(gpus)).stdout)
    assert rows and all(cpu > 0 and seconds >= 1.5 * cpu for _, _, seconds, cpu in rows), rows


def test_a_gpu_check_plan_whose_estimates_pass_its_limit_fails_the_dry_run():
    result = gpu_check("--dry-run", "--limit", "100")
    assert result.returncode == 1 and result.stdout.splitlines()[-1].endswith(" s of 100 s"), result.stdout[-300:]


def test_gpu_check_groups_runs_only_the_groups_named_each_with_what_it_compares_against():
    gpu = load_gpu_check()
    result = gpu_check("--dry-run", "--groups", "b,d")
    assert result.returncode == 0 and re.findall(r"^## \((\w)\) ", result.stdout, re.M) == ["b", "d"]
    assert [name for _, name, _, _ in planned(result.stdout)] == PLAN["b"] + PLAN["d"]
    # No group needs another's runs: a rerun of any group alone (on a fresh machine) compares.
    for gpus in (1, 2, 8):
        for key, _, items in gpu.plan(gpus, Path("/tmp/x")):
            launches = {item.name for item in items if isinstance(item, gpu.Launch)}
            assert all(set(item.needs) <= launches for item in items if isinstance(item, gpu.Compare)), key
    bad = gpu_check("--dry-run", "--groups", "b,z")
    assert bad.returncode == 2 and "--groups takes a comma-separated list of a, b, c, d, e" in bad.stderr


def test_gpu_check_runs_every_script_with_flags_it_accepts(tmp_path):
    # The check itself needs CUDA, which CI does not have; its dry run prints the commands it would
    # run, so a renamed or removed flag fails here instead of on the next machine with a GPU. The
    # transformer's copy of fsdp.py is made here where the check would make it.
    gpu, checked, modules = load_gpu_check(), set(), {}
    for gpus in ("1", "2", "8"):
        output = gpu_check("--dry-run", "--gpus", gpus, env={**os.environ, "TMPDIR": str(tmp_path)}).stdout
        for line in output.splitlines():
            words = [] if line.startswith("#") else shlex.split(line)
            names = [w for w in words if w in SCRIPTS or w.endswith("/fsdp_transformer.py")]
            if not names:
                continue
            name, path = names[0], ROOT / names[0]
            if name.endswith("/fsdp_transformer.py"):
                path = Path(name)
                path.parent.mkdir(parents=True, exist_ok=True)
                gpu.transformer_copy(path, length=256)
            if path not in modules:  # each script loaded once: a load takes a third of a second
                spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
                modules[path] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(modules[path])
            args = modules[path].parse_args(words[words.index(name) + 1:])  # argparse exits on a bad flag
            checked.add(path.name)
            # A run of several processes (or of two agents) waits at most a minute on a dead peer.
            several = any(w in words for w in ("--nnodes=2", *(f"--nproc_per_node={n}" for n in range(2, 9))))
            if several and name != "bench/bare.py" and "--resume" not in words:
                assert args.timeout_min == gpu.TIMEOUT_MIN == 1, line
    # ddp_basic.py's nccl path is ddp_amp_accum.py's, which runs it with more.
    assert checked == set(SCRIPTS) - {"ddp_basic.py"} | {"fsdp_transformer.py"}


def test_the_gpu_checks_transformer_is_fsdp_with_the_tests_transformer_section(tmp_path):
    import ladder
    from test_seam import TRANSFORMER

    gpu = load_gpu_check()
    gpu.transformer_copy(tmp_path / "copy.py")
    assert (tmp_path / "copy.py").read_text() == ladder.replace_seam(ladder.read("fsdp.py", ROOT), TRANSFORMER)
    # At 256 tokens attention's backward runs over several key blocks (128 keys a block in
    # flash's and the memory-efficient kernel's tiles): the same section, longer sequences.
    gpu.transformer_copy(tmp_path / "long.py", length=256)
    longer = TRANSFORMER.replace("VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 32, 16,",
                                 "VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 32, 256,")
    assert longer != TRANSFORMER
    assert (tmp_path / "long.py").read_text() == ladder.replace_seam(ladder.read("fsdp.py", ROOT), longer)


def test_gpu_check_places_runs_started_together_on_gpus_of_their_own():
    # No GPU is shared by runs of several processes (nccl takes one GPU per process); with fewer
    # GPUs than runs, each run is a world of one, several to a GPU.
    gpu = load_gpu_check()
    assert gpu.placement(8, 4) == [("0,1", 2), ("2,3", 2), ("4,5", 2), ("6,7", 2)]
    assert gpu.placement(8, 2) == [("0,1,2,3", 4), ("4,5,6,7", 4)]
    assert gpu.placement(1, 4) == [("0", 1)] * 4
    assert gpu.placement(2, 4) == [("0", 1), ("1", 1), ("0", 1), ("1", 1)]
    assert gpu.placement(3, 2) == [("0", 1), ("1", 1)]


def test_gpu_check_names_a_world_of_one_and_adds_two_processes_sharing_the_gpu():
    one = gpu_check("--dry-run", "--gpus", "1").stdout
    assert "1 process (a world of one)" in one and "2 processes on 1 GPU (gloo)" in one
    assert "4 runs of 1 process, sharing 1 GPU" in one
    assert one.count("--nnodes=2 --nproc_per_node=1") == 2  # two agents of one process each
    assert "--rdzv-endpoint=127.0.0.1:{port}" in one  # the port chosen as the launch starts, not now
    eight = gpu_check("--dry-run", "--gpus", "8").stdout
    assert "a world of one" not in eight and "two_on_one_gpu" not in eight and "--nproc_per_node=8" in eight
    assert "4 runs of 2 processes, 2 GPUs each" in eight and "2 runs of 4 processes, 4 GPUs each" in eight
    assert eight.count("--replicas 2") == 2  # fsdp.py's fp16 runs: hybrid sharding on 4 GPUs each


def test_the_gpu_checks_sigterm_lands_mid_epoch_and_its_restart_never_meets_it_again():
    # tests/sigterm_at_sample.py signals rank 0 as its loader draws that sample in the first epoch
    # of each start: the stop comes at step 11 or 12 of 16 (the step the processes agree on), and
    # the restart, resumed there, draws at most 5 batches: fewer samples than the signal's place.
    gpu = load_gpu_check()
    sample = int(gpu.sigterm()["SIGTERM_AT_SAMPLE"])
    assert 0 < sample // gpu.BATCH + 1 < gpu.STEPS - 1
    assert (gpu.STEPS - (sample // gpu.BATCH + 1)) * gpu.BATCH <= sample


@pytest.mark.skipif(torch.cuda.is_available(), reason="about machines without CUDA; with it the check runs for real")
def test_gpu_check_without_cuda_is_one_clear_error_and_writes_nothing(tmp_path):
    result = gpu_check(str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip() == "gpu_check: no CUDA device visible" and result.stdout == ""
    assert not (tmp_path / "out").exists()


def test_the_gpu_checks_compared_runs_are_deterministic_and_bitwise_where_they_should_be():
    gpu = load_gpu_check()
    items = {item.name: item for _, _, group in gpu.plan(1, Path("/tmp/x")) for item in group}
    compares = {name: item for name, item in items.items() if isinstance(item, gpu.Compare)}
    # Every run a comparison reads runs with deterministic kernels, TF32 and autotuning off (the
    # timeline only draws a trace: it compares no numbers).
    needed = {need for name, item in compares.items() if name != "gpu_timeline" for need in item.needs}
    assert sorted(name for name in needed if any("--deterministic" not in c for c in items[name].commands)) == []
    assert sorted(name for name, item in compares.items() if item.describe.endswith("bit for bit")) == [
        "attention_is_bitwise", "ddp_full_resume_is_bitwise", "fsdp_resume_is_bitwise", "recompute_is_bitwise_fp16"]
    assert compares["fsdp_trains_what_ddp_trains"].describe.endswith("each tensor within 0.0001 of its norm")
    resumes = items["resumes"]
    assert all("mobilenet_v3_small" in c for c in resumes.commands)  # dropout: random draws on the GPU
    stopped = [env for _, env in resumes.runs if "SIGTERM_AT_SAMPLE" in env]
    assert len(stopped) == 2
    assert resumes.expect == {"preempted at step": 2, "failed (exitcode: 75)": 2, "resumed from": 2}
    assert ["--max-restarts=1" in c for c in resumes.commands] == [False, True, False, True]
    fp16, attention = items["fsdp_fp16_adamw"].commands, items["transformer_bf16"].commands
    assert ["--activation-checkpointing" in c for c in fp16] == [True, False]
    assert all("--amp" in c and c[c.index("--amp") + 1] == "fp16" and "adamw" in c for c in fp16)
    assert all(c[:2] == [sys.executable, "fsdp.py"] for c in fp16)  # plain python on one GPU
    assert ["--activation-checkpointing" in c for c in attention] == [True, False]
    assert all(c[c.index("--amp") + 1] == "bf16" for c in attention)


def fake(name, command, estimate, **kwargs):
    """A launch of one command, run as it is."""
    gpu = load_gpu_check()
    return gpu.Launch(name, [(command, {})], estimate, "w", "s", **kwargs)


def test_a_gpu_check_launch_fails_on_an_exit_status_or_a_line_it_did_not_print(tmp_path):
    gpu = load_gpu_check()
    deadline = time.monotonic() + 60
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    result, _, _ = gpu.run_launch(fake("check", failing, 20), tmp_path, deadline, 60)
    assert result == f"FAILED: exit 3 from {sys.executable} (logs/check.log)", result
    once = [sys.executable, "-c", "print('preempted at step 12'); print('resumed from x')"]
    result, _, _ = gpu.run_launch(fake("once", once, 20, expect={"preempted at step": 2, "resumed from": 1}),
                                  tmp_path, deadline, 60)
    assert result == "FAILED: did not print 'preempted at step' 2 times (logs/once.log)", result
    result, _, _ = gpu.run_launch(fake("twice", once, 20, expect={"preempted at step": 1}), tmp_path, deadline, 60)
    assert result == "ok", result


def test_fsdps_warning_of_a_unit_without_forward_fails_its_row_whatever_the_exit_status(tmp_path):
    gpu = load_gpu_check()
    deadline = time.monotonic() + 60
    warning = ("1 of the 2 modules passed to fully_shard did not run forward before backward, which is "
               "error-prone since FSDP post-forward/pre-backward logic will not run for these modules.")
    warns = [sys.executable, "-c", f"import sys; print({warning!r}, file=sys.stderr)"]
    result, _, _ = gpu.run_launch(fake("warns", warns, 5), tmp_path, deadline, 60)
    assert result.startswith("FAILED: warned: FSDP: a unit's pre-backward logic never ran"), result
    assert result.endswith("(logs/warns.log)")
    # An operation without a deterministic kernel is noted, not failed: the comparison after it decides.
    notes = [sys.executable, "-c", "print('UserWarning: adaptive_avg_pool2d_backward_cuda does not have a "
                                   "deterministic implementation, but you set ...')"]
    result, _, _ = gpu.run_launch(fake("notes", notes, 5), tmp_path, deadline, 60)
    assert result == "ok (no deterministic kernel, warned: adaptive_avg_pool2d_backward_cuda)", result


def test_the_gpu_checks_misuse_warnings_are_those_of_the_torch_it_runs_on():
    # Each pattern as torch writes it (read in the sources of 2.11.0 and 2.14.1): DTensor's re-seeding
    # in both; FSDP's "did not run forward before backward" in 2.11's _fsdp_state.py only (2.14.1
    # dropped the check). On 2.14.x the patterns are found, or not, where the check's comment says.
    gpu = load_gpu_check()
    source = Path(torch.__file__).parent / "distributed"
    rng = (source / "tensor" / "_random.py").read_text()
    fsdp = "".join(f.read_text() for f in (source / "fsdp" / "_fully_shard").glob("*.py"))
    assert set(gpu.MISUSE) == {"did not run forward before backward", "DTensor is synchronizing RNG states"}
    assert "DTensor is synchronizing RNG states" in rng
    if torch.__version__.startswith("2.14."):
        assert "did not run forward before backward" not in fsdp and "forward before backward" not in fsdp


def table_rows(path):
    """{check: (result, seconds)} of a gpu_check.md, in its order."""
    rows = [line.split(" | ") for line in path.read_text().splitlines() if line.startswith("| (")]
    return {row[0][2:]: (row[2], row[3]) for row in rows}


def run_fake_plan(gpu, groups, tmp_path, limit):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir(parents=True)
    logs.mkdir()
    start = time.monotonic()
    return (*gpu.run_plan(groups, out, logs, limit, start=start), time.monotonic() - start, out)


def test_a_hang_costs_one_row_the_checks_after_it_run(tmp_path):
    # A launch that hangs (a stand-in: a process sleeping, as one waiting on a dead peer would) is
    # stopped at its cap, CAP x its estimate, with its processes; its row fails, the comparison
    # that needs it is not run, and the next launch runs as planned.
    gpu = load_gpu_check()
    token = f"gpu-check-hang-{tmp_path.name}"
    quick = [sys.executable, "-c", "print('done')"]
    hang = [sys.executable, "-c", f"import time; time.sleep(60)  # {token}"]
    groups = [("b", "second", [fake("hang", hang, 0.5),
                               gpu.Compare("after", ["hang"], lambda: (True, "equal"), 0.1, "w", "s", "d"),
                               fake("next", quick, 1)])]
    correct, _, _, seconds, out = run_fake_plan(gpu, groups, tmp_path, 60)
    assert seconds < 15 and correct is False
    assert {check: result for check, (result, _) in table_rows(out / "gpu_check.md").items()} == {
        "(b) hang": "FAILED: cut off at its cap of 2 s (4 x its estimate; logs/hang.log)",
        "(b) after": "not run: hang did not end ok", "(b) next": "ok"}
    time.sleep(0.5)  # a killed process leaves /proc as its parent reaps it
    assert [p for p in Path("/proc").glob("[0-9]*/cmdline") if token in p.read_text(errors="replace")] == []


def test_the_total_cuts_off_the_launch_running_and_leaves_the_rows_before_it(tmp_path):
    # Fake launches, a total of 4 s: two launches end (one past its estimate, within its cap: not
    # a failure), a comparison after them, then a launch of two sleeping processes is cut off at
    # the total; the checks after it are not run.
    gpu = load_gpu_check()
    token = f"gpu-check-sleeper-{tmp_path.name}"
    quick = [sys.executable, "-c", "print('done')"]
    late = [sys.executable, "-c", "import time; time.sleep(1)"]
    sleeper = [sys.executable, "-c", f"import time; time.sleep(60)  # {token}"]
    groups = [("a", "first", [fake("quick", quick, 0.1), fake("late", late, 0.5),
                              gpu.Compare("compared", ["quick", "late"], lambda: (True, "equal"), 0.1, "w", "s", "d")]),
              ("b", "second", [gpu.Launch("sleeper", [(sleeper, {}), (list(sleeper), {})], 10, "w", "s"),
                               gpu.Compare("after", ["sleeper"], lambda: (True, "equal"), 0.1, "w", "s", "d"),
                               fake("never", quick, 1)])]
    correct, _, _, seconds, out = run_fake_plan(gpu, groups, tmp_path, 4)
    assert seconds < 10 and correct is False
    rows = table_rows(out / "gpu_check.md")
    assert {check: result for check, (result, _) in rows.items()} == {
        "(a) quick": "ok", "(a) late": "ok", "(a) compared": "ok (equal)",
        "(b) sleeper": "cut off at the total of 4 s (logs/sleeper.log)",
        "(b) after": "not run: the total was spent", "(b) never": "not run: the total was spent"}
    assert rows["(a) late"][1].endswith("(est. 0.5)") and float(rows["(a) late"][1].split()[0]) >= 1
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs", "logs/late.log", "logs/quick.log", "logs/sleeper.log"]
    time.sleep(0.5)  # a killed process leaves /proc as its parent reaps it
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if token in p.read_text(errors="replace")]
    assert left == [], "a sleeper still running after the total cut it off"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.md", "logs.tar.gz"]


def test_speed_rows_do_not_set_the_correctness_verdict(tmp_path):
    gpu = load_gpu_check()
    quick, failing = [sys.executable, "-c", "print('done')"], [sys.executable, "-c", "raise SystemExit(1)"]
    groups = [("a", "correctness", [fake("quick", quick, 1)]), ("e", "speed", [fake("slow", failing, 1, speed=True)])]
    correct, fast, _, _, out = run_fake_plan(gpu, groups, tmp_path, 60)
    assert (correct, fast) == (True, False)
    groups = [("a", "correctness", [fake("broken", failing, 1)]), ("e", "speed", [fake("fast", quick, 1)])]
    correct, fast, _, _, _ = run_fake_plan(gpu, groups, tmp_path / "second", 60)
    assert (correct, fast) == (False, True)


def test_a_port_in_a_gpu_check_command_is_chosen_as_its_launch_starts(tmp_path):
    gpu = load_gpu_check()
    prints = [sys.executable, "-c", "import sys; print('port', sys.argv[1])", "127.0.0.1:{port}"]
    result, _, output = gpu.run_launch(fake("port", prints, 5), tmp_path, time.monotonic() + 60, 60)
    assert result == "ok" and re.fullmatch(r"port 127\.0\.0\.1:\d+\n", output), output


def test_a_gpu_check_comparison_after_a_failed_launch_is_not_run(tmp_path):
    gpu = load_gpu_check()
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    groups = [("a", "only", [fake("broken", failing, 1),
                             gpu.Compare("compared", ["broken"], lambda: (True, "equal"), 0.1, "w", "s", "d")])]
    correct, _, _, _, out = run_fake_plan(gpu, groups, tmp_path, 60)
    assert correct is False
    assert [result for result, _ in table_rows(out / "gpu_check.md").values()] == [
        f"FAILED: exit 3 from {sys.executable} (logs/broken.log)", "not run: broken did not end ok"]


@pytest.mark.slow  # a torchrun worker stopped at a total of 20 s: second tier
def test_the_total_stops_torchruns_workers_too(tmp_path):
    # torchrun starts each worker in a session of its own: stopping the agent's group alone would
    # leave the worker running (on a GPU, holding it after the check has ended).
    gpu = load_gpu_check()
    marker = tmp_path / "sleeping_worker.py"
    marker.write_text("import time\ntime.sleep(120)\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(marker)]
    result, _, _ = gpu.run_launch(fake("sleeping_worker", command, 20), tmp_path, time.monotonic() + 20, 20)
    assert result == "cut off at the total of 20 s (logs/sleeping_worker.log)", result
    time.sleep(1)  # a killed process leaves /proc as its parent reaps it
    left = [cmdline for cmdline in Path("/proc").glob("[0-9]*/cmdline")
            if str(marker) in cmdline.read_text(errors="replace")]
    assert left == [], "worker still running after the launch was stopped"


@pytest.mark.slow  # four runs of two scripts on the CPU, restarts included: second tier
def test_the_gpu_checks_resume_group_passes_on_the_cpu_as_written(tmp_path):
    # A stand-in for group (b) on the CPU (gloo, CUDA_VISIBLE_DEVICES naming no GPU), at batches
    # of 8, 8 steps: the four runs side by side, the two stopped by SIGTERM and restarted by
    # torchrun, each resumed run bitwise its straight one, fsdp.py on ddp_full.py's weights, both
    # validations.
    gpu = load_gpu_check()
    gpu.BATCH, gpu.STEPS, gpu.VAL_SAMPLES = 8, 8, 32
    correct, _, _, _, out = run_fake_plan(gpu, gpu.plan(1, tmp_path / "runs", ["b"]), tmp_path, 600)
    rows = table_rows(out / "gpu_check.md")
    assert correct, rows
    assert [name for name in rows] == [f"(b) {name}" for name in PLAN["b"]]


def test_gpu_check_compares_weights_relative_to_each_tensors_scale(tmp_path):
    gpu = load_gpu_check()
    straight = {"big": torch.full((100,), 100.0), "small": torch.full((100,), 1e-3), "steps": torch.tensor(16)}
    torch.save(straight, tmp_path / "straight.pt")
    # Rounding: the same tiny relative error on a tensor of any scale (running_var's or a bias's) passes.
    rounded = {k: v * (1 + 1e-6) if v.is_floating_point() else v for k, v in straight.items()}
    # A lost piece of state: one tensor off by 1e-3 of its scale fails, however small its values.
    broken = dict(straight, small=straight["small"] * (1 + 1e-3))
    nan = dict(straight, big=torch.full((100,), float("nan")))
    for name, state in (("rounded", rounded), ("broken", broken), ("steps", dict(straight, steps=torch.tensor(15))),
                        ("nan", nan)):
        torch.save(state, tmp_path / f"{name}.pt")
    worst, equal = gpu.compare_weights(tmp_path / "rounded.pt", tmp_path / "straight.pt")
    assert worst <= gpu.FSDP_RTOL and equal
    assert gpu.weights_agree(tmp_path / "rounded.pt", tmp_path / "straight.pt", 0)[0] is False  # not bitwise
    assert gpu.weights_agree(tmp_path / "straight.pt", tmp_path / "straight.pt", 0) == (
        True, "largest relative difference 0.00e+00; keys and integer entries equal")
    worst, equal = gpu.compare_weights(tmp_path / "broken.pt", tmp_path / "straight.pt")
    assert worst > gpu.FSDP_RTOL and equal
    assert gpu.compare_weights(tmp_path / "steps.pt", tmp_path / "straight.pt")[1] is False
    assert gpu.compare_weights(tmp_path / "nan.pt", tmp_path / "straight.pt")[0] == float("inf")


def test_gpu_check_validation_allows_a_flip_only_on_a_tie_of_the_runs_precision():
    gpu = load_gpu_check()
    # Three samples, labels 0, 0, 1: the second's two logits 2e-6 apart (a float32 tie at 1e-4 of
    # its largest logit, 2), the third's 1e-2 x its largest apart (a tie in bf16 only).
    logits = torch.tensor([[5.0, 1.0], [2.0, 2.0 - 2e-6], [2.98, 3.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    record = {"val_samples": 3, "val_acc": 3 / 3, "val_loss": loss}
    assert gpu.judge_validation(record, logits, labels, "none")[0] is True
    # The run put the float32 tie the other way: one correct fewer, allowed.
    assert gpu.judge_validation(dict(record, val_acc=2 / 3), logits, labels, "none") == (
        True, "3 samples, 2 correct against 3 here (1 ties within 0.0001); loss 0.0e+00 apart (allowed 3.3e-04: "
              "0.0001 of it or 0.0001 of the logits' scale)")
    # Two flips, one tie: not in float32; in bf16, where the third sample is a tie too.
    assert gpu.judge_validation(dict(record, val_acc=1 / 3), logits, labels, "none")[0] is False
    assert gpu.judge_validation(dict(record, val_acc=1 / 3), logits, labels, "bf16")[0] is True
    # The loss: within 1e-4 of itself in float32, or of the logits' scale where that is more (here:
    # the mean of each sample's largest |logit|, 10 / 3, times 1e-4 is 3.3e-4 of a loss of 0.465).
    assert gpu.judge_validation(dict(record, val_loss=loss + 3e-4), logits, labels, "none")[0] is True
    assert gpu.judge_validation(dict(record, val_loss=loss + 4e-4), logits, labels, "none")[0] is False
    big = logits * 100  # logits a hundred times larger: a loss a rounding of them moves more
    big_loss = torch.nn.functional.cross_entropy(big, labels).item()
    assert gpu.judge_validation({"val_samples": 3, "val_acc": 2 / 3, "val_loss": big_loss + 3e-2}, big, labels,
                                "none")[0] is True
    assert gpu.judge_validation({"val_samples": 3, "val_acc": 2 / 3, "val_loss": big_loss + 4e-2}, big, labels,
                                "none")[0] is False
    assert gpu.judge_validation(dict(record, val_samples=4), logits, labels, "bf16")[0] is False


def test_gpu_check_reads_speed_and_peak_memory_from_each_programs_output():
    gpu = load_gpu_check()
    bench = 'BENCH {"samples_per_sec": 2500.0, "peak_memory_gib": 7.5}'
    script = ("epoch 2/2 step 20/30 loss 2.1 | lr 0.1 | 2400 samples/s | peak memory 8.25 GiB | eta 0:00:01\n"
              "epoch 2/2 step 30/30 loss 2.0 | lr 0.1 | 2450 samples/s | peak memory 8.31 GiB | eta 0:00:00\n"
              "epoch 2/2 train_loss 2.0 val_loss 2.3 val_acc 0.1 (64 samples) | 2450 samples/s")
    assert gpu.speed_of(bench) == (2500.0, 7.5)
    assert gpu.speed_of(script) == (2450.0, 8.31)
    table = gpu.speed_table({"bare": (2500.0, 7.5), "fsdp_speed": (2000.0, 8.31)}, 1)
    assert table[-1] == "| fsdp_speed | 2000.0 | 0.80 | 8.31 |"  # 2000 of the ceiling's 2500 x 1 GPU


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
    assert set(rows) == {("before", "bf16"), ("now", "bf16")}, rows  # --quick: bf16, where the units differ
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


def test_the_gpu_checks_timeline_needs_cuda_kernels_in_every_trace_and_draws_the_first_two(tmp_path):
    # A stand-in for --profile's traces on 3 GPUs: ProfilerSteps on the CPU, kernels on a stream.
    gpu = load_gpu_check()
    run, logs = tmp_path / "run", tmp_path / "logs"
    run.mkdir(), logs.mkdir()

    def trace(rank, kernels):
        events = [{"ph": "X", "name": f"ProfilerStep#{n}", "cat": "user_annotation", "tid": 1, "ts": 1e4 * n,
                   "dur": 1e4} for n in (3, 4, 5)]
        events += [{"ph": "X", "name": name, "cat": "kernel", "tid": 7, "ts": 3.1e4, "dur": 2e3} for name in kernels]
        (run / f"profile_rank{rank}.json").write_text(json.dumps({"traceEvents": events}))

    for rank in range(3):
        trace(rank, ["sm90_xmma_gemm", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"])
    ok, text = gpu.gpu_timeline(run, 3, logs)
    assert ok and "[(2, 1), (2, 1), (2, 1)]" in text, text
    assert sorted(p.name for p in logs.iterdir()) == ["ddp-timeline-gpu.png", "profile_rank0.json",
                                                      "profile_rank1.json"]
    trace(2, [])  # CUDA's activity not recorded in one process: no kernels
    ok, text = gpu.gpu_timeline(run, 3, logs)
    assert not ok and "without CUDA kernels" in text, text
