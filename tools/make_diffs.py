"""Write the ladder's reading material into docs/: run `python tools/make_diffs.py` after any change.

    docs/diffs/<n>-<old>-to-<new>.diff         unified diff of neighbouring scripts (the host renders it)
    docs/diffs/<n>-<old>-to-<new>.html         the same side by side, one self-contained page (offline)
    docs/diffs/<n>-<old>-to-<new>.guided.md    for a step with several concepts: the change in brief,
                                               then one section per concept, in teaching order, with
                                               only its changes (Markdown: GitHub renders it)
    docs/diffs/<n>-<old>-to-<new>.guided.html  the same page as HTML, with edited words marked (offline)
    docs/pitfalls.md                           the pitfall guide, each fix linked to its current line
    lean/<script>                              each script with its optional parts deleted
                                               (tools/strip_optional.py)
    docs/hardening/<script stem>[-N].md        each script's optional parts, one section per part in
                                               its map's order: what deleting it gives up, then its lines
    docs/hardening/README.md                   the index of those pages

tests/test_ladder_diffs.py fails when these files differ from what this tool would write now.
Standard library only.
"""
import ast
import atexit
import difflib
import functools
import html
import io
import itertools
import re
import shutil
import sys
import tempfile
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402
from ladder_manifest import (BRIEF, CHANGES_ROUNDING, FRAME, KEEP_FOR, MANIFEST, NEEDED_WHEN,  # noqa: E402
                             SHOWN_AT_END, SHOWN_AT_TOP)
