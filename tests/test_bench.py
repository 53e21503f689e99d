"""The benchmark runs and writes its table; the GPU check plans its groups in order within its
total, names only flags the scripts accept, writes a row as each check ends, stops at its total
leaving the rows before, and without CUDA stops with one line (smoke tests of the benchmarks:
behaviour only, never an assertion on this machine's speed)."""
import importlib.util
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
    """[(group, check, estimated seconds)] from a dry run's output, in its order."""
    return [(group, name, float(seconds)) for group, name, seconds
            in re.findall(r"^# \((\w)\) (\S+): est\. ([\d.]+) s", output, re.M)]


# The plan's order: what only a GPU proves, the most important first.
PLAN = {
    "a": ["single_gpu", "dataparallel", "amp_fp16_accum_nccl", "full", "full_validation", "fsdp_bf16_accum",
          "fsdp_validation"],
    "b": ["dropout_stopped", "dropout_resumed", "dropout_straight", "dropout_resume_is_bitwise", "fsdp_stopped",
          "fsdp_resumed", "fsdp_straight", "fsdp_resume_is_bitwise", "fsdp_trains_what_ddp_trains"],
    "c": ["fsdp_bf16_no_recompute", "recompute_is_bitwise_resnet18", "transformer_recompute", "transformer_plain",
          "recompute_is_bitwise_transformer"],
    "d": ["fsdp_fp16", "fsdp_fp16_validation"],
    "e": ["bare", "ddp_full_speed", "fsdp_speed", "fsdp_speed_contiguous"],
}
TWO_ON_ONE = ["two_on_one_gpu_full", "two_on_one_gpu_validation", "two_on_one_gpu_fsdp"]


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_gpu_check_plans_its_groups_in_order_within_the_total(gpus):
    # The GPU machine lent to this project: about 15 minutes in all, a cold start of minutes
    # included, at most 10 a command. One command of 5 minutes must give the verdict: its checks'
    # estimates add up to at most 290 s, leaving room for torch's start-up.
    result = gpu_check("--dry-run", "--gpus", str(gpus))
    assert result.returncode == 0, result.stdout[-2000:]
    assert re.findall(r"^## \((\w)\) ", result.stdout, re.M) == ["a", "b", "c", "d", "e"]
    expected = dict(PLAN, a=PLAN["a"] + (TWO_ON_ONE if gpus == 1 else []))
    assert [(group, name) for group, name, _ in planned(result.stdout)] == [
        (group, name) for group, names in expected.items() for name in names]
    total = sum(seconds for _, _, seconds in planned(result.stdout))
    assert total <= 290
    assert result.stdout.splitlines()[-1].endswith(f"estimates adding up to {total:g} s of 290 s")


def test_a_gpu_check_plan_whose_estimates_pass_its_limit_fails_the_dry_run():
    result = gpu_check("--dry-run", "--limit", "100")
    assert result.returncode == 1 and result.stdout.splitlines()[-1].endswith(" s of 100 s"), result.stdout[-300:]


def test_gpu_check_runs_every_script_with_flags_it_accepts(tmp_path):
    # The check itself needs CUDA, which CI does not have; its dry run prints the commands it would
    # run, so a renamed or removed flag fails here instead of on the next machine with a GPU. The
    # transformer's copy of fsdp.py is made here where the check would make it.
    gpu, checked = load_gpu_check(), set()
    for gpus in ("1", "2"):
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
                gpu.transformer_copy(path)
            spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.parse_args(words[words.index(name) + 1:])  # argparse exits (the test fails) on a bad flag
            checked.add(path.name)
    # ddp_basic.py's nccl path is ddp_amp_accum.py's, which runs it with more.
    assert checked == set(SCRIPTS) - {"ddp_basic.py"} | {"fsdp_transformer.py"}


def test_the_gpu_checks_transformer_is_fsdp_with_the_tests_transformer_section(tmp_path):
    import ladder
    from test_seam import TRANSFORMER

    load_gpu_check().transformer_copy(tmp_path / "copy.py")
    assert (tmp_path / "copy.py").read_text() == ladder.replace_seam(ladder.read("fsdp.py", ROOT), TRANSFORMER)


