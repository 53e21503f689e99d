"""Write the ladder's reading material into docs/: run `python tools/make_diffs.py` after any change.

    docs/diffs/<n>-<old>-to-<new>.diff         unified diff of neighbouring scripts (the host renders it)
    docs/diffs/<n>-<old>-to-<new>.html         the same side by side, one self-contained page (offline)
    docs/diffs/<n>-<old>-to-<new>.guided.html  for a step with several concepts: one section per
                                               concept, in teaching order, with only its changes
    docs/pitfalls.md                           the pitfall guide, each fix linked to its current line

tests/test_ladder_diffs.py fails when these files differ from what this tool would write now.
Standard library only.
"""
import difflib
import html
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402
from ladder_manifest import MANIFEST  # noqa: E402
from pitfalls import PITFALLS  # noqa: E402

# Two 100-column scripts side by side, with line numbers, fit a 1600-pixel-wide window at 11 px.
WRAP_COLUMN = 100


def diff_name(index, old, new):
    return f"{index}-{old.removesuffix('.py')}-to-{new.removesuffix('.py')}"


def unified(old, new, root):
    return "".join(difflib.unified_diff(ladder.read(old, root).splitlines(keepends=True),
                                        ladder.read(new, root).splitlines(keepends=True), f"a/{old}", f"b/{new}"))


def side_by_side(index, old, new, root, concept):
    html_page = difflib.HtmlDiff(tabsize=4, wrapcolumn=WRAP_COLUMN).make_file(
        ladder.read(old, root).splitlines(), ladder.read(new, root).splitlines(), old, new, context=True,
        numlines=6)
    title = f"Step {index} &rarr; {index + 1}: {old} &rarr; {new} ({concept})"
    html_page = html_page.replace("<title></title>", f"<title>{title}</title>")
    html_page = html_page.replace("</style>", "        table.diff {font-size:11px}\n    </style>", 1)
    return html_page.replace("<body>", f"<body>\n<h2 style=\"font-family:sans-serif\">{title}</h2>", 1)


GUIDED_STYLE = """
body {font-family: sans-serif; max-width: 1500px; margin: 1em auto; padding: 0 1em; color: #222}
nav a {margin-right: 1.2em}
h2 {border-top: 2px solid #ccc; padding-top: .6em; margin-top: 1.6em}
p.why {font-size: 15px; max-width: 60em; line-height: 1.45}
h3 {font-size: 14px; margin: 1.1em 0 .3em; font-weight: normal}
h3 code {font-weight: bold}
pre {font-size: 12px; line-height: 1.35; background: #fafafa; border: 1px solid #ddd; padding: .4em 0;
     margin: .2em 0; overflow-x: auto}
pre span {display: block; padding: 0 .6em; white-space: pre}
.add {background: #e6ffec} .del {background: #ffebe9; color: #555} .ctx {color: #666}
.n {color: #999; display: inline-block; width: 4.5em; user-select: none}
"""


def guided_blocks(old_lines, new_lines, chunks, new_start, old_start, context=2):
    """Display blocks for the chunks of one region: nearby chunks share one block, with context."""
    blocks = []
    for chunk in chunks:
        (i1, i2), (j1, j2) = chunk
        if blocks and j1 - blocks[-1]["j2"] <= 2 * context and i1 - blocks[-1]["i2"] <= 2 * context:
            blocks[-1]["chunks"].append(chunk)
            blocks[-1]["i2"], blocks[-1]["j2"] = i2, j2
        else:
            blocks.append({"chunks": [chunk], "i2": i2, "j2": j2})
    rendered = []
    for block in blocks:
        rows = []
        (i1, _), (j1, _) = block["chunks"][0]
        for k in range(max(0, j1 - context), j1):
            rows.append(("ctx", new_start + k + 1, new_lines[k]))
        for n, ((a1, a2), (b1, b2)) in enumerate(block["chunks"]):
            if n:  # the unchanged lines between two chunks of one block
                previous_end = block["chunks"][n - 1][1][1]
                rows += [("ctx", new_start + k + 1, new_lines[k]) for k in range(previous_end, b1)]
            rows += [("del", old_start + k + 1, old_lines[k]) for k in range(a1, a2)]
            rows += [("add", new_start + k + 1, new_lines[k]) for k in range(b1, b2)]
        for k in range(block["j2"], min(len(new_lines), block["j2"] + context)):
            rows.append(("ctx", new_start + k + 1, new_lines[k]))
        rendered.append(rows)
    return rendered