from pitfalls import PITFALLS  # noqa: E402
from strip_optional import MAP, strip, tagged_lines  # noqa: E402

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
p.uses {font-size: 13px; color: #444}
h3 {font-size: 14px; margin: 1.1em 0 .3em; font-weight: normal}
h3 code {font-weight: bold}
pre {font-size: 12px; line-height: 1.35; background: #fafafa; border: 1px solid #ddd; padding: .4em 0;
     margin: .2em 0; overflow-x: auto}
pre span {display: block; padding: 0 .6em; white-space: pre}
.add {background: #e6ffec} .del {background: #ffebe9; color: #555} .ctx {color: #666}
.gap {color: #999} .mod {background: #fff8c5}
del {background: #ffc1c0; text-decoration: line-through} ins {background: #abf2bc; text-decoration: none}
"""
MARKS = {"add": "+", "del": "-", "mod": "~", "ctx": " ", "gap": " "}
# A removed line that an added one keeps this much of (difflib's ratio) is shown as that line,
# edited: the words it lost struck through, the words it gained marked.
EDITED = 0.7
# Unchanged lines shown above each change, to place it: none, the line number does.
CONTEXT = 0
# A new function or class that carries a concept (the manifest's "mechanisms") is shown whole: it is
# the code a reader must see to write the concept. One that only serves bookkeeping, if its body
# runs longer than this, is shown by its signature, docstring and (a function's) comments, with the
# line range of the rest in the script.
FOLD_LINES = 4


def gap(number, left_out):
    """The row that stands for lines left out, up to line `number` of the new script: the number
    shown where more than a few are."""
    return ("gap", "", f"\u22ef line {number}" if left_out > 3 else "\u22ef")


def folded(lines, start, whole=False):
    """The rows of an added region: all of it (always, if `whole`), or, for a def or class whose
    body runs over FOLD_LINES lines, the lines through its docstring and a row that says where
    the rest is."""
    node = ast.parse("\n".join(lines)).body[-1]
    rows = [("add", start + k + 1, line) for k, line in enumerate(lines)]
    if whole or not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return without_blank_rows(rows)
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    shown = first.end_lineno if docstring else first.lineno - 1
    if len(lines) - shown <= FOLD_LINES:
        return without_blank_rows(rows)
    # A function's comments say why its body does what it does: they stay, each where it stands.
    kept = without_blank_rows(rows[:shown])
    for k in range(shown, len(lines)):
        if isinstance(node, ast.FunctionDef) and lines[k].strip().startswith("#"):
            if kept[-1][0] != "add" or kept[-1][1] != start + k:
                kept.append(("gap", "", "\u22ef"))
            kept.append(rows[k])
    rest = f"\u22ef the body: lines {start + shown + 1}-{start + len(lines)}"
    if kept[-1][0] == "gap":
        kept.pop()
    return kept + [("gap", "", rest)]


def docstring_rows(rows, lines, start):
    """A docstring's rows on a guided page: the new title and launch commands (its first two
    paragraphs) whole, their unchanged lines as context, not the old step's; the prose after them
    sums up the sections below, and the last row says where to read it."""
    blank = [k for k, line in enumerate(lines) if not line.strip()]
    end = start + (blank[1] if len(blank) > 1 else len(lines))  # the last line of paragraph two
    added = {row[1] for row in rows if row[0] == "add"}
    kept = without_blank_rows([("add" if start + k + 1 in added else "ctx", start + k + 1, line)
                               for k, line in enumerate(lines) if start + k + 1 <= end])
    if any(row[0] == "add" and row[1] > end for row in rows):
        kept.append(("gap", "", f"\u22ef lines {end + 2}-{start + len(lines)}: the step in brief"))
    return kept


def opening_lines(lines):
    """{index of a line inside a statement begun above it: the index of that statement's first
    line}, for the continuation lines of a statement and the clauses (except, else, finally) of a
    compound one, the innermost statement's; a function or class is no such statement."""
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return {}
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        children = [child for field in ("body", "orelse", "finalbody") for child in getattr(node, field, [])]
        children += [child for handler in getattr(node, "handlers", []) for child in handler.body]
        inside = {k for child in children for k in range(child.lineno - 1, child.end_lineno)}
        for k in range(node.lineno, node.end_lineno):
            if k not in inside and lines[k].strip() and not lines[k].strip().startswith("#"):
                found[k] = node.lineno - 1
    return found


def region_rows(old_lines, new_lines, chunks, new_start, old_start):
    """The rows of one region in one section, as (class, line number, text): its chunks, each
    below up to CONTEXT unchanged lines. Lines that other sections add or remove are never shown
    here, not even as context: a gap row, with the line number of what follows it, stands for
    whatever is left out."""
    unchanged = ladder.unchanged_lines(old_lines, new_lines)
    # Unchanged lines a step indents anew (into a block it opens): shown after the chunk before them.
    moved = {k for k, o in unchanged.items() if new_lines[k].strip() and
             len(new_lines[k]) - len(new_lines[k].lstrip()) != len(old_lines[o]) - len(old_lines[o].lstrip())}
    rows, shown = [], -1  # shown: the index in new_lines of the last line shown, or passed over

    openers = opening_lines(new_lines)
    for (i1, i2), (j1, j2) in chunks:
        # A chunk begun inside a statement shows where that statement begins (try: above finally:).
        opener = openers.get(j1)
        if opener is not None and opener in unchanged and opener > shown:
            if rows and any(k not in unchanged or new_lines[k].strip() for k in range(shown + 1, opener)):
                rows.append(gap(new_start + opener + 1, opener - shown - 1))
            rows.append(("ctx", new_start + opener + 1, new_lines[opener]))
            shown = opener
        first = j1
        while first > shown + 1 and first - 1 in unchanged and j1 - first < CONTEXT:
            first -= 1
        skipped = range(shown + 1, first)
        if rows and any(k not in unchanged or new_lines[k].strip() for k in skipped):
            rows.append(gap(new_start + first + 1, len(skipped)))
        rows += [("ctx", new_start + k + 1, new_lines[k]) for k in range(first, j1)]
        rows += [("del", old_start + k + 1, old_lines[k]) for k in range(i1, i2)]
        rows += [("add", new_start + k + 1, new_lines[k]) for k in range(j1, j2)]
        shown = max(shown, j2 - 1)
        while shown + 1 in moved:
            shown += 1
            rows.append(("ctx", new_start + shown + 1, new_lines[shown]))
    return without_blank_rows(rows)


def without_blank_rows(rows):
    """The rows without blank lines of context, nor blank lines first or last."""
    kept = [row for row in rows if row[2].strip() or row[0] in ("add", "del")]
    while kept and not kept[-1][2].strip():
        kept.pop()
    while kept and not kept[0][2].strip():
        kept.pop(0)
    return kept


def guided_sections(old, new, root):
    """The sections of a step's guided page, in teaching order: one per concept of the manifest,
    each a dict with its key, title, why, the regions it shows [(name, kind, rows)], the lines of
    the new script it adds (`added`) and `uses`: the functions and classes its added lines call
    that earlier steps wrote and this one leaves unchanged, each named once, where first used.

    The changes of the regions in SHOWN_AT_TOP (the docstring, the imports) all go to the top
    section and those of SHOWN_AT_END (flags and their checks) to the closing one, whatever concept
    each serves: shown once, not again in every section."""
    entry = MANIFEST[new]
    old_text, new_text = ladder.read(old, root), ladder.read(new, root)
    old_regions, new_regions = ladder.regions(old_text), ladder.regions(new_text)
    old_starts, new_starts = ladder.region_starts(old_text), ladder.region_starts(new_text)
    keys = [key for key, _, _ in entry["concepts"]]
    sections = [{"key": key, "title": title, "why": why, "regions": [], "added": [], "uses": []}
                for key, title, why in entry["concepts"]]
    by_key = {section["key"]: section for section in sections}
    for name in new_regions:  # file order
        if name not in entry["regions"]:
            continue
        old_lines, new_lines = old_regions.get(name, []), new_regions[name]
        tagged, _ = ladder.tag_chunks(old_lines, new_lines, entry["regions"][name])
        for frame, shown in (("top", SHOWN_AT_TOP), ("flags", SHOWN_AT_END)):
            if name in shown and frame in by_key:
                tagged = [(frame, chunk) for _, chunk in tagged]
        for key in keys:
            chunks = [chunk for concept, chunk in tagged if concept == key]
            if not chunks:
                continue
            if name in old_regions:
                rows = region_rows(old_lines, new_lines, chunks, new_starts[name], old_starts[name])
                if name == "docstring":
                    rows = docstring_rows(rows, new_lines, new_starts[name])
                by_key[key]["regions"].append((name, "changed", rows))
                by_key[key]["added"] += [number for cls, number, _ in rows if cls == "add"]
            else:  # a whole new region: one concept's, all its lines added (folded or not)
                whole = name in entry.get("mechanisms", ())
                by_key[key]["regions"].append((name, "added", folded(new_lines, new_starts[name], whole)))
                by_key[key]["added"] += [new_starts[name] + k + 1 for k in range(len(new_lines))]
    for name, key in entry["removed"].items():
        if name not in old_regions or name in new_regions:
            continue  # an optional part, not in the lean scripts
        rows = without_blank_rows([("del", old_starts[name] + k + 1, line)
                                   for k, line in enumerate(old_regions[name])])
        by_key[key]["regions"].append((name, "removed", rows))
    # What this step's code leans on from earlier steps without changing it: named where first used.
    old_tree = ast.parse(old_text)
    earlier = {node.name for node in old_tree.body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in entry["regions"]}
    names, starts, named = ladder.line_names(new_text), ladder.region_starts(new_text), set()
    for section in [s for s in sections if s["key"] not in FRAME]:
        read = [name for line in section["added"] for scope, name in sorted(names.get(line, ((), ()))[1], key=str)
                if scope is None]
        for name in dict.fromkeys(read):
            if name in earlier and name in starts and name not in named:
                named.add(name)
                section["uses"].append((name, definition_line(new_text, name)))
    # A concept made of optional parts alone changes no lean script: its page is the hardening page.
    return [section for section in sections if section["regions"]]


def definition_line(text, name):
    """The line of the top-level `def` or `class` called name."""
    return next(node.lineno for node in ast.parse(text).body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name)


def forward_uses(old, new, root=ladder.ROOT):
    """[(section index, line, name, index of the later section that introduces it)]: each name an
    added line of a section reads that neither an earlier step nor this section or an earlier
    one binds (in the same function, or at module level)."""
    sections = guided_sections(old, new, root)
    names = ladder.line_names(ladder.read(new, root))
    earlier = set().union(*(bound for bound, _ in ladder.line_names(ladder.read(old, root)).values()))
    introduced = {}
    for index, section in enumerate(sections):
        for line in section["added"]:
            for key in names.get(line, ((), ()))[0]:
                introduced.setdefault(key, index)
    found = []
    for index, section in enumerate(sections):
        for line in section["added"]:
            for scope, name in sorted(names.get(line, ((), ()))[1], key=str):
                later = introduced.get((scope, name), index)
                if (scope, name) not in earlier and later > index:
                    found.append((index, line, name, later))
    return found


def forward_references(old, new, root=ladder.ROOT):
    """[(section title, line, name, title of the later section that introduces it)]: the forward
    uses that the manifest's "ahead" does not declare, so the page cannot say where they are from."""
    sections = guided_sections(old, new, root)
    ahead = MANIFEST[new].get("ahead", {})
    return [(sections[index]["title"], line, name, sections[later]["title"])
            for index, line, name, later in forward_uses(old, new, root)
            if ahead.get(name) != sections[later]["key"]]


def changed_lines(rows):
    """The rows with each removed line that an added line of the same chunk edits (most of it
    kept) folded into that line, as a "mod" row whose text is (old line, new line)."""
    out, k = [], 0
    while k < len(rows):
        if rows[k][0] != "del":
            out.append(rows[k])
            k += 1
            continue
        removed = [row for row in itertools.takewhile(lambda row: row[0] == "del", rows[k:])]
        k += len(removed)
        added = [row for row in itertools.takewhile(lambda row: row[0] == "add", rows[k:])]
        k += len(added)
        pairs, at = [], 0  # (index in removed, index in added) of each edited line, in order
        for i, row in enumerate(removed):
            for j in range(at, len(added)):
                if difflib.SequenceMatcher(None, row[2].strip(), added[j][2].strip()).ratio() >= EDITED:
                    pairs.append((i, j))
                    at = j + 1
                    break
        done_removed = done_added = 0
        for i, j in pairs + [(len(removed), len(added))]:
            out += removed[done_removed:i] + added[done_added:j]
            if i < len(removed):
                out.append(("mod", added[j][1], (removed[i][2], added[j][2])))
            done_removed, done_added = i + 1, j + 1
    return out


def word_diff(old_line, new_line):
    """The new line in HTML, its words that replace old ones marked, the old ones struck through."""
    tokens = re.compile(r"\w+|\s+|[^\w\s]")
    a, b = tokens.findall(old_line.strip()), tokens.findall(new_line.strip())
    out = [html.escape(new_line[:len(new_line) - len(new_line.lstrip())])]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            out.append(f"<del>{html.escape(''.join(a[i1:i2]))}</del>")
        if tag in ("insert", "replace"):
            out.append(f"<ins>{html.escape(''.join(b[j1:j2]))}</ins>")
        if tag == "equal":
            out.append(html.escape("".join(b[j1:j2])))
    return "".join(out)


def render_rows(rows):
    """One region's rows as a <pre>. Excerpts lose the indentation they all share: the heading
    says where they stand."""
    rows = changed_lines(rows)
    texts = [line[1] if cls == "mod" else line for cls, _, line in rows if cls != "gap"]
    indent = min((len(t) - len(t.lstrip()) for t in texts if t.strip()), default=0)
    spans = []
    for cls, _, line in rows:
        if cls == "gap":
            text = html.escape(line)
        elif cls == "mod":
            text = word_diff(line[0], line[1])[indent:]
        else:
            text = html.escape(line[indent:])
        spans.append(f"<span class=\"{cls}\">{MARKS[cls]} {text}</span>")
    return "<pre>" + "".join(spans) + "</pre>"


def where(rows, old, new):
    """Where a region's rows stand: the first line of the new script they show, else the first
    removed line of the old one."""
    for cls, number, line in rows:
        if cls in ("add", "ctx"):
            return f"line {number}"
        if line.startswith("\u22ef line"):
            return line.removeprefix("\u22ef ")
    return f"{old} line {rows[0][1]}"


def guided_page(index, old, new, root):
    """One section per concept of the step, in teaching order, with only that concept's changes."""
    name = diff_name(index, old, new)
    sections = guided_sections(old, new, root)
    title = f"Step {index} &rarr; {index + 1}: {old} &rarr; {new}, one concept at a time"
    out = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>",
           f"<style>{GUIDED_STYLE}</style></head><body>", f"<h1>{title}</h1>",
           f"<p>The lesson of the step: the scripts without their optional parts (lean/). Read the sections "
           f"in order: each says why, then shows only its own changes to "
           f"<code>lean/{new}</code> (green added, red removed, yellow edited; \u22ef: lines left out, "
           f"with the line that follows), using names that earlier sections or steps introduce; a name used "
           f"before its own section says where it comes from. The whole "
           f"diff: <a href=\"{name}.diff\">unified</a>, <a href=\"{name}.html\">side by side</a>.</p>",
           "<nav>"]
    out += [f"<a href=\"#{s['key']}\">{html.escape(s['title'])}</a>" for s in sections]
    out.append("</nav>")
    out += brief_html(new, root, {s["key"]: s["title"] for s in sections})
    forward, declared = forward_uses(old, new, root), MANIFEST[new].get("ahead", {})
    for number, section in enumerate(sections):
        out += [f"<h2 id=\"{section['key']}\">{html.escape(section['title'])}</h2>",
                f"<p class=\"why\">{html.escape(section['why'])}</p>"]
        for note in MANIFEST[new].get("notes", {}).get(section["key"], []):
            out.append(f"<p><img src=\"{note[0]}\" alt=\"{html.escape(note[1])}\" style=\"max-width:100%\"></p>"
                       if isinstance(note, tuple) else f"<p class=\"why\">{inline_html(note)}</p>")
        ahead = dict.fromkeys((name, later) for index, _, name, later in forward
                              if index == number and declared.get(name) == sections[later]["key"])
        if ahead:
            later_ones = list(dict.fromkeys(later for _, later in ahead))
            notes = "; ".join(", ".join(f"<code>{html.escape(name)}</code>" for name, at in ahead if at == later) +
                              f" from <a href=\"#{sections[later]['key']}\">{html.escape(sections[later]['title'])}</a>"
                              for later in later_ones)
            out.append(f"<p class=\"uses\">From later sections: {notes}.</p>")
        if section["uses"]:
            links = ", ".join(f"<a href=\"../../lean/{new}\"><code>{html.escape(used)}</code></a> (line {line})"
                              for used, line in section["uses"])
            out.append(f"<p class=\"uses\">From earlier steps: {links}</p>")
        for region, kind, rows in section["regions"]:
            label = "the imports" if region == "imports" else "the docstring" if region == "docstring" else \
                f"<code>{html.escape(region)}</code>"
            out.append(f"<h3>{label}, {where(rows, old, new)}{'' if kind == 'changed' else f' ({kind})'}</h3>")
            out.append(render_rows(rows))
    out.append("</body></html>\n")
    return "\n".join(out)


# --- the change in brief --------------------------------------------------------------------------

def picked_statement(tree, lines, anchor):
    """(first, last) line numbers of the statement an anchor picks: the one line that holds its text
    (within one top-level function or class, for an anchor (name, text)); a simple statement whole,
    a compound one by its header, or whole where the text starts with "*"."""
    scope, text = anchor if isinstance(anchor, tuple) else (None, anchor)
    whole = text.startswith("*")
    text = text.removeprefix("*")
    first, last = 1, len(lines)
    if scope is not None:
        node = next(n for n in tree.body if getattr(n, "name", None) == scope)
        first, last = node.lineno, node.end_lineno
    found = [k for k in range(first, last + 1) if text in lines[k - 1]]
    if len(found) != 1:
        raise SystemExit(f"brief anchor {anchor!r} found {len(found)} times: make it unique")
    starts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == found[0]]
    if not starts:
        raise SystemExit(f"brief anchor {anchor!r} is not on a statement's first line")
    node = max(starts, key=lambda n: n.end_lineno)  # the outermost statement starting there
    body = getattr(node, "body", None)
    if whole or not body or isinstance(node, ast.ClassDef):
        return node.lineno, node.end_lineno
    return node.lineno, body[0].lineno - 1


def anchor_found(tree, lines, anchor):
    """Whether a brief anchor is on some line (of its function, for a (function, text) anchor)."""
    scope, text = anchor if isinstance(anchor, tuple) else (None, anchor)
    if scope is not None:
        node = next((n for n in tree.body if getattr(n, "name", None) == scope), None)
        return node is not None and any(text.removeprefix("*") in line
                                        for line in lines[node.lineno - 1:node.end_lineno])
    return any(text.removeprefix("*") in line for line in lines)


def enclosing(tree, number):
    """The name of the top-level function (or class.method) that holds line `number`."""
    for node in tree.body:
        if node.lineno <= number <= node.end_lineno and isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for inner in getattr(node, "body", []):
                if isinstance(inner, ast.FunctionDef) and inner.lineno <= number <= inner.end_lineno:
                    return f"{node.name}.{inner.name}"
            return node.name
    return None


def without_tags(line):
    """A line without a copier's-map tag at its end (the sections say what is optional)."""
    return re.sub(r"\s+# \[optional[^\]]*\]\s*$", "", line)


def brief(new, root):
    """The change in brief of a step: [(concept key, [(function, [(line number or None, text)])])],
    the statements BRIEF names, each concept's in file order, grouped by the function that holds
    them, without comment lines, dedented to the group's indentation; "..." (number None) stands
    for lines left out between two statements of one function."""
    text = ladder.read(new, root)
    tree, lines = ast.parse(text), text.splitlines()
    blocks = []
    for key, anchors in BRIEF[new]:
        if not any(anchor_found(tree, lines, anchor) for anchor in anchors):
            continue  # an optional part's concept: not in a lean script
        numbers = set()
        for anchor in anchors:
            first, last = picked_statement(tree, lines, anchor)
            numbers.update(range(first, last + 1))
        numbers = [k for k in sorted(numbers) if lines[k - 1].strip() and not lines[k - 1].strip().startswith("#")]
        groups = []
        for number in numbers:
            function = enclosing(tree, number)
            if not groups or groups[-1][0] != function:
                groups.append((function, []))
            groups[-1][1].append(number)
        block = []
        for function, group in groups:
            indent = min(len(lines[k - 1]) - len(lines[k - 1].lstrip()) for k in group)
            rows = []
            for k, number in enumerate(group):
                between = range(group[k - 1] + 1, number) if k else ()
                if any(lines[j - 1].strip() and not lines[j - 1].strip().startswith("#") for j in between):
                    here = lines[number - 1]
                    rows.append((None, " " * (len(here) - len(here.lstrip()) - indent) + "..."))
                rows.append((number, without_tags(lines[number - 1])[indent:]))
            block.append((function, rows))
        blocks.append((key, block))
    return blocks


def brief_size(blocks):
    """The lines of code a brief shows ("..." rows not counted)."""
    return sum(1 for _, block in blocks for _, rows in block for number, _ in rows if number is not None)


def script_constant(script, name, root):
    """The value of a top-level constant of a script (a tuple of strings, say)."""
    for node in ast.parse(ladder.read(script, root)).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise SystemExit(f"{script} has no constant {name}")


def flag_list(names):
    return ", ".join(f"`--{name.replace('_', '-')}`" for name in names)


def resume_note(root):
    """In Markdown: when a resume of ddp_full.py ends bitwise equal to a run never stopped, with the
    settings a resume may change read from the script (RESUME_MAY_CHANGE, RESUME_MAY_CHANGE_TASK)."""
    may_change = script_constant("ddp_full.py", "RESUME_MAY_CHANGE", root)
    task = script_constant("ddp_full.py", "RESUME_MAY_CHANGE_TASK", root)
    how = [name for name in may_change if name not in CHANGES_ROUNDING]
    has_constant = "--lr-schedule" in ladder.flags(ladder.read("ddp_full.py", root))
    constant = "; `--epochs` under `--lr-schedule constant`" if has_constant else ""
    rounding = [name for name in may_change if name in CHANGES_ROUNDING]
    return (f"**When a resume is bitwise.** A run stopped and resumed ends bitwise equal to one never "
            f"stopped when it resumes on as many processes, with the same settings but those that say how "
            f"the run goes on ({flag_list(how)}; the section's `RESUME_MAY_CHANGE_TASK`: {flag_list(task)}"
            f"{constant}), and its arithmetic is repeatable: on a CPU the "
            f"same thread count; on GPUs deterministic kernels as well (`--no-cudnn-benchmark`, "
            f"`torch.use_deterministic_algorithms(True)`, `CUBLAS_WORKSPACE_CONFIG=:4096:8`: "
            f"[Determinism](../clusters.md#running-on-a-cluster)), without which two runs never stopped "
            f"differ too. `RESUME_MAY_CHANGE` also lets a resume change {flag_list(rounding)}: they change "
            f"the rounding (the kernels chosen, the order of a sum), so a resume that changes one ends equal "
            f"to rounding, not bitwise. Any other difference is refused in one line, and so is a training "
            f"set of another size: the data may move, not change.")


def github_slug(heading):
    """GitHub's anchor of a heading: lowercased, punctuation but - and _ removed, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def kept_lines(old, new, root):
    """The line numbers of the new script that its region has as the old script had it."""
    old_text, new_text = ladder.read(old, root), ladder.read(new, root)
    old_regions, new_regions = ladder.regions(old_text), ladder.regions(new_text)
    starts = ladder.region_starts(new_text)
    return {starts[name] + k + 1 for name, lines in new_regions.items() if name in old_regions
            for k in ladder.unchanged_lines(old_regions[name], lines)}


def without_comment(text):
    """A line of code without its trailing comment (a line that does not tokenize alone, whole)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return text
    comment = [token for token in tokens if token.type == tokenize.COMMENT]
    return text[:len(text) - len(text.lstrip())] + text.strip()[:comment[0].start[1]].rstrip() \
        if comment else text


def brief_markdown(old, new, root, anchors, titles):
    """The change in brief, in Markdown: a code block per concept, under a link to its section; a
    statement the step leaves as it was, shown to place the new ones, says so."""
    out = ["## The change in brief", "",
           "The lines you would write to port this step, by concept, without their comments; each "
           "heading links the section that shows the functions they call whole. `...`: lines left out; "
           "`# as before`: a kept line that places the new ones.", ""]
    kept, lines = kept_lines(old, new, root), ladder.read(new, root).splitlines()
    starts = ladder.statement_starts(lines)
    for key, block in brief(new, root):
        out += [f"**[{titles[key]}](#{anchors[key]})**", "", "```python"]
        for function, rows in block:
            if len(block) > 1:
                out.append(f"# in {function}()" if function else "# at the top of the file")
            for k, (number, text) in enumerate(rows):
                # A statement's last line shown says whether all of it is as before.
                statement = [number]
                while statement[0] is not None and statement[0] - 1 not in starts:
                    statement.insert(0, statement[0] - 1)
                last = k + 1 == len(rows) or rows[k + 1][0] is None or rows[k + 1][0] - 1 in starts
                old_line = number is not None and last and all(n in kept for n in statement)
                out.append(f"{without_comment(text)}  # as before" if old_line else text)
        out += ["```", ""]
    if new == "ddp_full.py":
        out += [resume_note(root), ""]
    return out


def diff_block(rows):
    """One region's rows as a ```diff block: + added, - removed (an edited line: its old and its
    new text), space unchanged, @@ for lines left out. Excerpts lose the indentation they all share."""
    rows = changed_lines(rows)
    texts = [line[1] if cls == "mod" else line for cls, _, line in rows if cls != "gap"]
    indent = min((len(t) - len(t.lstrip()) for t in texts if t.strip()), default=0)
    out = ["```diff"]
    for cls, _, line in rows:
        if cls == "gap":
            out.append(f"@@ {line.removeprefix(chr(0x22ef)).strip() or chr(0x22ef)} @@")
        elif cls == "mod":
            out += [f"-{line[0][indent:]}", f"+{line[1][indent:]}"]
        else:
            out.append(f"{MARKS[cls]}{line[indent:]}")
    return out + ["```"]


def markdown_where(rows, old, new):
    """Where a region's rows stand: (the lean script, the line) of the first line shown of the new
    script, else of the old one."""
    for cls, number, line in rows:
        if cls in ("add", "ctx"):
            return new, number
        if line.startswith("\u22ef line"):
            return new, line.removeprefix("\u22ef line ")
    return old, rows[0][1]


def guided_markdown(index, old, new, root):
    """The guided page in Markdown, as GitHub renders it: the change in brief, then one section per
    concept of the step, in teaching order, with only that concept's changes in ```diff blocks."""
    name = diff_name(index, old, new)
    sections = guided_sections(old, new, root)
    anchors = {s["key"]: github_slug(s["title"]) for s in sections}
    titles = {s["key"]: s["title"] for s in sections}
    stem = new.removesuffix(".py")
    out = [f"# Step {index} \u2192 {index + 1}: `{old}` \u2192 `{new}`, one concept at a time", "",
           f"What [`lean/{new}`](../../lean/{new}) adds to [`lean/{old}`](../../lean/{old}): the lesson, the "
           f"scripts without the parts [`{new}`](../../{new}) tags `# [optional: NAME]` (bad input, failures, "
           f"odd environments: [its hardening page](../hardening/{stem}.md)). The change in brief, then a "
           f"section per concept in teaching order, each with its why and only its own changes (`+` added, "
           f"`-` removed; `@@ line N @@`: lines left out, the next shown is line N of the lean script; "
           f"`@@ \u22ef @@` a few). The whole diff: [unified]({name}.diff); side by side, and this page with "
           f"edited words marked, as HTML: [{name}.html]({name}.html), [{name}.guided.html]({name}.guided.html).",
           ""]
    out += brief_markdown(old, new, root, anchors, titles)
    forward, declared = forward_uses(old, new, root), MANIFEST[new].get("ahead", {})
    for number, section in enumerate(sections):
        out += [f"## {section['title']}", "", section["why"], ""]
        for note in MANIFEST[new].get("notes", {}).get(section["key"], []):
            out += [f"![{note[1]}]({note[0]})" if isinstance(note, tuple) else note, ""]
        ahead = dict.fromkeys((name, later) for index_, _, name, later in forward
                              if index_ == number and declared.get(name) == sections[later]["key"])
        if ahead:
            # Grouped by the section that introduces them: each section's link once.
            later_ones = list(dict.fromkeys(later for _, later in ahead))
            notes = "; ".join(", ".join(f"`{name}`" for name, at in ahead if at == later) +
                              f" from [{sections[later]['title']}](#{anchors[sections[later]['key']]})"
                              for later in later_ones)
            out += [f"*From later sections:* {notes}.", ""]
        if section["uses"]:
            links = ", ".join(f"[`{used}`](../../lean/{new}#L{line})" for used, line in section["uses"])
            out += [f"*From earlier steps:* {links}.", ""]
        for region, kind, rows in section["regions"]:
            label = "The imports" if region == "imports" else "The docstring" if region == "docstring" else \
                f"`{region}`"
            script, number = markdown_where(rows, old, new)
            where = f"[{label}](../../lean/{script}#L{number})" if script == new else \
                f"{label}, [lean/{old} line {number}](../../lean/{old}#L{number})"
            out += [f"{where}{'' if kind == 'changed' else f' ({kind})'}:", ""]
            out += diff_block(rows) + [""]
    return "\n".join(out)


def brief_html(new, root, titles):
    """The change in brief, as HTML: a <pre> per concept under a link to its section."""
    out = ["<h2 id=\"brief\">The change in brief</h2>",
           "<p class=\"why\">The lines you would write to port this step into a script of your own, by "
           "concept, without their comments; <code>...</code> stands for lines left out.</p>"]
    for key, block in brief(new, root):
        places = ", ".join(f"<code>{html.escape(function or 'the imports')}</code> (line {rows[0][0] or rows[1][0]})"
                           for function, rows in block)
        out.append(f"<h3><a href=\"#{key}\">{html.escape(titles[key])}</a>, in {places}</h3>")
        lines = []
        for function, rows in block:
            if len(block) > 1:
                lines.append(f"# in {function}()" if function else "# at the top of the file")
            lines += [text for _, text in rows]
        out.append("<pre>" + "".join(f"<span class=\"ctx\">{html.escape(line)}</span>" for line in lines) + "</pre>")
    if new == "ddp_full.py":
        out.append(f"<p class=\"why\">{inline_html(resume_note(root))}</p>")
    return out


def inline_html(markdown):
    """A paragraph of Markdown as HTML: its bold, code and links (all the manifest's notes use)."""
    text = html.escape(markdown)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)
    return re.sub(r"\[(.+?)\]\((.+?)\)", r'<a href="\2">\1</a>', text)