def test_gpu_check_names_a_world_of_one_and_adds_two_processes_sharing_the_gpu():
    one = gpu_check("--dry-run", "--gpus", "1").stdout
    assert "1 process (a world of one)" in one and "2 processes on 1 GPU (gloo)" in one
    assert one.count("--nnodes=2 --nproc_per_node=1") == 4  # two agents of one process each, twice
    assert re.search(r"^# \(a\) two_on_one_gpu_fsdp: .*: a trial", one, re.M)
    two = gpu_check("--dry-run", "--gpus", "2").stdout
    assert "a world of one" not in two and "two_on_one_gpu" not in two and "--nproc_per_node=2" in two


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
    # Every launch a comparison reads runs with deterministic kernels, TF32 and autotuning off.
    needed = {need for item in compares.values() for need in item.needs}
    assert sorted(name for name in needed if "--deterministic" not in items[name].commands[0]) == []
    assert sorted(name for name, item in compares.items() if item.describe.endswith("bit for bit")) == [
        "dropout_resume_is_bitwise", "fsdp_resume_is_bitwise", "recompute_is_bitwise_resnet18",
        "recompute_is_bitwise_transformer"]
    assert compares["fsdp_trains_what_ddp_trains"].describe.endswith("each tensor within 0.0001 of its norm")
    assert "mobilenet_v3_small" in items["dropout_straight"].commands[0]  # dropout: random draws on the GPU
    assert "--activation-checkpointing" in items["fsdp_bf16_accum"].commands[0]
    assert "--activation-checkpointing" not in items["fsdp_bf16_no_recompute"].commands[0]


def test_a_gpu_check_trial_that_cannot_run_here_is_a_row_that_says_so_not_a_failure(tmp_path):
    gpu = load_gpu_check()
    failing = [sys.executable, "-c", "raise RuntimeError('gloo does not support reduce_scatter on CUDA')"]
    deadline = time.monotonic() + 60
    result, _, _ = gpu.run_launch(gpu.Launch("trial", [failing], 20, "-", "-", trial=True), tmp_path, deadline, 60)
    assert result == "not here: RuntimeError: gloo does not support reduce_scatter on CUDA", result
    result, _, _ = gpu.run_launch(gpu.Launch("check", [failing], 20, "-", "-"), tmp_path, deadline, 60)
    assert result == "FAILED: exit 1 (logs/check.log)", result


def test_fsdps_warning_of_a_unit_without_forward_fails_its_row_whatever_the_exit_status(tmp_path):
    gpu = load_gpu_check()
    deadline = time.monotonic() + 60
    warning = ("1 of the 2 modules passed to fully_shard did not run forward before backward, which is "
               "error-prone since FSDP post-forward/pre-backward logic will not run for these modules.")
    warns = [sys.executable, "-c", f"import sys; print({warning!r}, file=sys.stderr)"]
    result, _, _ = gpu.run_launch(gpu.Launch("warns", [warns], 5, "-", "-"), tmp_path, deadline, 60)
    assert result.startswith("FAILED: warned: FSDP: a unit's pre-backward logic never ran"), result
    assert result.endswith("(logs/warns.log)")
    # An operation without a deterministic kernel is noted, not failed: the comparison after it decides.
    notes = [sys.executable, "-c", "print('UserWarning: adaptive_avg_pool2d_backward_cuda does not have a "
                                   "deterministic implementation, but you set ...')"]
    result, _, _ = gpu.run_launch(gpu.Launch("notes", [notes], 5, "-", "-"), tmp_path, deadline, 60)
    assert result == "ok (no deterministic kernel, warned: adaptive_avg_pool2d_backward_cuda)", result


def table_rows(path):
    """{check: (result, seconds)} of a gpu_check.md, in its order."""
    rows = [line.split(" | ") for line in path.read_text().splitlines() if line.startswith("| (")]
    return {row[0][2:]: (row[2], row[3]) for row in rows}


