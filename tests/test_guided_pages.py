"""A guided page (tools/make_diffs.py) is read in one pass: it opens with the change in brief, the
lines a reader writes to port the step, each under a link to its section; each section uses only
names that earlier sections or steps introduce, shows a handful of regions and the whole code of its
concept's mechanism, and nothing twice. The Markdown page (what GitHub shows) holds all of it, and
renders as written; the README states each page's size. A page teaches the lesson: the diff of the
lean neighbours (LESSON: the scripts with their optional parts deleted, as lean/ holds them)."""
import functools
import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402
import make_diffs  # noqa: E402
from ladder_manifest import BRIEF, CHANGES_ROUNDING, FRAME, MANIFEST  # noqa: E402

GUIDED = [(index, old, new) for index, (old, new) in enumerate(ladder.STEPS, 1)
          if len([key for key, _, _ in MANIFEST[new]["concepts"] if key not in FRAME]) > 1]
STEP_IDS = [new for _, _, new in GUIDED]
LESSON = make_diffs.lesson_root(ROOT)


# Made once per step and process: the tests that change the manifest call make_diffs themselves.
@functools.cache
def page(index, old, new):
    return make_diffs.guided_page(index, old, new, LESSON)


@functools.cache
def markdown_page(index, old, new):
    return make_diffs.guided_markdown(index, old, new, LESSON)


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_no_section_uses_a_name_that_a_later_section_introduces(index, old, new):
    assert make_diffs.forward_references(old, new, LESSON) == []


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_name_declared_ahead_is_used_ahead_and_the_page_says_where_from(index, old, new):
    sections = make_diffs.guided_sections(old, new, LESSON)
    used = {(name, sections[later]["key"]) for _, _, name, later in make_diffs.forward_uses(old, new, LESSON)}
    text = page(index, old, new)
    defined = ladder.line_names(ladder.read(new, LESSON))
    defined = {name for bound, _ in defined.values() for _, name in bound}
    for name, key in MANIFEST[new].get("ahead", {}).items():
        if name not in defined:
            continue  # an optional part's: not in the lesson
        assert (name, key) in used, f"{name!r} is declared ahead but no section uses it before {key!r}"
        # Names introduced by one section are listed together before its link.
        assert re.search(rf"<code>{name}</code>(, <code>\w+</code>)* from <a href=\"#{key}\">", text), name


def test_a_forward_use_is_found_when_a_section_reads_what_a_later_one_defines(monkeypatch):
    concepts = MANIFEST["ddp_full.py"]["concepts"]
    state_last = [c for c in concepts if c[0] != "state"] + [c for c in concepts if c[0] == "state"]
    monkeypatch.setitem(MANIFEST["ddp_full.py"], "concepts", state_last)
    found = make_diffs.forward_references("ddp_amp_accum.py", "ddp_full.py", LESSON)
    assert ("Writing checkpoints", "PER_PROCESS_STATE", "Where the run stands: TrainState") in \
        {(section, name, later) for section, _, name, later in found}, found


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_no_section_shows_more_than_eight_regions(index, old, new):
    for section in make_diffs.guided_sections(old, new, LESSON):
        assert len(section["regions"]) <= 8, (section["title"], [r[0] for r in section["regions"]])


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_concept_of_the_step_has_a_section_with_its_changes(index, old, new):
    # On the full scripts every concept changes something; on the lean ones, those that are not made
    # of optional parts alone, each in its place.
    full = [s["key"] for s in make_diffs.guided_sections(old, new, ROOT)]
    assert full == [key for key, _, _ in MANIFEST[new]["concepts"]]
    lesson = [s["key"] for s in make_diffs.guided_sections(old, new, LESSON)]
    assert lesson == [key for key in full if key in lesson] and len(lesson) >= 3, lesson


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_anchor_of_the_brief_picks_one_statement_of_the_whole_script(index, old, new):
    # The lean brief leaves out the concepts of optional parts; on the whole script every anchor counts.
    assert [key for key, _ in make_diffs.brief(new, ROOT)] == [key for key, _ in BRIEF[new]]


def test_the_lines_a_new_block_takes_in_are_shown_under_it():
    # Unchanged but for their indentation, they would be left out as unchanged: a fresh reader of the
    # 2 -> 3 page could not tell which lines of the epoch went under rank 0's `if` (issue 44).
    sections = make_diffs.guided_sections("dataparallel.py", "ddp_basic.py", LESSON)
    rank0 = next(s for s in sections if s["key"] == "rank0")
    rows = next(rows for region, _, rows in rank0["regions"] if region == "train")
    shown = [(cls, text.strip()) for cls, _, text in rows]
    opened = shown.index(("add", "if rank == 0:"))
    assert ("ctx", "history.append(record)") in shown[opened:], shown


