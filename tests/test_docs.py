"""The documentation holds together: a short front page, links that resolve, a complete flags table.

Read from the files only: no script is launched.
"""
import re
import sys

from conftest import ROOT
from test_static import SCRIPTS

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402

# The pages the front page hands its reader on to; each must be linked from README.md.
MOVED_PAGES = ["docs/flags.md", "docs/checkpoints.md", "docs/clusters.md", "docs/fsdp.md", "docs/benchmarks.md",
               "docs/your-task.md", "docs/pitfalls.md", "docs/troubleshooting.md", "tests/README.md"]


def pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "diffs").glob("*.md")),
            *sorted((ROOT / "docs" / "hardening").glob("*.md")), ROOT / "tests" / "README.md"]


def prose(text):
    """The text outside fenced code blocks, with inline code spans kept (link texts hold them)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def link_targets(text):
    """Every target of a markdown link or image, reference definition or <img src> in the prose."""
    text = prose(text)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    references = re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)
    images = re.findall(r"<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']", text)
    return inline + references + images


def slug(heading):
    """GitHub's anchor of a heading: lowercased, punctuation but - and _ removed, spaces to -."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    """The anchors of a page's headings, with GitHub's -1, -2 suffixes for repeated ones."""
    seen, found = {}, set()
    for line in prose(text).splitlines():
        heading = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page):
    broken = []
    for target in link_targets(page.read_text()):
        if re.match(r"(https?:|mailto:)", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            broken.append(f"{target}: no file {file}")
        elif anchor and re.fullmatch(r"L\d+", anchor) and file.suffix == ".py":
            lines = len(file.read_text().splitlines())
            if int(anchor[1:]) > lines:
                broken.append(f"{target}: {file.name} has {lines} lines")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
        elif anchor and file.suffix not in (".md", ".py"):
            broken.append(f"{target}: an anchor into a {file.suffix} file cannot be checked here")
    return broken


def script_flags():
    """{--flag: scripts}: every option string of every script, aliases and --no- forms included."""
    found = {}
    for script in SCRIPTS:
        for name, flag in ladder.flags(ladder.read(script, ROOT)).items():
            names = [name, *flag["aliases"]]
            if flag["action"] and "BooleanOptionalAction" in flag["action"]:
                names.append("--no-" + name.removeprefix("--"))
            for option in names:
                found.setdefault(option, []).append(script)
    return found


def flags_table_flags():
    """The flags named in the first column of docs/flags.md's table."""
    named = set()
    for line in (ROOT / "docs" / "flags.md").read_text().splitlines():
        if line.startswith("| `--"):
            named |= set(re.findall(r"`(--[\w-]+)`", line.split("|")[1]))
    return named


def test_readme_front_page_is_at_most_8000_characters():
    # The limit for a front page a new user reads whole; everything longer lives in the pages it links.
    size = len((ROOT / "README.md").read_text())
    assert size <= 8_000, f"README.md has {size} characters"


def test_troubleshooting_is_at_most_26000_characters():
    # One page an engineer whose first multi-node job misbehaves reads through: a topic more
    # displaces words, it does not add pages.
    assert len((ROOT / "docs" / "troubleshooting.md").read_text()) <= 26_000


def test_readme_opens_on_the_move_from_one_gpu_to_many():
    # In its first 2,000 characters (the issue's): the three launch commands, the per-process batch
    # and the learning rate, where to start reading, and where to look when several nodes fail.
    opening = (ROOT / "README.md").read_text()[:2000]
    for needed in ("python single_gpu.py", "torchrun --standalone --nproc_per_node=4 ddp_full.py", "--nnodes=N",
                   "`--batch-size` is per process", "`--lr` is used as given",
                   "(docs/diffs/2-dataparallel-to-ddp_basic.guided.md)", "(docs/troubleshooting.md)"):
        assert needed in opening, needed


def test_readme_says_on_its_first_screen_that_no_gpu_has_run_it_and_the_quickstart_follows():
    # Before the Quickstart, within the first 3,000 characters: the fact a GPU user must know first
    # and the one command that checks a GPU.
    text = (ROOT / "README.md").read_text()
    quickstart = text.index("## Quickstart")
    assert quickstart <= 3000, quickstart
    for needed in ("No GPU has run the ladder yet", "python bench/gpu_check.py runs/gpu_check"):
        assert needed in text[:quickstart], needed


def test_every_relative_link_resolves():
    broken = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in pages()}
    broken = {page: links for page, links in broken.items() if links}
    assert not broken, broken


def test_flags_page_names_every_flag_of_every_script_and_no_other():
    in_scripts, in_table = script_flags(), flags_table_flags()
    assert not set(in_scripts) - in_table, {flag: in_scripts[flag] for flag in set(in_scripts) - in_table}
    assert not in_table - set(in_scripts), sorted(in_table - set(in_scripts))


def test_readme_links_every_moved_page():
    linked = {target.partition("#")[0] for target in link_targets((ROOT / "README.md").read_text())}
    assert not set(MOVED_PAGES) - linked, sorted(set(MOVED_PAGES) - linked)


def test_flags_page_says_which_scripts_have_each_flag_as_their_parsers_do():
    # "all", "3–6" or "5 (not 6: ...)": steps of the ladder, 1 to 6, read from the table's third column.
    in_scripts = script_flags()
    for line in (ROOT / "docs" / "flags.md").read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [cell.strip() for cell in line.split("|")]
        flag, where = re.search(r"`(--[\w-]+)`", cells[1]).group(1), cells[3]
        if where == "all":
            steps = range(1, len(SCRIPTS) + 1)
        else:
            first, last = re.match(r"(\d)(?:–(\d))?", where).groups()
            steps = range(int(first), int(last or first) + 1)
        assert sorted(in_scripts[flag]) == sorted(SCRIPTS[step - 1] for step in steps), (flag, where)
