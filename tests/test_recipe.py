"""The training recipe inside the proofs: learning-rate schedule, AdamW, starting from weights.

The schedule is a closed form of the optimizer step (linear warm-up to --lr over --warmup-epochs,
then cosine decay to 0 after the last step), stepped once per optimizer step, never per
micro-batch; its position is part of a checkpoint. Progress lines print the rate each step used
with 6 significant digits: LR_RTOL = 1e-5 is that rounding, and a schedule stepped per micro-batch
or restarted after a resume is off by a factor, not a digit.

AdamW's equivalences. AdamW divides each step by the root of the gradient's running mean square,
so every weight moves by about --lr (1e-3) a step whatever its gradient's size: where rounding
flips a ReLU or max-pool tie, a small gradient changes by a large fraction and so does its step.
Measured after 24 steps, 2 processes vs one on the global batch: max weight difference 5.1e-5,
per-epoch losses within 7e-7 on the first machine; 7.6e-5 and 2.2e-6 on one whose CPU has
AVX512-FP16 and AMX (other kernels, other rounding). ADAMW_WEIGHT_ATOL = 5e-4 is 10x the weights'
and below half a step of AdamW: a bug that changes what is trained (another sample order, a lost
or doubled step) moves weights by whole steps of 1e-3. The losses follow the weights: their
tolerance was test_equivalence.py's LOSS_ATOL (1e-6, set for SGD, whose losses differ by 7e-8),
which the second machine exceeded at 2.2e-6; ADAMW_LOSS_ATOL = 1e-5 is about 5x the larger
measurement; the weights' tolerance, not the losses', is what catches such a bug.
"""
import math
import re
import shutil

import pytest
import torch

from conftest import TINY, TRAIN_SAMPLES, check, launch, metrics, run_ok, weights
from test_equivalence import ACCUM, assert_same_training
from test_resume import assert_bitwise_equal, run_full
from test_validation import assert_counts_correct, load_script, reference_logits

LR_RTOL = 1e-5
ADAMW_WEIGHT_ATOL = 5e-4
ADAMW_LOSS_ATOL = 1e-5
PROGRESS = re.compile(r"^epoch (\d+)/\d+ step (\d+)/(\d+) loss \S+ \| lr (\S+) \|", re.MULTILINE)


def closed_form(step, steps_per_epoch, epochs, lr, warmup_epochs):
    """The learning rate of optimizer step `step` (from 0): warm-up, then cosine."""
    warmup = round(warmup_epochs * steps_per_epoch)
    if step < warmup:
        return lr * (step + 1) / warmup
    total = epochs * steps_per_epoch
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def logged_rates(stdout):
    """{global step: rate} from the progress lines of a run with --log-interval 1."""
    rates = {}
    for epoch, step, steps, lr in PROGRESS.findall(stdout):
        rates[(int(epoch) - 1) * int(steps) + int(step) - 1] = float(lr)
    return rates


def assert_schedule(stdout, steps_per_epoch, epochs, lr, warmup_epochs):
    rates = logged_rates(stdout)
    assert sorted(rates) == list(range(steps_per_epoch * epochs)), sorted(rates)
    for step, rate in rates.items():
        expected = closed_form(step, steps_per_epoch, epochs, lr, warmup_epochs)
        assert rate == pytest.approx(expected, rel=LR_RTOL), (step, rate, expected)
    # Both phases are exercised: a rise to the peak, then a fall.
    peak = max(rates, key=rates.get)
    assert 0 < peak < len(rates) - 1 and rates[len(rates) - 1] < 0.5 * lr