def test_a_change_inside_a_statement_shows_the_line_that_begins_it():
    # A help text changed alone read as no flag's (5 -> 6), and `finally:` came without its `try:`,
    # which a fresh reader of the 2 -> 3 page guessed (issue 44).
    def shown(old, new, key, region):
        section = next(s for s in make_diffs.guided_sections(old, new, LESSON) if s["key"] == key)
        rows = next(rows for name, _, rows in section["regions"] if name == region)
        return [(cls, text.strip()) for cls, _, text in rows]

    flags = shown("ddp_full.py", "fsdp.py", "flags", "parse_args")
    amp = next(k for k, (cls, text) in enumerate(flags) if text.startswith('parser.add_argument("--amp"'))
    assert flags[amp][0] == "ctx" and flags[amp + 1][1].startswith("help="), flags
    group = shown("dataparallel.py", "ddp_basic.py", "group", "main")
    assert group.index(("ctx", "try:")) < group.index(("add", "finally:")), group


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_each_region_of_imports_and_flags_is_shown_in_one_section_only(index, old, new):
    sections = make_diffs.guided_sections(old, new, LESSON)
    for region in ("imports", "parse_args"):
        shown_in = [s["key"] for s in sections if any(name == region for name, _, _ in s["regions"])]
        assert len(shown_in) <= 1, (region, shown_in)


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_no_line_is_shown_in_two_sections(index, old, new):
    seen = {}
    for section in make_diffs.guided_sections(old, new, LESSON):
        for region, _, rows in section["regions"]:
            for cls, number, _ in rows:
                if cls in ("add", "ctx"):
                    assert seen.setdefault(number, section["key"]) == section["key"], (region, number)


def test_the_write_checkpoints_rest_on_is_shown_where_they_are_taught():
    # save_file enters step 1; step 5 makes the folder it writes checkpoints into: its change is the
    # checkpoint section's (writing aside and renaming is the hardening page's atomic writes).
    sections = make_diffs.guided_sections("ddp_amp_accum.py", "ddp_full.py", LESSON)
    checkpoint = next(s for s in sections if s["key"] == "checkpoint")
    assert "save_file" in [region for region, _, _ in checkpoint["regions"]]


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_mechanism_the_manifest_names_is_shown_whole_in_its_concepts_section(index, old, new):
    # A reader must be able to write a concept from its section: folded to its docstring, the
    # resumable sampler or the sharding plan could not be (two fresh readers, issue 26).
    new_text = ladder.read(new, LESSON)
    regions, starts = ladder.regions(new_text), ladder.region_starts(new_text)
    old_regions = ladder.regions(ladder.read(old, LESSON))
    full = ladder.regions(ladder.read(new, ROOT))
    sections = {s["key"]: s for s in make_diffs.guided_sections(old, new, LESSON)}
    for name in MANIFEST[new].get("mechanisms", ()):
        if name not in regions and name in full:
            continue  # an optional part's: its page is the hardening page
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
    sections = make_diffs.guided_sections("ddp_full.py", "fsdp.py", LESSON)
    shard = next(s for s in sections if s["key"] == "shard")
    rows = next(rows for region, _, rows in shard["regions"] if region == "release_device_meshes")
    assert rows[-1][2].startswith("\u22ef the body: lines "), rows[-1]


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_mechanism_is_shown_whole_on_the_markdown_page_too(index, old, new):
    # The Markdown page is the one GitHub shows: it must hold what the HTML page holds.
    text = markdown_page(index, old, new)
    regions = ladder.regions(ladder.read(new, LESSON))
    for name in MANIFEST[new].get("mechanisms", ()):
        for line in regions.get(name, []):
            if line.strip():
                assert f"\n+{line}\n" in text, (name, line)


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_the_markdown_page_renders_a_heading_per_section_and_a_diff_block_per_region(index, old, new):
    # Parsed as CommonMark (GitHub's Markdown is a superset): a fence left open or a line read as
    # markup would swallow or split the blocks that follow it.
    from markdown_it import MarkdownIt
    sections = make_diffs.guided_sections(old, new, LESSON)
    tokens = MarkdownIt("commonmark").parse(markdown_page(index, old, new))
    h2 = [tokens[k + 1].content for k, t in enumerate(tokens) if t.type == "heading_open" and t.tag == "h2"]
    assert h2 == ["The change in brief", *[s["title"] for s in sections]]
    fences = [t for t in tokens if t.type == "fence"]
    assert [t.info for t in fences if t.info == "diff"] == ["diff"] * sum(len(s["regions"]) for s in sections)
    assert len([t for t in fences if t.info == "python"]) == len(make_diffs.brief(new, LESSON))
    assert not [t for t in tokens if t.type in ("html_block", "html_inline")]


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_the_change_in_brief_is_20_to_40_lines_each_under_its_concepts_section(index, old, new):
    # The size for the lines a reader writes to port a step: enough to hold every concept's
    # core, few enough to read before the sections.
    blocks = make_diffs.brief(new, LESSON)
    assert 20 <= make_diffs.brief_size(blocks) <= 40, make_diffs.brief_size(blocks)
    concepts = [key for key, _, _ in MANIFEST[new]["concepts"] if key not in FRAME]
    assert [key for key, _ in blocks] == [key for key in concepts if key in dict(blocks)]
    numbers = [number for _, block in blocks for _, rows in block for number, _ in rows if number]
    assert len(numbers) == len(set(numbers)), "a line shown in two concepts' blocks"
    text = markdown_page(index, old, new)
    titles = {key: title for key, title, _ in MANIFEST[new]["concepts"]}
    for key, _ in blocks:
        assert f"**[{titles[key]}](#{make_diffs.github_slug(titles[key])})**" in text, key


