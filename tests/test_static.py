"""Properties read from the scripts' source, or checked on one function in-process."""
import inspect
import pickle

import pytest
import torch

from conftest import ROOT
from test_validation import load_script

SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]
MAPPED = ["ddp_full.py", "fsdp.py"]  # the scripts with the machinery of long runs, full-disk writes among it


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_deprecated_amp_api(script):
    # torch.cuda.amp.autocast/GradScaler and torch.cpu.amp.autocast emit FutureWarnings in torch 2.x.
    text = (ROOT / script).read_text()
    for deprecated in ("torch.cuda.amp", "torch.cpu.amp", "cuda.amp.", "GradScaler()"):
        assert deprecated not in text, deprecated


class FailsHalfway:
    """Pickling this raises after torch.save has started writing."""

    def __reduce__(self):
        raise pickle.PicklingError("boom")


@pytest.mark.parametrize("script", MAPPED)
def test_save_file_leaves_the_old_file_whole_when_a_write_fails(script, tmp_path):
    module = load_script(script)
    target = tmp_path / "model.pt"
    module.save_file({"weights": [1, 2, 3]}, target)
    good = target.read_bytes()
    with pytest.raises(pickle.PicklingError):
        module.save_file({"weights": list(range(10000)), "bad": FailsHalfway()}, target)
    assert target.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left behind


@pytest.mark.parametrize("script", SCRIPTS)
def test_to_device_moves_the_tensors_of_a_batch_and_leaves_the_rest_as_it_is(script):
    # A copier's batch may carry file names or numbers beside its tensors: iterated as sequences,
    # a string recursed without end and a number raised a TypeError.
    module = load_script(script)
    extra = [False] * ("channels_last" in inspect.signature(module.to_device).parameters)
    batch = {"images": torch.ones(2, 3, 4, 4), "names": ["a.png", "b.png"], "meta": (7, None, "x")}
    moved = module.to_device(batch, torch.device("cpu"), *extra)
    assert moved["names"] == ["a.png", "b.png"] and moved["meta"] == (7, None, "x")
    assert torch.equal(moved["images"], batch["images"])


def test_ci_runs_the_readme_test_commands_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# README, Quickstart, command 2 (verbatim):") + 2]
    assert command.startswith("python3 -m venv .venv && ")
    assert f"```bash\n{command}\n```" in (ROOT / "README.md").read_text()
    second = ci[ci.index("# README, the second tier (verbatim): cluster scenarios, the seam copies, the benchmark's "
                         "smoke run.") + 1]
    assert second.endswith("-m slow tests")
    assert f"```bash\n{second}\n```" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_line_is_wider_than_100_columns(script):
    # Two scripts side by side, as the generated pages show them, fit a laptop screen at 100 columns.
    wide = [(number, len(line)) for number, line in enumerate((ROOT / script).read_text().splitlines(), 1)
            if len(line) > 100]
    assert not wide, wide


@pytest.mark.parametrize("script", SCRIPTS)
def test_train_the_hub_that_calls_everything_stays_readable(script):
    # train() is where a reader follows the whole run; past about 120 lines it no longer fits in
    # two screens, and a new concept should become a function of its own.
    import ast

    tree = ast.parse((ROOT / script).read_text())
    train = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 120


# How a script is laid out (README, "The ladder"): the program a step teaches first,
# then the machinery it needs, each section of which says what it is for and that a first reading
# may skip it. The same sections in the same order in every script; a step's own concept adds one:
# the processes at step 3, checkpoints, samples and the model check at step 5, sharding at step 6.
LESSON = ["main", "train/eval", "your data and model", "distributed", "sharding", "data loading",
          "optimizer and schedule", "checkpointing"]
MACHINERY = ["samples", "model", "machinery"]
CONCEPT_ONLY = {"distributed": 2, "sharding": 5, "checkpointing": 4, "samples": 4, "model": 4}  # first index
SKIP = "# Skip on a first reading: "


def sections(script):
    """[(title, marked to skip)] of the script's "# --- title ---" sections, in file order."""
    lines = (ROOT / script).read_text().splitlines()
    return [(line[len("# --- "):].rstrip("- "), lines[i + 1].startswith(SKIP))
            for i, line in enumerate(lines) if line.startswith("# --- ")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_program_comes_first_then_the_machinery_each_section_marked(script):
    found = sections(script)
    titles = [title for title, _ in found]
    expected = [title for title in LESSON + MACHINERY
                if SCRIPTS.index(script) >= CONCEPT_ONLY.get(title, 0)]
    assert titles == expected, titles
    assert [title for title, marked in found if marked] == [t for t in MACHINERY if t in titles]


@pytest.mark.parametrize("script", SCRIPTS)
def test_train_one_epoch_starts_within_the_first_third(script):
    # A newcomer reading from the top meets the training loop before a third of the file is read.
    lines = (ROOT / script).read_text().splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.startswith("def train_one_epoch("))
    assert start <= len(lines) / 3, f"line {start} of {len(lines)}"


# Line budgets, whole files, comments and blank lines included (the issue "As light as its lessons"
# asked for 300, 340, 480, 560, 1,150 and 1,500 lines, and 650 and 900 for ddp_full.py and fsdp.py
# stripped by their maps: the ladder is above those, tests/README.md says why). The whole-file budgets
# are those the issue "Every script in two layers" decided, with room for the tags and what the GPU and
# cluster issues add, raised by the issue "Your section as users write it" by what its lesson code
# added (the count's weighting, the divergence checks: tests/README.md, "Line budgets"), and by the
# issue "See where the time goes" by its optional parts: --profile 66 lines in each of steps 3-6
# (fsdp.py's within its room), --grad-compression 19 in ddp_full.py. New code pays for itself by
# removing old. A script may shrink; a line more is a reviewed edit of this table.
BUDGETS = {"single_gpu.py": 530, "dataparallel.py": 560, "ddp_basic.py": 754, "ddp_amp_accum.py": 838,
           "ddp_full.py": 1861, "fsdp.py": 2277}
# The lean copies (every optional part stripped): the numbers reached, a ratchet below which they may
# go; the 360 / 380 / 460 / 510 / 800 / 1,050 are not met yet (tests/README.md says what is left).
LEAN_BUDGETS = {"single_gpu.py": 449, "dataparallel.py": 475, "ddp_basic.py": 562, "ddp_amp_accum.py": 643,
                "ddp_full.py": 919, "fsdp.py": 1164}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_keeps_to_its_line_budget(script):
    lines = len((ROOT / script).read_text().splitlines())
    assert lines <= BUDGETS[script], f"{script}: {lines} lines, its budget {BUDGETS[script]}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_copy_its_map_strips_keeps_to_its_line_budget(script):
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import strip_optional

    lines = len(strip_optional.strip((ROOT / script).read_text()).splitlines())
    assert lines <= LEAN_BUDGETS[script], f"{script} stripped: {lines} lines, its budget {LEAN_BUDGETS[script]}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_states_every_default_zero_included(script, capsys):
    # 0 == False in Python: a formatter that skips False defaults (store_true flags) skipped 0 too.
    with pytest.raises(SystemExit):
        load_script(script).parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "seeds the model, data and shuffle (default: 0)" in text
    if script in ("ddp_amp_accum.py", *MAPPED):  # its default is decided in train(): stated in its help
        assert "micro-batches averaged into each optimizer step (default: 1)" in text