def test_learning_rate_is_warmup_then_cosine_at_every_step(tmp_path):
    # 192 samples at batch 16: 12 optimizer steps an epoch, 24 in all; half an epoch of warm-up.
    result = run_ok("single_gpu.py", tmp_path, ["--batch-size", "16", "--warmup-epochs", "0.5",
                                                "--log-interval", "1"])
    assert_schedule(result.stdout, TRAIN_SAMPLES // 16, 2, 0.03, 0.5)
    # metrics.jsonl holds the rate reached at each epoch's end: the next step's.
    assert [r["lr"] for r in metrics(tmp_path)] == pytest.approx(
        [closed_form(12, 12, 2, 0.03, 0.5), closed_form(24, 12, 2, 0.03, 0.5)], rel=1e-12)


@pytest.mark.slow
def test_learning_rate_moves_once_per_optimizer_step_with_accumulation(tmp_path):
    # 2 processes x 8 x 5 micro-batches: 3 optimizer steps an epoch from 12 micro-batches each.
    result = run_ok("ddp_amp_accum.py", tmp_path, [*ACCUM, "--log-interval", "1"], nproc=2)
    assert_schedule(result.stdout, 3, 2, 0.03, 1.0)


@pytest.mark.slow
def test_constant_schedule_keeps_the_learning_rate(tmp_path):
    result = run_ok("single_gpu.py", tmp_path, ["--batch-size", "16", "--lr-schedule", "constant",
                                                "--log-interval", "1"])
    assert set(logged_rates(result.stdout).values()) == {0.03}


# --- AdamW trains what it trains on any world size, with accumulation too ------------------------

ADAMW = ["--optimizer", "adamw"]


@pytest.mark.slow
def test_adamw_ddp_on_2_processes_matches_one_process_on_the_global_batch(runs):
    single = runs.get("single16_adamw", "single_gpu.py", [*ADAMW, "--batch-size", "16"])
    ddp = runs.get("basic_w2_adamw", "ddp_basic.py", [*ADAMW, "--batch-size", "8"], nproc=2)
    assert_same_training(single, ddp, atol=ADAMW_WEIGHT_ATOL, loss_atol=ADAMW_LOSS_ATOL)


@pytest.mark.slow
def test_adamw_accumulation_matches_one_process_on_the_global_batch(runs):
    single = runs.get("single80_adamw", "single_gpu.py", [*ADAMW, "--batch-size", "80"])
    accum = runs.get("accum5_w2_adamw", "ddp_amp_accum.py", [*ADAMW, *ACCUM], nproc=2)
    assert_same_training(single, accum, atol=ADAMW_WEIGHT_ATOL, loss_atol=ADAMW_LOSS_ATOL)


def test_weight_decay_spares_biases_and_norm_weights():
    module = load_script("single_gpu.py")
    args = module.parse_args(["--optimizer", "adamw", "--model", "resnet18"])
    model = module.build_model(args, 10)
    decayed, spared = module.build_optimizer(args, model).param_groups
    assert decayed["weight_decay"] == 0.05 and spared["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in spared["params"])
    assert len(decayed["params"]) + len(spared["params"]) == len(list(model.parameters()))


# --- a run stopped in warm-up or in decay resumes bitwise (AdamW's moments, the schedule) --------

# 2 processes x 8: 12 optimizer steps an epoch, 24 in all; warm-up is the first epoch.
RESUME = ["--batch-size", "8", *ADAMW]


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [5, 17], ids=["in-warm-up", "in-decay"])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(runs, tmp_path, stop_at):
    reference = runs.get("full_w2_adamw", "ddp_full.py", RESUME, nproc=2)
    stopped = run_full(tmp_path, *RESUME, "--max-steps", str(stop_at))
    assert f"stopped after --max-steps {stop_at}" in stopped.stdout
    checkpoint = torch.load(tmp_path / "checkpoints" / f"step_{stop_at:09d}.pt", weights_only=True)
    assert checkpoint["scheduler"]["last_epoch"] == stop_at
    resumed = run_full(tmp_path, *RESUME)
    assert f"step_{stop_at:09d}.pt: step {stop_at % 12} of epoch {stop_at // 12 + 1}" in resumed.stdout
    assert_bitwise_equal(reference, tmp_path)


@pytest.mark.slow
def test_a_resumed_cosine_run_refuses_another_number_of_epochs(runs, tmp_path):
    shutil.copytree(runs.get("full_w2_adamw", "ddp_full.py", RESUME, nproc=2), tmp_path / "run")
    result = launch("ddp_full.py", [*TINY, *RESUME, "--epochs", "3", "--out-dir", str(tmp_path / "run")], nproc=2)
    assert result.returncode != 0
    assert "is from a run with --epochs 2, this run has 3" in result.stderr


# --- starting from weights ----------------------------------------------------------------------

@pytest.mark.slow
def test_ddp_full_starts_from_single_gpu_weights_and_first_scores_them_as_single_gpu_did(runs):
    single = runs.get("single16", "single_gpu.py", ["--batch-size", "16"])
    # The run test_a_resume_wins_over_init_from resumes, which checks that it says where it started.
    started = runs.get("full_w2_init", "ddp_full.py", ["--batch-size", "8", "--init-from", str(single / "model.pt")],
                       nproc=2)
    start, last_single = metrics(started)[0], metrics(single)[-1]
    assert start["epoch"] == 0 and start["val_samples"] == last_single["val_samples"]
    # The same weights on the same samples: the counts equal (but for a tie to rounding, test_validation.py),
    # the loss up to summation order.
    assert_counts_correct(start["val_acc"], *reference_logits("ddp_full.py", single / "model.pt"))
    assert_counts_correct(last_single["val_acc"], *reference_logits("ddp_full.py", single / "model.pt"))
    assert start["val_loss"] == pytest.approx(last_single["val_loss"], rel=1e-6)
    assert len(metrics(started)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("script, name", [("ddp_full.py", "full_w2_init"), ("fsdp.py", "fsdp_w2_init")])
def test_a_resume_wins_over_init_from(script, name, runs, tmp_path):
    # The same command resumes: the checkpoint's weights, not the file's, and no second epoch-0 score.
    single = runs.get("single16", "single_gpu.py", ["--batch-size", "16"])
    args = ["--batch-size", "8", "--init-from", str(single / "model.pt")]
    reference = runs.get(name, script, args, nproc=2)
    first = check(launch(script, [*TINY, *args, "--max-steps", "7", "--out-dir", str(tmp_path)], nproc=2))
    assert f"weights from {single / 'model.pt'}" in first.stdout
    resumed = check(launch(script, [*TINY, *args, "--out-dir", str(tmp_path)], nproc=2))
    assert "resumed from" in resumed.stdout and "step_000000007" in resumed.stdout, resumed.stdout
    assert "weights from" not in resumed.stdout
    assert_bitwise_equal(reference, tmp_path)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.module."])
def test_init_from_takes_a_state_dict_saved_from_a_wrapper(runs, tmp_path, prefix):
    single = runs.get("single16", "single_gpu.py", ["--batch-size", "16"])
    plain = weights(single)
    torch.save({prefix + key: value for key, value in plain.items()}, tmp_path / "wrapped.pt")
    module = load_script("ddp_full.py")
    args = module.parse_args(["--init-from", str(tmp_path / "wrapped.pt")])
    model = module.build_model(args, module.NUM_SYNTHETIC_CLASSES)
    module.init_weights_from(args, model)
    assert all(torch.equal(model.state_dict()[key], plain[key]) for key in plain)


def test_pretrained_weights_come_from_torch_cache_with_a_fresh_classifier(tmp_path, monkeypatch):
    # torchvision's resnet18 weights, as a download leaves them (no download here): a file named
    # as in the weights' URL under <torch hub dir>/checkpoints, for 1000 ImageNet classes.
    import torchvision

    module = load_script("ddp_full.py")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    args = module.parse_args(["--model", "resnet18", "--init-from", "pretrained"])
    with pytest.raises(module.ConfigError, match="weights are not in .*: fetch them once"):
        module.init_weights_from(args, module.build_model(args, 3))
    published = torchvision.models.resnet18(num_classes=1000).state_dict()
    (tmp_path / "checkpoints").mkdir()
    torch.save(published, tmp_path / "checkpoints" / "resnet18-f37072fd.pth")
    model = module.build_model(args, 3)
    fresh = {key: value.clone() for key, value in model.state_dict().items()}
    module.init_weights_from(args, model)
    for key, value in model.state_dict().items():
        expected = fresh[key] if key in ("fc.weight", "fc.bias") else published[key]
        assert torch.equal(value, expected), key


@pytest.mark.slow
def test_progress_lines_show_the_gradient_norm_when_clipping(tmp_path):
    result = run_ok("ddp_amp_accum.py", tmp_path, [*ACCUM, "--clip-grad-norm", "1", "--log-interval", "1"],
                    nproc=2)
    norms = re.findall(r"\| lr \S+ \| grad norm (\S+) \|", result.stdout)
    assert len(norms) == len(PROGRESS.findall(result.stdout)) == 6
    assert all(float(norm) > 0 for norm in norms)


@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_init_from_reads_a_file_of_torch_saves_older_format_too(tmp_path, script):
    # Memory-mapped reading takes torch.save's zip format only: a file of the older format is read whole.
    module = load_script(script)
    state = module.SmallCNN(10).state_dict()
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    read = module.read_state_dict(tmp_path / "old.pt")
    assert read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state)