def test_the_brief_marks_the_statements_a_step_keeps_as_before():
    # Two fresh readers could not tell the lines to add from those kept to place them (issue 44).
    lines = markdown_page(2, "dataparallel.py", "ddp_basic.py").splitlines()
    assert "set_seed(args.seed)  # as before" in lines and "set_seed(args.seed + rank)" in lines
    # The statement DDP wraps the model in, whole (its optional argument stripped): not "as before".
    assert "model = DDP(model," in lines
    assert '            device_ids=[local_rank] if device.type == "cuda" else None)  # its GPU; on CPU none' in lines


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_every_line_of_the_brief_is_the_scripts_own(index, old, new):
    # Generated from the script, not written beside it: a brief line is a line of the script without
    # its indentation (and a copier's-map tag); "..." stands for lines left out.
    script = ladder.read(new, LESSON).splitlines()
    for _, block in make_diffs.brief(new, LESSON):
        for _, rows in block:
            for number, text in rows:
                if number is not None:
                    assert make_diffs.without_tags(script[number - 1]).endswith(text) and text.strip(), text


def test_a_brief_anchor_found_on_two_lines_stops_the_generator(monkeypatch):
    monkeypatch.setitem(BRIEF, "ddp_basic.py", [("group", ['rank = int(os.environ.get("RANK", 0))'])])
    with pytest.raises(SystemExit, match="found 2 times"):
        make_diffs.brief("ddp_basic.py", LESSON)


def test_the_4_to_5_page_says_when_a_resume_is_bitwise_naming_every_setting_a_resume_may_change():
    assert set(CHANGES_ROUNDING) <= set(make_diffs.script_constant("ddp_full.py", "RESUME_MAY_CHANGE", ROOT))
    may_change = make_diffs.script_constant("ddp_full.py", "RESUME_MAY_CHANGE", LESSON)
    task = make_diffs.script_constant("ddp_full.py", "RESUME_MAY_CHANGE_TASK", LESSON)
    note = next(line for line in markdown_page(4, "ddp_amp_accum.py", "ddp_full.py").splitlines()
                if line.startswith("**When a resume is bitwise.**"))
    for name in (*may_change, *task):
        assert f"`--{name.replace('_', '-')}`" in note, name
    assert "use_deterministic_algorithms" in note and "CUBLAS_WORKSPACE_CONFIG" in note


def test_readme_states_the_size_of_every_markdown_guided_page():
    readme = (ROOT / "README.md").read_text()
    for index, old, new in GUIDED:
        name = make_diffs.diff_name(index, old, new)
        row = next(line for line in readme.splitlines() if line.startswith("|") and f"(docs/diffs/{name}.guided.md)" in line)
        size = len(markdown_page(index, old, new))
        assert f"{size // 1000} K characters" in row, (name, size, row)


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


def test_the_2_to_3_page_says_why_ddp_beats_dataparallel_shows_it_and_gives_the_learning_rate_rule():
    # The first thing every DataParallel -> DDP migration guide explains; a fresh reader missed it here.
    page = markdown_page(2, "dataparallel.py", "ddp_basic.py")
    why = next(line for line in page.splitlines() if line.startswith("**Why DDP, not DataParallel.**"))
    for needed in ("GIL", "copies the model", "scatters", "gathered on GPU 0", "in buckets while backward", "382"):
        assert needed in why, needed
    assert "](dp-vs-ddp.png)" in page and (ROOT / "docs" / "diffs" / "dp-vs-ddp.png").is_file()
    assert '"dp-vs-ddp.png"' in (ROOT / "tools" / "draw_dp_vs_ddp.py").read_text()  # drawn, not hand-made
    rule = next(line for line in page.splitlines() if line.startswith("**The learning rate.**"))
    assert "divide `--batch-size` by N" in rule and "linear scaling rule" in rule


# The issue "Two layers": a lesson page is read in one sitting, at most 30,000 characters.
PAGE_BUDGET = 30_000


@pytest.mark.parametrize("index, old, new", GUIDED, ids=STEP_IDS)
def test_a_lesson_page_keeps_to_its_size(index, old, new):
    size = len(markdown_page(index, old, new))
    assert size <= PAGE_BUDGET, size
