"""The diff between neighbouring scripts shows only the concept its step declares.

MANIFEST lists, for each step, the regions (see tools/ladder.py) it may change, add and remove, the
flags it adds, and the size of its diff. The guard fails, printing only the offending region's diff,
when a step changes a region it does not declare, when it declares a change that did not happen
(so the manifest cannot rot into an exclusion list), when a region differs between two scripts
with no declared change in between (a fix applied to one copy only), when a flag disappears, is
renamed or changes its default, and when a diff's size differs from the recorded one (growth is
a reviewed edit of this file). Whitespace never counts; comments do.
"""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402

from ladder_manifest import MANIFEST, SHOWN_AT_END  # noqa: E402


def texts(root):
    return {name: ladder.read(name, root) for name in ladder.LADDER}


def guard_failures(root=ROOT):
    """Every way the scripts under root break the manifest, as readable messages."""
    failures = []
    scripts = texts(root)
    parsed = {name: ladder.regions(text) for name, text in scripts.items()}
    for old, new in ladder.STEPS:
        entry = MANIFEST[new]
        changed, added, removed = ladder.step_changes(scripts[old], scripts[new])
        for kind, actual, declared in (("changed or added", changed | added, set(entry["regions"])),
                                       ("removed", removed, set(entry["removed"]))):
            for name in sorted(actual - declared):
                detail = ladder.region_diff(name, parsed[old].get(name, []), parsed[new].get(name, []), old, new)
                failures.append(f"{old} -> {new}: region {name!r} {kind} but the manifest does not declare it\n{detail}")
            for name in sorted(declared - actual):
                failures.append(f"{old} -> {new}: the manifest declares region {name!r} {kind}, but it was not")
        failures += concept_failures(old, new, entry, parsed)
        old_flags, new_flags = ladder.flags(scripts[old]), ladder.flags(scripts[new])
        # A flag goes only where the step declares why (DDP's bucket settings, where no DDP is left).
        for flag in sorted(set(old_flags) - set(new_flags) - set(entry.get("flags_removed", {}))):
            failures.append(f"{old} -> {new}: flag {flag} disappeared or was renamed")
        for flag in sorted(set(entry.get("flags_removed", {})) & set(new_flags)):
            failures.append(f"{old} -> {new}: the manifest declares flag {flag} removed, but it is there")
        for flag in sorted(set(old_flags) & set(new_flags)):
            if old_flags[flag] != new_flags[flag]:
                failures.append(f"{old} -> {new}: flag {flag} changed: {old_flags[flag]} -> {new_flags[flag]}")
        if set(new_flags) - set(old_flags) != entry["flags_added"]:
            failures.append(f"{old} -> {new}: flags added {sorted(set(new_flags) - set(old_flags))}, "
                            f"manifest says {sorted(entry['flags_added'])}")
        size = ladder.diff_size(scripts[old], scripts[new])
        if size != entry["diff_size"]:
            failures.append(f"{old} -> {new}: diff is +{size[0]} -{size[1]} lines, the manifest records "
                            f"+{entry['diff_size'][0]} -{entry['diff_size'][1]}: review the growth and update it")
    # A region shared by two scripts must be identical unless a step between them declares a change.
    for i, first in enumerate(ladder.LADDER):
        for later in ladder.LADDER[i + 1:]:
            between = ladder.LADDER[i + 1:ladder.LADDER.index(later) + 1]
            for name in parsed[first].keys() & parsed[later].keys():
                declared = any(name in MANIFEST[s]["regions"] for s in between)
                if not declared and ladder.normalize(parsed[first][name]) != ladder.normalize(parsed[later][name]):
                    detail = ladder.region_diff(name, parsed[first][name], parsed[later][name], first, later)
                    failures.append(f"shared region {name!r} differs between {first} and {later}: a fix applied "
                                    f"to one copy only?\n{detail}")
    return failures


def concept_failures(old, new, entry, parsed):
    """Every change carries a concept of its step, every concept has a change, no marker is stale."""
    failures, keys, served = [], {key for key, _, _ in entry["concepts"]}, set(entry["removed"].values())
    if any(name in entry["regions"] for name in SHOWN_AT_END):
        served.add("flags")  # the guided page's closing section: it shows these regions' changes
    for name, spec in entry["regions"].items():
        if name not in parsed[new]:
            continue  # reported above as a declared change that did not happen
        old_lines, new_lines = parsed[old].get(name, []), parsed[new][name]
        tagged, stale = ladder.tag_chunks(old_lines, new_lines, spec)
        for concept, chunk in tagged:
            if concept is None:
                text = "\n".join(ladder.chunk_text(old_lines, new_lines, chunk))
                failures.append(f"{old} -> {new}: a change in region {name!r} matches no marker of the "
                                f"manifest; tag it with a concept:\n{text}")
            elif concept not in keys:
                failures.append(f"{old} -> {new}: region {name!r} is tagged with {concept!r}, which is not "
                                f"one of the step's concepts {sorted(keys)}")
            served.add(concept)
        for marker in stale:
            failures.append(f"{old} -> {new}: marker {marker!r} of region {name!r} tags no change: remove it")
    for key in sorted(keys - served):
        failures.append(f"{old} -> {new}: concept {key!r} has no change")
    return failures