def text_size(page):
    """The characters of text a page shows: its HTML without the style sheet and the tags."""
    page = re.sub(r"<style>.*?</style>", "", page, flags=re.S)
    return len(html.unescape(re.sub(r"<[^>]+>", "", page)))


def line_of(script, anchor, root):
    lines = ladder.read(script, root).splitlines()
    matches = [i + 1 for i, line in enumerate(lines) if anchor in line]
    if len(matches) != 1:
        raise SystemExit(f"pitfall anchor {anchor!r} found {len(matches)} times in {script}: make it unique")
    return matches[0]


def pitfalls_page(root):
    """docs/pitfalls.md: why the scripts are as they are (pitfalls.WHY), then every pitfall, numbered."""
    from pitfalls import WHY
    out = ["# Pitfalls the ladder fixes", "",
           "Generated by `tools/make_diffs.py` from `tools/pitfalls.py`; line links are current as of the last run.",
           "Each guard is a test that fails when the mistake is put back: `python tools/mutation_check.py`",
           "applies each mistake to a copy of the repository and runs its guard (results in",
           "[mutations.md](mutations.md)).", "",
           "## What the scripts get right, and why", "", WHY.rstrip("\n"), "",
           "## The pitfalls, one by one", ""]
    for number, p in enumerate(PITFALLS, 1):
        links = ", ".join(f"[`{s}` line {line_of(s, a, root)}](../{s}#L{line_of(s, a, root)})" for s, a in p["fix"])
        guards = ", ".join(f"`{t}`" for t in p["guards"])
        out += [f"### {number}. {p['title']}", "", f"- **Mistake:** {p['mistake']}", f"- **Symptom:** {p['symptom']}",
                f"- **Correct:** {p['correct']} — {links}", f"- **Guarded by:** {guards}", ""]
    return "\n".join(out)


