"""A guided page (tools/make_diffs.py) is read in one pass: each section uses only names that
earlier sections or steps introduce, shows a handful of regions and the whole code of its
concept's mechanism, and nothing twice; the README states each page's size."""
import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402
import make_diffs  # noqa: E402
from ladder_manifest import FRAME, MANIFEST  # noqa: E402

GUIDED = [(index, old, new) for index, (old, new) in enumerate(ladder.STEPS, 1)
          if len([key for key, _, _ in MANIFEST[new]["concepts"] if key not in FRAME]) > 1]
STEP_IDS = [new for _, _, new in GUIDED]


def page(index, old, new):
    return make_diffs.guided_page(index, old, new, ROOT)


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_no_section_uses_a_name_that_a_later_section_introduces(index, old, new):
    assert make_diffs.forward_references(old, new, ROOT) == []


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_name_declared_ahead_is_used_ahead_and_the_page_says_where_from(index, old, new):
    sections = make_diffs.guided_sections(old, new, ROOT)
    used = {(name, sections[later]["key"]) for _, _, name, later in make_diffs.forward_uses(old, new, ROOT)}
    text = page(index, old, new)
    for name, key in MANIFEST[new].get("ahead", {}).items():
        assert (name, key) in used, f"{name!r} is declared ahead but no section uses it before {key!r}"
        assert re.search(rf"<code>{name}</code> from <a href=\"#{key}\">", text), name


def test_a_forward_use_is_found_when_a_section_reads_what_a_later_one_defines(monkeypatch):
    concepts = MANIFEST["ddp_full.py"]["concepts"]
    state_last = [c for c in concepts if c[0] != "state"] + [c for c in concepts if c[0] == "state"]
    monkeypatch.setitem(MANIFEST["ddp_full.py"], "concepts", state_last)
    found = make_diffs.forward_references("ddp_amp_accum.py", "ddp_full.py", ROOT)
    assert ("Writing checkpoints", "PER_PROCESS_STATE", "Where the run stands: TrainState") in \
        {(section, name, later) for section, _, name, later in found}, found


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_no_section_shows_more_than_eight_regions(index, old, new):
    for section in make_diffs.guided_sections(old, new, ROOT):
        assert len(section["regions"]) <= 8, (section["title"], [r[0] for r in section["regions"]])


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_concept_of_the_step_has_a_section_with_its_changes(index, old, new):
    sections = make_diffs.guided_sections(old, new, ROOT)
    assert [s["key"] for s in sections] == [key for key, _, _ in MANIFEST[new]["concepts"]]
    assert all(section["regions"] for section in sections), [s["key"] for s in sections if not s["regions"]]


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_each_region_of_imports_and_flags_is_shown_in_one_section_only(index, old, new):
    sections = make_diffs.guided_sections(old, new, ROOT)
    for region in ("imports", "parse_args"):
        shown_in = [s["key"] for s in sections if any(name == region for name, _, _ in s["regions"])]
        assert len(shown_in) <= 1, (region, shown_in)


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_no_line_is_shown_in_two_sections(index, old, new):
    seen = {}
    for section in make_diffs.guided_sections(old, new, ROOT):
        for region, _, rows in section["regions"]:
            for cls, number, _ in rows:
                if cls in ("add", "ctx"):
                    assert seen.setdefault(number, section["key"]) == section["key"], (region, number)


def test_the_write_checkpoints_rest_on_is_shown_where_they_are_taught():
    # atomic_save enters step 1 as a temporary file and a rename; step 5 flushes it to the disk and
    # leaves no temporary file behind: its change is the checkpoint section's.
    sections = make_diffs.guided_sections("ddp_amp_accum.py", "ddp_full.py", ROOT)
    checkpoint = next(s for s in sections if s["key"] == "checkpoint")
    assert "atomic_save" in [region for region, _, _ in checkpoint["regions"]]


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_mechanism_the_manifest_names_is_shown_whole_in_its_concepts_section(index, old, new):
    # A reader must be able to write a concept from its section: folded to its docstring, the
    # resumable sampler or the sharding plan could not be (two fresh readers, issue 26).
    new_text = ladder.read(new, ROOT)
    regions, starts = ladder.regions(new_text), ladder.region_starts(new_text)
    old_regions = ladder.regions(ladder.read(old, ROOT))
    sections = {s["key"]: s for s in make_diffs.guided_sections(old, new, ROOT)}
    for name in MANIFEST[new].get("mechanisms", ()):
        assert name in regions and name not in old_regions, f"{name} is not a new region of {new}"
        key = MANIFEST[new]["regions"][name]
        assert key not in FRAME, f"{name} serves the frame section {key!r}, not a concept"
        shown = [rows for region, kind, rows in sections[key]["regions"] if region == name and kind == "added"]
        assert shown, f"{name} is not shown in the section {key!r}"
        numbers = {number for cls, number, _ in shown[0] if cls == "add"}
        body = {starts[name] + k + 1 for k, line in enumerate(regions[name]) if line.strip()}
        assert body <= numbers, f"{name}: lines {sorted(body - numbers)} left out"


def test_a_new_definition_that_only_serves_bookkeeping_is_folded_to_its_docstring():
    # release_device_meshes (teardown of DTensor's caches) is no part of sharding a model.
    sections = make_diffs.guided_sections("ddp_full.py", "fsdp.py", ROOT)
    shard = next(s for s in sections if s["key"] == "shard")
    rows = next(rows for region, _, rows in shard["regions"] if region == "release_device_meshes")
    assert rows[-1][2].startswith("\u22ef the body: lines "), rows[-1]


def test_readme_states_the_text_size_of_every_guided_page():
    readme = (ROOT / "README.md").read_text()
    for index, old, new in GUIDED:
        name = make_diffs.diff_name(index, old, new)
        row = next(line for line in readme.splitlines() if f"({'docs/diffs/' + name}.guided.html)" in line)
        size = make_diffs.text_size(page(index, old, new))
        assert f"{size:,} characters" in row, (name, size, row)


def test_a_removed_marker_gives_the_removed_statement_its_own_concept():
    old = ["x = 1", "# only rank 0 works", "if rank != 0:", "    pass", "y = 2"]
    new = ["x = 1", "z = 3", "y = 2"]
    tagged, stale = ladder.tag_chunks(old, new, [("removed:rank != 0", "validation"), ("z =", "resume")])
    assert stale == []
    assert [(concept, ladder.chunk_text(old, new, chunk)) for concept, chunk in tagged] == [
        ("validation", ["-# only rank 0 works", "-if rank != 0:", "-    pass"]),
        ("resume", ["+z = 3"]),
    ]


def test_names_are_read_in_the_scope_of_their_function():
    names = ladder.line_names("def f(a):\n    b = a + c\n    return b\n")
    assert names[2] == ({("f", "b")}, {("f", "a"), (None, "c")})
