"""The copier's map cannot rot: every part it says a copier may delete can be deleted.

Every script tags its optional parts "# [optional: NAME]" and lists them, with what each deletion
gives up, in its docstring (the copier's map); tools/strip_optional.py deletes them, and lean/ holds
what it leaves of each script (tests/test_lean.py). What is left must read nothing a deleted part
defined, and train what the full script trains, bitwise (the same arithmetic on the same samples, so
a deleted part that took part in the default run would show); lean ddp_full.py and fsdp.py resume
bitwise from the checkpoint of an epoch's end and validate exactly: their validation metrics are
the full scripts', which tests/test_validation.py proves equal to one process scoring the whole set.
"""
import ast
import re
import shutil
import sys

import pytest
import torch

from conftest import ROOT, TINY, check, launch, metrics, weights
from test_resume import TIMING_KEYS
from test_static import SCRIPTS

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402
import make_diffs  # noqa: E402
import strip_optional  # noqa: E402

# A line of the map: four spaces, the NAME (one or two words), two spaces or more, what it gives up.
MAP_LINE = re.compile(r"^    (\S+(?: \S+)?)  +\S")


def map_names(text):
    listing = ast.get_docstring(ast.parse(text)).split(strip_optional.MAP, 1)[1]
    return [match.group(1) for line in listing.splitlines() if (match := MAP_LINE.match(line))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_map_lists_every_tagged_part_and_nothing_else(script):
    text = ladder.read(script, ROOT)
    assert strip_optional.tags(text), f"{script} tags no optional part"
    assert sorted(map_names(text)) == sorted(strip_optional.tags(text))


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_hardening_page_shows_every_tagged_line_under_its_parts_in_the_maps_order(script):
    # docs/hardening/<stem>.md (tools/make_diffs.py): a section per NAME, in the map's order, its
    # lines linked as `#L<first>-L<last>`; together they must cover every line a strip deletes.
    text = ladder.read(script, ROOT)
    page = make_diffs.hardening_page(script, ROOT)
    assert [line[3:] for line in page.splitlines() if line.startswith("## ")] == map_names(text)
    shown = set()
    for first, last in re.findall(rf"\(\.\./\.\./{re.escape(script)}#L(\d+)(?:-L(\d+))?\)", page):
        shown.update(range(int(first), int(last or first) + 1))
    lines = text.splitlines()
    missing = {n for n in strip_optional.tagged_lines(text) if lines[n - 1].strip()} - shown
    assert not missing, sorted(missing)


# The two scripts of most parts, a launch each: tier 2 (the first tier's six minutes).
@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in ("ddp_full.py", "fsdp.py") else s
                                    for s in SCRIPTS])
def test_each_part_deletes_alone_and_the_rest_reads_nothing_it_defined(script):
    text = ladder.read(script, ROOT)
    defined = lambda tree: {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))} | \
        {target.id for node in tree.body if isinstance(node, ast.Assign)
         for target in node.targets if isinstance(target, ast.Name)}
    used = lambda tree: {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    flags, names = set(ladder.flags(text)), defined(ast.parse(text))  # the whole script's, once
    for part in [*strip_optional.tags(text), None]:  # each part alone, then all of them
        stripped = strip_optional.strip(text, None if part is None else {part})
        tree = ast.parse(stripped)
        # A flag that went must not be read (args.<its name> would raise at start-up), nor a
        # function or class that went be called.
        for flag in flags - set(ladder.flags(stripped)):
            name = flag.lstrip("-").replace("-", "_")
            assert f"args.{name}" not in stripped, f"{part or 'all parts'}: {flag} deleted, still read"
        gone = (names - defined(tree)) & used(tree)
        assert not gone, f"{part or 'all parts'}: {sorted(gone)} deleted, still used"
        # The section check looks its names up by string: one that went would stop every run.
        hooks = {key.value for node in tree.body if isinstance(node, ast.Assign)
                 and [target.id for target in node.targets] == ["TASK_HOOKS"] for key in node.value.keys}
        assert hooks <= defined(tree), f"{part or 'all parts'}: {sorted(hooks - defined(tree))} " \
                                       "deleted, still required by the section check"


REFERENCES = {"ddp_full.py": "full_w2", "fsdp.py": "fsdp_w2_b8"}  # runs other tests share
# What the full scripts record and the lean copies do not: the counts of their part "unreadable files".
UNREADABLE_KEYS = {"train_unreadable", "val_unreadable"}


def assert_lean_equal(full_dir, lean_dir):
    """The same weights, bitwise, and the same records, but the unreadable-file counts (zero here)."""
    full, lean = weights(full_dir), weights(lean_dir)
    assert full.keys() == lean.keys() and all(torch.equal(full[key], lean[key]) for key in full)
    kept = lambda records, drop: [{k: v for k, v in r.items() if k not in drop} for r in records]
    assert all(r["train_unreadable"] == r["val_unreadable"] == 0 for r in metrics(full_dir))
    assert kept(metrics(full_dir), {*TIMING_KEYS, *UNREADABLE_KEYS}) == kept(metrics(lean_dir), TIMING_KEYS)
ARGS = ["--batch-size", "8"]  # 2 processes x 8: 12 optimizer steps in each epoch of 192 samples


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_the_lean_copy_trains_resumes_and_validates_as_the_full_script(script, runs, tmp_path):
    reference = runs.get(REFERENCES[script], script, ARGS, nproc=2)
    copy = ROOT / "lean" / script
    straight = tmp_path / "straight"
    check(launch(str(copy), [*TINY, *ARGS, "--out-dir", str(straight)], nproc=2))
    assert_lean_equal(reference, straight)
    # A run that crashed in epoch 2, its last checkpoint the end of epoch 1's (step 12 of 24): the
    # straight run's files as they were then. The same command resumes it.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    (resumed / "model.pt").unlink()
    for path in (resumed / "checkpoints").iterdir():
        if not path.name.startswith("step_000000012"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    second = check(launch(str(copy), [*TINY, *ARGS, "--out-dir", str(resumed)], nproc=2))
    assert re.search(r"resumed from \S*step_000000012(\.pt)?: epoch 2\n", second.stdout), second.stdout
    assert_lean_equal(reference, resumed)