def test_the_total_cuts_off_the_launch_running_and_leaves_the_rows_before_it(tmp_path):
    # Fake launches, a total of 4 s: two launches end (one past its estimate: not a failure), a
    # comparison after them, then a launch of two sleeping processes is cut off at the total; the
    # checks after it are not run.
    gpu = load_gpu_check()
    token = f"gpu-check-sleeper-{tmp_path.name}"
    quick = [sys.executable, "-c", "print('done')"]
    late = [sys.executable, "-c", "import time; time.sleep(1)"]
    sleeper = [sys.executable, "-c", f"import time; time.sleep(60)  # {token}"]
    groups = [("a", "first", [gpu.Launch("quick", [quick], 0.1, "w", "s"), gpu.Launch("late", [late], 0.1, "w", "s"),
                              gpu.Compare("compared", ["quick", "late"], lambda: (True, "equal"), 0.1, "w", "s", "d")]),
              ("b", "second", [gpu.Launch("sleeper", [sleeper, list(sleeper)], 1, "w", "s"),
                               gpu.Compare("after", ["sleeper"], lambda: (True, "equal"), 0.1, "w", "s", "d"),
                               gpu.Launch("never", [quick], 1, "w", "s")])]
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    start = time.monotonic()
    passed, _ = gpu.run_plan(groups, out, logs, 4, start=start)
    assert time.monotonic() - start < 10 and passed is False
    rows = table_rows(out / "gpu_check.md")
    assert {check: result for check, (result, _) in rows.items()} == {
        "(a) quick": "ok", "(a) late": "ok", "(a) compared": "ok (equal)",
        "(b) sleeper": "cut off at the total of 4 s (logs/sleeper.log)",
        "(b) after": "not run: the total was spent", "(b) never": "not run: the total was spent"}
    assert rows["(a) late"][1].endswith("(est. 0.1)") and float(rows["(a) late"][1].split()[0]) >= 1
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs", "logs/late.log", "logs/quick.log", "logs/sleeper.log"]
    time.sleep(0.5)  # a killed process leaves /proc as its parent reaps it
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if token in p.read_text(errors="replace")]
    assert left == [], "a sleeper still running after the total cut it off"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.md", "logs.tar.gz"]


def test_a_gpu_check_comparison_after_a_failed_launch_is_not_run(tmp_path):
    gpu = load_gpu_check()
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    groups = [("a", "only", [gpu.Launch("broken", [failing], 1, "w", "s"),
                             gpu.Compare("compared", ["broken"], lambda: (True, "equal"), 0.1, "w", "s", "d")])]
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    passed, _ = gpu.run_plan(groups, out, logs, 60, start=time.monotonic())
    assert passed is False
    assert [result for result, _ in table_rows(out / "gpu_check.md").values()] == [
        "FAILED: exit 3 (logs/broken.log)", "not run: broken did not end ok"]


@pytest.mark.slow  # a torchrun worker stopped at a total of 20 s: second tier
def test_the_total_stops_torchruns_workers_too(tmp_path):
    # torchrun starts each worker in a session of its own: stopping the agent's group alone would
    # leave the worker running (on a GPU, holding it after the check has ended).
    gpu = load_gpu_check()
    marker = tmp_path / "sleeping_worker.py"
    marker.write_text("import time\ntime.sleep(120)\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(marker)]
    result, _, _ = gpu.run_launch(gpu.Launch("sleeping_worker", [command], 20, "-", "-"), tmp_path,
                                  time.monotonic() + 20, 20)
    assert result == "cut off at the total of 20 s (logs/sleeping_worker.log)", result
    time.sleep(1)  # a killed process leaves /proc as its parent reaps it
    left = [cmdline for cmdline in Path("/proc").glob("[0-9]*/cmdline")
            if str(marker) in cmdline.read_text(errors="replace")]
    assert left == [], "worker still running after the launch was stopped"


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
        True, "3 samples, 2 correct against 3 here (1 ties within 0.0001); loss 0.0e+00 apart, relative "
              "(allowed 0.0001)")
    # Two flips, one tie: not in float32; in bf16, where the third sample is a tie too.
    assert gpu.judge_validation(dict(record, val_acc=1 / 3), logits, labels, "none")[0] is False
    assert gpu.judge_validation(dict(record, val_acc=1 / 3), logits, labels, "bf16")[0] is True
    # The loss: within 1e-4 relative in float32, not 3e-4; the samples counted exactly.
    assert gpu.judge_validation(dict(record, val_loss=loss * (1 + 5e-5)), logits, labels, "none")[0] is True
    assert gpu.judge_validation(dict(record, val_loss=loss * (1 + 3e-4)), logits, labels, "none")[0] is False
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
