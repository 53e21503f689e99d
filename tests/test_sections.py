"""Sections "your data and model" as users write them (tests/sections.py), pasted into the scripts as a
user pastes one: a token language model whose loss is a mean over tokens and whose count is tokens,
padded sequences of varied lengths, dict batches with a frozen part and a part some steps leave out.
What each section returns keeps its effect: it trains, stays finite, one process trains what two
train on the same global batch, a resume is bitwise, validation is exact.

Tolerances:
- UNIT_RTOL = 1e-6 (relative, the whole model's norm): a section counting tokens against the same
  section counting samples, as the issue that made the step unit-free asked. The two differ in where
  the division by the count happens (float32 rounding): measured 3.9e-8 (ddp_amp_accum, ddp_full,
  fsdp) after 6 steps on 186 sequences of 12 tokens; put back, the weighting by the section's own count
  scales the gradient by the tokens per sample (12) and the runs end 0.94 apart.
- The equivalences with one process: test_equivalence.py's WEIGHT_ATOL and LOSS_ATOL (measured here
  1.2e-7 and below; a padded batch weighed per process instead of per token ends 2.2e-3 apart).
- Validation: test_validation.py's VAL_LOSS_RTOL against a one-process evaluation of model.pt.
"""
import fcntl
import importlib.util
import math
import sys

import pytest
import torch

from conftest import ROOT, check, launch, metrics, weights
from test_equivalence import LOSS_ATOL, WEIGHT_ATOL
from test_resume import assert_bitwise_equal
from test_validation import VAL_LOSS_RTOL

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import sections  # noqa: E402

UNIT_RTOL = 1e-6
ACCUM = ["--batch-size", "8", "--accum-steps", "5"]  # 2 processes: global batches of 80, 80 and 26
LM_ARGS = ["--sequences", "186", "--epochs", "2", "--dropout", "0", "--lr", "0.3", "--log-interval", "1000"]
DICT_ARGS = ["--epochs", "2", "--lr", "0.05", "--log-interval", "1000"]
STEPS_4_TO_6 = ["ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]


def section_copy(runs, section, script):
    """The script (or lean/<script>) with its section replaced by sections.<section>, written once."""
    name = f"{section.lower()}_{script.replace('/', '_')}"
    path = runs.root / "sections" / name
    path.parent.mkdir(exist_ok=True)
    with open(runs.root / "sections.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(ladder.replace_seam(ladder.read(script, ROOT), getattr(sections, section)))
            tmp.replace(path)
    return str(path)


def run(runs, section, script, args, nproc=2, name=None, **kwargs):
    """The run's output directory, launched once per session."""
    name = name or f"{section.lower()}_{script.replace('/', '_')}_{'_'.join(args)}_w{nproc}"
    return runs.get(name, section_copy(runs, section, script), args, nproc=nproc, tiny=False, **kwargs)


def relative_difference(a_dir, b_dir):
    """|a - b| / |b| over the whole model (global norms)."""
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    difference = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a) ** 0.5
    return (difference / sum((b[k].double() ** 2).sum() for k in b) ** 0.5).item()


def assert_same_training(reference, other):
    difference = max((weights(reference)[k].double() - weights(other)[k].double()).abs().max().item()
                     for k in weights(reference))
    assert difference <= WEIGHT_ATOL, f"max weight difference {difference:.3g} > {WEIGHT_ATOL:g}"
    for a, b in zip(metrics(reference), metrics(other), strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_ATOL, (a, b)
        assert a["val_samples"] == b["val_samples"]


def assert_learns(out_dir):
    records = metrics(out_dir)
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) for r in records), records
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.05, records
    assert all(torch.isfinite(t).all() for t in weights(out_dir).values() if t.is_floating_point())


def one_process(runs, section, args):
    """single_gpu.py on the global batch of 80: one process, no accumulation, its count unused."""
    return run(runs, section, "single_gpu.py", [*args, "--batch-size", "80"], nproc=None)


def tier2(*scripts):
    return [pytest.param(s, marks=pytest.mark.slow) for s in scripts]


# --- the count's unit -------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["ddp_amp_accum.py", *tier2("ddp_full.py", "fsdp.py", "lean/ddp_amp_accum.py",
                                                               "lean/ddp_full.py", "lean/fsdp.py")])
def test_a_section_counting_tokens_trains_as_the_same_section_counting_samples(runs, script):
    # Fixed-length sequences: a micro-batch's mean over its tokens is the same loss whichever unit its
    # count is in, so the optimizer step must be too -- with accumulation, and a short last batch (186
    # sequences: each process's last micro-batch holds 5). The lean copy against its whole script.
    tokens = run(runs, "LM", script, [*LM_ARGS, *ACCUM])
    samples = run(runs, "LM_SAMPLES", script.removeprefix("lean/"), [*LM_ARGS, *ACCUM])
    difference = relative_difference(tokens, samples)
    assert difference <= UNIT_RTOL, f"relative difference {difference:.3g} > {UNIT_RTOL:g}"
    assert_learns(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("script", STEPS_4_TO_6)
def test_a_token_language_model_trains_as_one_process_on_the_global_batch(runs, script):
    assert_same_training(one_process(runs, "LM", LM_ARGS), run(runs, "LM", script, [*LM_ARGS, *ACCUM]))


# --- varied lengths: the mean over the global batch's tokens ----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("ddp_amp_accum.py", ["--batch-size", "40"]), ("ddp_amp_accum.py", ACCUM),
                                          ("ddp_full.py", ACCUM), ("fsdp.py", ACCUM)],
                         ids=["2x40", "2x8x5", "full-2x8x5", "fsdp-2x8x5"])