def guided_page(index, old, new, root):
    """One section per concept of the step, in teaching order, with only that concept's changes."""
    entry = MANIFEST[new]
    old_text, new_text = ladder.read(old, root), ladder.read(new, root)
    old_regions, new_regions = ladder.regions(old_text), ladder.regions(new_text)
    old_starts, new_starts = ladder.region_starts(old_text), ladder.region_starts(new_text)
    by_concept = {key: [] for key, _, _ in entry["concepts"]}
    for name in new_regions:  # file order
        if name not in entry["regions"]:
            continue
        old_lines, new_lines = old_regions.get(name, []), new_regions[name]
        tagged, _ = ladder.tag_chunks(old_lines, new_lines, entry["regions"][name])
        for key in by_concept:
            chunks = [chunk for concept, chunk in tagged if concept == key]
            if chunks:
                blocks = guided_blocks(old_lines, new_lines, chunks, new_starts[name], old_starts.get(name, 0))
                by_concept[key].append((name, "added" if name not in old_regions else "changed", blocks))
    for name, key in entry["removed"].items():
        lines = old_regions[name]
        rows = [("del", old_starts[name] + k + 1, line) for k, line in enumerate(lines)]
        by_concept[key].append((name, "removed", [rows]))
    name = diff_name(index, old, new)
    title = f"Step {index} &rarr; {index + 1}: {old} &rarr; {new}, one concept at a time"
    out = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>",
           f"<style>{GUIDED_STYLE}</style></head><body>", f"<h1>{title}</h1>",
           f"<p>The diff of <code>{old}</code> and <code>{new}</code>, cut into its concepts and read in "
           f"teaching order: each section explains why, then shows only the changes that serve it (green: "
           f"added, red: removed, grey: unchanged context, with line numbers of the two files). The whole "
           f"diff: <a href=\"{name}.diff\">unified</a>, <a href=\"{name}.html\">side by side</a>. Which "
           f"change serves which concept is declared in <code>tools/ladder_manifest.py</code>, and the "
           f"diff guard fails when a change has none.</p>", "<nav>"]
    out += [f"<a href=\"#{key}\">{html.escape(title_)}</a>" for key, title_, _ in entry["concepts"]]
    out.append("</nav>")
    for key, concept_title, why in entry["concepts"]:
        out += [f"<h2 id=\"{key}\">{html.escape(concept_title)}</h2>", f"<p class=\"why\">{html.escape(why)}</p>"]
        for region, kind, blocks in by_concept[key]:
            label = "the imports" if region == "imports" else "the docstring" if region == "docstring" else \
                f"<code>{html.escape(region)}</code>"
            out.append(f"<h3>{label} ({kind})</h3>")
            for rows in blocks:
                out.append("<pre>" + "".join(
                    f"<span class=\"{cls}\"><span class=\"n\">{number}</span>"
                    f"{'+' if cls == 'add' else '-' if cls == 'del' else ' '} {html.escape(line)}</span>"
                    for cls, number, line in rows) + "</pre>")
    out.append("</body></html>\n")
    return "\n".join(out)


def line_of(script, anchor, root):
    lines = ladder.read(script, root).splitlines()
    matches = [i + 1 for i, line in enumerate(lines) if anchor in line]
    if len(matches) != 1:
        raise SystemExit(f"pitfall anchor {anchor!r} found {len(matches)} times in {script}: make it unique")
    return matches[0]


def pitfalls_page(root):
    out = ["# Pitfalls the ladder fixes", "",
           "Generated by `tools/make_diffs.py` from `tools/pitfalls.py`; line links are current as of the last run.",
           "Each guard is a test that fails when the mistake is put back: `python tools/mutation_check.py`",
           "applies each mistake to a copy of the repository and runs its guard (results in",
           "[mutations.md](mutations.md)).", ""]
    for number, p in enumerate(PITFALLS, 1):
        links = ", ".join(f"[`{s}` line {line_of(s, a, root)}](../{s}#L{line_of(s, a, root)})" for s, a in p["fix"])
        guards = ", ".join(f"`{t}`" for t in p["guards"])
        out += [f"## {number}. {p['title']}", "", f"- **Mistake:** {p['mistake']}", f"- **Symptom:** {p['symptom']}",
                f"- **Correct:** {p['correct']} — {links}", f"- **Guarded by:** {guards}", ""]
    return "\n".join(out)


def generated(root=ladder.ROOT):
    """{path relative to root: content} of every generated file."""
    files = {}
    for index, (old, new) in enumerate(ladder.STEPS, 1):
        name = diff_name(index, old, new)
        files[f"docs/diffs/{name}.diff"] = unified(old, new, root)
        files[f"docs/diffs/{name}.html"] = side_by_side(index, old, new, root, ladder.CONCEPTS[new])
        if len([key for key, _, _ in MANIFEST[new]["concepts"] if key != "top"]) > 1:
            files[f"docs/diffs/{name}.guided.html"] = guided_page(index, old, new, root)
    files["docs/pitfalls.md"] = pitfalls_page(root)
    return files


if __name__ == "__main__":
    for relative, content in generated().items():
        path = ladder.ROOT / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"wrote {relative}")