# --- the guard itself must catch each of these edits, applied to a temporary copy -----------------

def mutated_copy(tmp_path, script, old, new):
    for name in ladder.LADDER:
        (tmp_path / name).write_text(ladder.read(name))
    text = (tmp_path / script).read_text()
    assert text.count(old) >= 1, f"mutation target not found in {script}: {old!r}"
    (tmp_path / script).write_text(text.replace(old, new, 1))
    return tmp_path


GUARD_MUTATIONS = {
    "a fix to a shared region in one script only": (
        "ddp_basic.py", "for p in model.parameters()) / 1e6", "for p in model.parameters()) / 1e6 + 0",
        "shared region 'describe' differs between single_gpu.py and ddp_basic.py"),
    "a renamed flag": ("ddp_amp_accum.py", '"--batch-size"', '"--batch"', "flag --batch-size disappeared"),
    "a changed default": ("ddp_basic.py", 'default=1.0,', 'default=2.0,', "flag --warmup-epochs changed"),
    "a stray print in an undeclared region": (
        "ddp_amp_accum.py", '    return TensorDataset(0.4 * patterns[labels] + noise, labels)',
        '    print("debug", noise.shape)\n    return TensorDataset(0.4 * patterns[labels] + noise, labels)',
        "region 'make_synthetic'"),
    "a changed comment": ("ddp_amp_accum.py", "# Page-locked host memory", "# Pinned host memory",
                          "region 'build_loaders'"),
}


@pytest.mark.parametrize("mutation", sorted(GUARD_MUTATIONS))
def test_guard_fails_readably_on(mutation, tmp_path):
    script, old, new, expected = GUARD_MUTATIONS[mutation]
    failures = guard_failures(mutated_copy(tmp_path, script, old, new))
    assert failures, f"the guard missed {mutation}"
    assert any(expected in f for f in failures), "\n".join(failures)


def test_guard_ignores_whitespace_only_changes(tmp_path):
    root = mutated_copy(tmp_path, "ddp_basic.py", "def build_model(args, num_outputs):\n",
                        "def build_model(args,  num_outputs):\n\n\n")
    failures = [f for f in guard_failures(root) if "diff is" not in f]  # raw line counts do change
    assert not failures, "\n".join(failures)


def test_generated_diffs_and_pitfall_guide_are_current():
    sys.path.insert(0, str(ROOT / "tools"))
    import make_diffs

    stale = [relative for relative, content in make_diffs.generated(ROOT).items()
             if not (ROOT / relative).exists() or (ROOT / relative).read_text() != content]
    assert not stale, f"out of date: {stale}; run `python tools/make_diffs.py` and commit the result"


def test_every_pitfall_fix_line_and_guard_exists():
    sys.path.insert(0, str(ROOT / "tools"))
    from pitfalls import PITFALLS

    test_names = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        test_names[f"tests/{path.name}"] = path.read_text()
    for pitfall in PITFALLS:
        for script, anchor in pitfall["fix"]:
            assert sum(anchor in line for line in ladder.read(script, ROOT).splitlines()) == 1, (script, anchor)
        script, old, new = pitfall["mutation"]
        # Exactly once: the mutation check replaces the first occurrence, which must be the fix.
        assert ladder.read(script, ROOT).count(old) == 1, (pitfall["title"], old)
        for guard in pitfall["guards"]:
            file, name = guard.split("::")
            # A guard may name one case of a parametrized test: test[id].
            assert f"def {name.split('[')[0]}(" in test_names[file], guard


def test_readme_shows_the_recorded_diff_sizes_in_ladder_order():
    readme = (ROOT / "README.md").read_text()
    positions = []
    for index, (old, new) in enumerate(ladder.STEPS, 1):
        added, removed = MANIFEST[new]["diff_size"]
        row = f"| +{added} / −{removed} |"
        link = f"docs/diffs/{index}-{old.removesuffix('.py')}-to-{new.removesuffix('.py')}.diff"
        assert link in readme and row in readme.split(link, 1)[1].splitlines()[0], (link, row)
        positions.append(readme.index(link))
    assert positions == sorted(positions)


def test_readme_shows_the_lean_copies_diff_sizes_beside_the_whole_scripts():
    # What a learner reads: `diff lean/A lean/B`, counted as the whole scripts' diffs are.
    readme = (ROOT / "README.md").read_text()
    for index, (old, new) in enumerate(ladder.STEPS, 1):
        added, removed = MANIFEST[new]["diff_size"]
        lean = ladder.diff_size(*((ROOT / "lean" / name).read_text() for name in (old, new)))
        link = f"docs/diffs/{index}-{old.removesuffix('.py')}-to-{new.removesuffix('.py')}.diff"
        row = readme.split(link, 1)[1].splitlines()[0]
        assert row.endswith(f"| +{added} / −{removed} | +{lean[0]} / −{lean[1]} |"), (link, row, lean)


def test_neighbouring_scripts_differ_only_where_the_manifest_declares():
    failures = guard_failures()
    assert not failures, "\n\n".join(failures)