# --- the hardening pages --------------------------------------------------------------------------

# A line of a copier's map: four spaces, the NAME (one or two words), two spaces or more, what it gives
# up; a line indented further goes on with the entry above.
MAP_ENTRY = re.compile(r"^    (\S+(?: \S+)?)  +(\S.*)$")


def copiers_map(text):
    """[(NAME, what deleting it gives up)] in the order of the script's map."""
    listing = ast.get_docstring(ast.parse(text)).split(MAP, 1)[1]
    entries = []
    for line in listing.splitlines():
        if match := MAP_ENTRY.match(line):
            entries.append([match.group(1), match.group(2)])
        elif entries and line.startswith("      ") and line.strip():
            entries[-1][1] += " " + line.strip()
    return [tuple(entry) for entry in entries]


def blocks(numbers):
    """Consecutive runs of line numbers, as (first, last)."""
    runs = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return [tuple(run) for run in runs]


PAGE_LIMIT = 30_000  # characters of a hardening page: past it, the parts go on to the next page


def hardening_sections(script, root):
    """[(NAME, its section's Markdown lines)] of the script's optional parts, in its map's order:
    the situation that needs the part, what deleting it gives up, then the lines it is made of."""
    text = ladder.read(script, root)
    lines, tree = text.splitlines(), ast.parse(text)
    docstring_end = tree.body[0].end_lineno
    sections = []
    for name, gives_up in copiers_map(text):
        out = [f"## {name}", "", f"**You need it** {NEEDED_WHEN[name]}. Deleting it gives up: {gives_up}.", ""]
        for first, last in blocks(tagged_lines(text, {name})):
            shown = lines[first - 1:last]
            while shown and not shown[-1].strip():
                shown.pop()
                last -= 1
            code = next((n for n in range(first, last + 1) if not lines[n - 1].lstrip().startswith("#")), first)
            holder = enclosing(tree, code)
            starts = holder and any(node.lineno == code and getattr(node, "name", "") == holder for node in tree.body)
            where = "the docstring" if last <= docstring_end else f"`{holder}`, whole" if starts else \
                f"in `{holder}`" if holder else "module level"
            span, anchor = (f"line {first}", f"L{first}") if first == last else \
                (f"lines {first}-{last}", f"L{first}-L{last}")
            out += [f"[{span}](../../{script}#{anchor}), {where}:", "", "```python"]
            indent = min(len(line) - len(line.lstrip()) for line in shown if line.strip())
            out += [line[indent:] for line in shown] + ["```", ""]
        sections.append((name, out))
    return sections