def test_padded_sequences_train_on_the_mean_over_the_global_batchs_tokens(runs, script, args):
    # Processes and micro-batches hold different numbers of real tokens: the step divides the sum of
    # their token losses by all of them (every token weighs the same), as one process on the whole
    # global batch does with cross_entropy's mean. A mean of the processes' means is 2.2e-3 away.
    assert_same_training(one_process(runs, "PADDED", LM_ARGS), run(runs, "PADDED", script, [*LM_ARGS, *args]))


def load(copy):
    spec = importlib.util.spec_from_file_location("section_copy", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts run nothing at import
    return module


def evaluate_copy(out_dir, copy, argv):
    """The copy's evaluate_batch over its whole validation set in one batch of one process, with
    out_dir's model.pt: the mean of each metric."""
    module = load(copy)
    args = module.parse_args(argv)
    _, val_set, num_outputs = module.build_datasets(args)
    model = module.build_model(args, num_outputs)
    model.load_state_dict(weights(out_dir))
    batch = torch.utils.data.default_collate([val_set[i] for i in range(len(val_set))])
    with torch.no_grad():
        sums, count = module.evaluate_batch(model.eval(), batch)
    return (sums / count).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("section", ["LM", "PADDED"])
def test_sharded_validation_of_a_token_mean_equals_a_one_process_evaluation(runs, section):
    out_dir = run(runs, section, "ddp_full.py", [*LM_ARGS, *ACCUM])
    copy = section_copy(runs, section, "ddp_full.py")
    [expected] = evaluate_copy(out_dir, copy, ["--sequences", "186"])
    assert metrics(out_dir)[-1]["val_loss"] == pytest.approx(expected, rel=VAL_LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_a_language_model_with_dropout_resumes_bitwise(runs, script, tmp_path):
    # Dropout draws from each process's generator: a resume mid-epoch gives each its random state back;
    # only that makes the resumed steps drop what the uninterrupted run dropped.
    args = [*LM_ARGS[:4], "--lr", "0.3", "--log-interval", "1000", *ACCUM]  # dropout 0.1, the section's default
    straight = run(runs, "LM", script, args, name=f"lm_dropout_{script}")
    copy = section_copy(runs, "LM", script)
    check(launch(copy, [*args, "--max-steps", "2", "--out-dir", str(tmp_path)], nproc=2))
    assert "step_000000002" in check(launch(copy, [*args, "--out-dir", str(tmp_path)], nproc=2)).stdout
    assert_bitwise_equal(straight, tmp_path)


# --- dict batches, a frozen part, a part some steps leave out ---------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("ddp_basic.py", ["--batch-size", "8"]),
                                          ("ddp_amp_accum.py", ["--batch-size", "4", "--accum-steps", "2"]),
                                          ("ddp_full.py", ["--batch-size", "4", "--accum-steps", "2"])],
                         ids=["basic", "accum", "full"])
def test_dict_batches_a_frozen_part_and_a_part_some_steps_leave_out_train_as_one_process(runs, script, args):
    # Many micro-batches hold no alarm: the alarm head is left out of their steps on one process and
    # not on the other, which DDP handles with --find-unused-parameters. The frozen embedding stays as
    # it was built; where no process uses the head, its weights are left alone (no decay, no momentum).
    one = run(runs, "DICTS", "single_gpu.py", [*DICT_ARGS, "--batch-size", "16"], nproc=None)
    two = run(runs, "DICTS", script, [*DICT_ARGS, *args, "--find-unused-parameters"])
    assert_same_training(one, two)
    assert_learns(two)
    assert torch.equal(weights(two)["sensors.weight"], initial_sensors(runs))


def initial_sensors(runs):
    """The frozen embedding as the scripts build it under --seed 0."""
    module = load(section_copy(runs, "DICTS", "single_gpu.py"))
    module.set_seed(0)
    return module.build_model(module.parse_args([]), 1).sensors.weight.detach()


@pytest.mark.slow
def test_fsdp_trains_dict_batches_and_a_frozen_part_where_every_process_runs_every_parameter(runs):
    # FSDP2 reduce-scatters the gradients a process has: a parameter one process leaves out and another
    # does not makes their collectives differ (gloo aborts; pytorch#158719). The form it needs runs the
    # head on every batch's alarms, none or some; one process on it trains the same.
    one = run(runs, "DICTS_EVERY_STEP", "single_gpu.py", [*DICT_ARGS, "--batch-size", "16"], nproc=None)
    two = run(runs, "DICTS_EVERY_STEP", "fsdp.py", [*DICT_ARGS, "--batch-size", "4", "--accum-steps", "2"])
    assert_same_training(one, two)
    assert torch.equal(weights(two)["sensors.weight"], initial_sensors(runs))


@pytest.mark.slow
def test_dict_batches_resume_bitwise_and_validate_exactly(runs, tmp_path):
    args = [*DICT_ARGS, "--batch-size", "4", "--accum-steps", "2", "--find-unused-parameters"]
    straight = run(runs, "DICTS", "ddp_full.py", args)
    copy = section_copy(runs, "DICTS", "ddp_full.py")
    check(launch(copy, [*args, "--max-steps", "3", "--out-dir", str(tmp_path)], nproc=2))
    check(launch(copy, [*args, "--out-dir", str(tmp_path)], nproc=2))
    assert_bitwise_equal(straight, tmp_path)
    [expected] = evaluate_copy(straight, copy, [])
    assert metrics(straight)[-1]["val_loss"] == pytest.approx(expected, rel=VAL_LOSS_RTOL)