def hardening_pages(script, root):
    """{docs/hardening/<stem>.md: text, and <stem>-2.md ... where the parts pass PAGE_LIMIT}: the
    first page opens on every part's situation, each linked to its section wherever it stands."""
    stem, sections = script.removesuffix(".py"), hardening_sections(script, root)
    pages, size = [[]], 0
    for name, out in sections:  # consecutive parts, a page each while they fit (the first holds the index)
        length = len("\n".join(out)) + 1
        if pages[-1] and size + length > PAGE_LIMIT - (6_000 if len(pages) == 1 else 1_000):
            pages.append([])
            size = 0
        pages[-1].append((name, out))
        size += length
    names = [f"{stem}.md" if number == 0 else f"{stem}-{number + 1}.md" for number in range(len(pages))]
    where = {name: names[number] for number, page in enumerate(pages) for name, _ in page}
    head = [f"# `{script}`: its hardening, part by part", "",
            f"Each part that [`{script}`](../../{script}) tags `# [optional: NAME]`, in the order of its copier's "
            f"map: when you need it, what deleting it gives up, then the lines it is made of, each run linked to "
            f"where it stands. The lesson without them is [`lean/{script}`](../../lean/{script}), which the "
            f"guided pages teach; `python tools/strip_optional.py {script} --keep NAME ...` keeps the parts you "
            f"name ([which to keep](README.md)).", ""]
    head += [f"{number}. [{name}]({'' if where[name] == names[0] else where[name]}#{github_slug(name)}): "
             f"{NEEDED_WHEN[name]}" for number, (name, _) in enumerate(sections, 1)]
    files = {}
    for number, page in enumerate(pages):
        out = head + [""] if number == 0 else [
            f"# `{script}`: its hardening, page {number + 1} of {len(pages)}", "",
            f"The parts of [`{script}`](../../{script}) from {page[0][0]} to {page[-1][0]}; every part and when "
            f"you need it: [the first page]({names[0]}).", ""]
        files[f"docs/hardening/{names[number]}"] = "\n".join(out + [line for _, lines in page for line in lines])
    return files


def hardening_page(script, root):
    """The script's hardening pages as one text (what they show, for the tests)."""
    return "\n".join(hardening_pages(script, root).values())


def hardening_index(root):
    out = ["# The hardening pages", "",
           "What each script adds to its lesson (its copy in `lean/`) for bad input, failures and odd "
           "environments: `# [optional: NAME]` parts, which a lean copy leaves out. Start from a lean copy, "
           "or from the whole script less the parts your runs do not need:", "",
           "| if you … | start from | and keep |", "| --- | --- | --- |"]
    for situation, script, keep in KEEP_FOR:
        names = " ".join(f'"{name}"' if " " in name else name for name in keep)
        out.append(f"| {situation} | [`{script}`]({script.removesuffix('.py')}.md) | "
                   f"`python tools/strip_optional.py {script} --keep {names} > my_trainer.py` |")
    out += ["", "Combine rows by naming every part they keep; a part that \"goes with\" another (its section "
            "says so) needs that one kept too. Each page, part by part, with the situation that needs it:", ""]
    for script in ladder.LADDER:
        names = ", ".join(name for name, _ in copiers_map(ladder.read(script, root)))
        out.append(f"- [`{script}`]({script.removesuffix('.py')}.md): {names}")
    return "\n".join(out + [""])


@functools.lru_cache(maxsize=None)
def lesson_root(root=ladder.ROOT):
    """A temporary directory holding each script of root as lean/ has it (its optional parts
    deleted): the guided pages teach the lesson from these, the lean neighbours."""
    lean = Path(tempfile.mkdtemp(prefix="ladder-lean-"))
    atexit.register(shutil.rmtree, lean, True)  # gone with the process that made it
    for script in ladder.LADDER:
        (lean / script).write_text(strip(ladder.read(script, root)))
    return lean


def generated(root=ladder.ROOT):
    """{path relative to root: content} of every generated file."""
    files = {}
    for index, (old, new) in enumerate(ladder.STEPS, 1):
        name = diff_name(index, old, new)
        files[f"docs/diffs/{name}.diff"] = unified(old, new, root)
        files[f"docs/diffs/{name}.html"] = side_by_side(index, old, new, root, ladder.CONCEPTS[new])
        if len([key for key, _, _ in MANIFEST[new]["concepts"] if key not in FRAME]) > 1:
            files[f"docs/diffs/{name}.guided.md"] = guided_markdown(index, old, new, lesson_root(root))
            files[f"docs/diffs/{name}.guided.html"] = guided_page(index, old, new, lesson_root(root))
    files["docs/pitfalls.md"] = pitfalls_page(root)
    for script in ladder.LADDER:
        files[f"lean/{script}"] = strip(ladder.read(script, root))
        files.update(hardening_pages(script, root))
    files["docs/hardening/README.md"] = hardening_index(root)
    return files


if __name__ == "__main__":
    for relative, content in generated().items():
        path = ladder.ROOT / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"wrote {relative}")
