"""Read the ladder's scripts as named regions, and compare neighbours: the shared code of the
diff guard (tests/test_ladder_diffs.py) and of the generated diffs (tools/make_diffs.py).

A region is one top-level statement of a script together with the comments and blank lines above
it: "docstring", "imports" (all import statements), a function or class by its name, a constant by
its name, "__main__" for the `if __name__ == "__main__":` guard. Comparing regions ignores
whitespace (indentation, blank lines, spacing) but not comments: comments are content.
"""
import ast
import difflib
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LADDER = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py",
          "fsdp.py"]
STEPS = list(zip(LADDER, LADDER[1:]))
# What each step adds: the one concept its diff teaches.
CONCEPTS = {
    "dataparallel.py": "nn.DataParallel, and why not",
    "ddp_basic.py": "DistributedDataParallel under torchrun",
    "ddp_amp_accum.py": "mixed precision and gradient accumulation",
    "ddp_full.py": "exact validation, checkpoints, exact resume, clusters",
    "fsdp.py": "fully sharded data parallel (FSDP2): parameters, gradients and optimizer state sharded",
}


def region_name(node):
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return "docstring"
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return "imports"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):  # X += ... joins X's region
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return ",".join(ast.unparse(t) for t in targets)
    if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
        return "__main__"
    return f"statement@{node.lineno}"


def regions(text):
    """{name: [source lines]} in file order; the lines include the comments above the statement."""
    lines = text.splitlines()
    found, previous_end = {}, 0
    for node in ast.parse(text).body:
        name = region_name(node)
        found.setdefault(name, []).extend(lines[previous_end:node.end_lineno])
        previous_end = node.end_lineno
    if lines[previous_end:]:
        found.setdefault("tail", []).extend(lines[previous_end:])
    return found


def region_starts(text):
    """{name: index of the region's first line in the file} (for a name that occurs once)."""
    starts, previous_end = {}, 0
    for node in ast.parse(text).body:
        starts.setdefault(region_name(node), previous_end)
        previous_end = node.end_lineno
    return starts


def normalize(lines):
    """Whitespace does not count: drop blank lines, collapse runs of spaces (comments stay)."""
    return [" ".join(line.split()) for line in lines if line.strip()]


def region_diff(name, old_lines, new_lines, old_label, new_label):
    return "".join(difflib.unified_diff([l + "\n" for l in old_lines], [l + "\n" for l in new_lines],
                                        f"{old_label}:{name}", f"{new_label}:{name}", n=2))


def flags(text):
    """{--flag: default source} from the add_argument calls of parse_args."""
    tree = ast.parse(text)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            default = keywords.get("default", "False" if keywords.get("action") == "'store_true'" else "None")
            found[names[0]] = {"aliases": names[1:], "default": default, "type": keywords.get("type"),
                               "choices": keywords.get("choices"), "action": keywords.get("action")}
    return found


def diff_size(old_text, new_text):
    """(lines added, lines removed) in the unified diff of two scripts, as `diff -u` counts them."""
    added = removed = 0
    for line in difflib.unified_diff(old_text.splitlines(), new_text.splitlines(), lineterm="", n=3):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def step_changes(old_text, new_text):
    """What a step did to regions: ({changed}, {added}, {removed})."""
    old, new = regions(old_text), regions(new_text)
    changed = {n for n in old.keys() & new.keys() if normalize(old[n]) != normalize(new[n])}
    return changed, set(new) - set(old), set(old) - set(new)


SEAM = "# --- your data and model"


def replace_seam(text, seam):
    """The script with its section "your data and model" replaced by `seam` (a section of the same
    form: its own rule line first), the rest untouched; as a user who copies a script does."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(SEAM))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# --- "))
    return "\n".join(lines[:start] + seam.strip("\n").splitlines() + ["", ""] + lines[end:]) + "\n"


def read(name, root=ROOT):
    return (Path(root) / name).read_text()


def statement_starts(lines):
    """Indices of the lines that begin a statement (comment lines count as beginnings)."""
    starts, at_start = set(), True
    for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if token.type == tokenize.NEWLINE:
            at_start = True
        elif token.type == tokenize.COMMENT and token.line.strip().startswith("#"):
            starts.add(token.start[0] - 1)
        elif token.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT) and at_start:
            starts.add(token.start[0] - 1)
            at_start = False
    return starts


def line_matcher(old_lines, new_lines):
    """Matches the lines of two versions of a region; whitespace does not count."""
    return difflib.SequenceMatcher(None, [" ".join(l.split()) for l in old_lines],
                                   [" ".join(l.split()) for l in new_lines], autojunk=False)


def unchanged_lines(old_lines, new_lines):
    """{index in new_lines: index in old_lines} of the lines a step left as they were."""
    return {j1 + k: i1 + k for tag, i1, i2, j1, j2 in line_matcher(old_lines, new_lines).get_opcodes()
            if tag == "equal" for k in range(j2 - j1)}


def statement_ranges(lines, starts, first, last):
    """Lines [first, last) cut where a statement begins at no deeper a level than the first
    statement, comments going with the statement below them: [(start, end)]."""
    cuts, level = [first], None
    for k in range(first, last):
        indent = len(lines[k]) - len(lines[k].lstrip())
        after_comment = k > first and lines[k - 1].strip().startswith("#")
        if k in starts and k > first and not after_comment and (level is None or indent <= level):
            cuts.append(k)
            level = indent
        elif k in starts and level is None:
            level = indent
    return list(zip(cuts, cuts[1:] + [last]))


def change_chunks(old_lines, new_lines):
    """The changes between two versions of a region as (old_range, new_range) pairs of line
    indices, one statement each: a block of changed lines is cut where a statement begins at no
    deeper a level than the chunk's first statement, comments going with the statement below
    them, and lines replaced go with the first statement that replaces them. Whitespace does not
    count."""
    matcher = line_matcher(old_lines, new_lines)
    old_starts, new_starts = statement_starts(old_lines), statement_starts(new_lines)
    chunks = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        lines, starts, first, last = (old_lines, old_starts, i1, i2) if tag == "delete" else \
            (new_lines, new_starts, j1, j2)
        for n, (a, b) in enumerate(statement_ranges(lines, starts, first, last)):
            if tag == "delete":
                chunks.append(((a, b), (j1, j1)))
            else:
                chunks.append(((i1, i2) if n == 0 else (i2, i2), (a, b)))
    return chunks


def chunk_text(old_lines, new_lines, chunk):
    """The changed lines of a chunk, as a diff shows them."""
    (i1, i2), (j1, j2) = chunk
    return [f"-{l}" for l in old_lines[i1:i2]] + [f"+{l}" for l in new_lines[j1:j2]]


REMOVED = "removed:"


def tag_chunks(old_lines, new_lines, spec):
    """[(concept, chunk)] for one region, and the markers of spec that tagged nothing.

    spec is a concept name (every change of the region serves it) or a list of (marker, concept)
    pairs: a chunk serves the concept of the first marker found in its changed lines; a chunk
    without any is tagged None (the guard reports it). Changes of blank lines only are no change.
    A marker that begins with REMOVED claims the removed statements (comments with the one below)
    whose lines hold the rest of it: they become a removal of their own, with that marker's
    concept; the chunk's other lines go to the first plain marker found in them (a statement
    removed for one concept, and replaced in the same place by code that serves another).
    """
    chunks = [chunk for chunk in change_chunks(old_lines, new_lines)
              if any(line[1:].strip() for line in chunk_text(old_lines, new_lines, chunk))]
    if isinstance(spec, str):
        return [(spec, chunk) for chunk in chunks], []
    plain = [(marker, concept) for marker, concept in spec if not marker.startswith(REMOVED)]
    removal = [(marker.removeprefix(REMOVED), concept) for marker, concept in spec
               if marker.startswith(REMOVED)]
    old_starts = statement_starts(old_lines) if removal else set()
    tagged, used = [], set()
    for (i1, i2), (j1, j2) in chunks:
        pieces = []  # (claiming marker or None, (start, end)) of the removed statements
        for a, b in statement_ranges(old_lines, old_starts, i1, i2) if removal else []:
            claim = next((pair for pair in removal if any(pair[0] in l for l in old_lines[a:b])), None)
            if pieces and pieces[-1][0] == claim:
                pieces[-1] = (claim, (pieces[-1][1][0], b))
            else:
                pieces.append((claim, (a, b)))
        if not any(claim for claim, _ in pieces):
            pieces = []
        rest = [line for claim, (a, b) in pieces if claim is None for line in old_lines[a:b]]
        text = "\n".join([f"-{l}" for l in (rest if pieces else old_lines[i1:i2])] +
                         [f"+{l}" for l in new_lines[j1:j2]])
        found = next(((marker, concept) for marker, concept in plain if marker in text), (None, None))
        if not pieces:
            used.add(found[0])
            tagged.append((found[1], ((i1, i2), (j1, j2))))
            continue
        for claim, (a, b) in pieces:
            used.add(REMOVED + claim[0] if claim else found[0])
            tagged.append(((claim or found)[1], ((a, b), (j1, j1))))
        if j2 > j1:
            used.add(found[0])
            tagged.append((found[1], ((i2, i2), (j1, j2))))
    return tagged, [marker for marker, _ in spec if marker not in used]


def line_names(text):
    """{line number: (names bound on the line, names read on it)} of a script, each name as
    (scope, name): scope is the function it belongs to (its qualified name), or None for the
    module. Definitions, parameters, imports, assignment and loop targets bind; loads read; a name
    a function reads but never binds is the module's. Attributes are not names (`state.epoch`
    reads `state` only)."""
    found, bound_in = {}, {}

    def note(line, kind, scope, name):
        found.setdefault(line, ([], []))[kind].append((scope, name))
        if kind == 0:
            bound_in.setdefault(scope, set()).add(name)

    def visit(node, scope, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                note(child.lineno, 0, scope, child.name)
                for part in child.decorator_list + getattr(child, "bases", []):
                    visit_expression(part, scope)
                if isinstance(child, ast.ClassDef):
                    visit(child, scope, f"{prefix}{child.name}.")
                else:
                    inner = f"{prefix}{child.name}"
                    for default in child.args.defaults + child.args.kw_defaults:
                        if default is not None:
                            visit_expression(default, scope)
                    for arg in ast.walk(child.args):
                        if isinstance(arg, ast.arg):
                            note(arg.lineno, 0, inner, arg.arg)
                    for statement in child.body:
                        visit_statement(statement, inner, f"{inner}.")
            else:
                visit_statement(child, scope, prefix)

    def visit_statement(node, scope, prefix):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            holder = ast.Module(body=[node], type_ignores=[])
            visit(holder, scope, prefix)
            return
        if isinstance(node, ast.alias):
            note(node.lineno, 0, scope, (node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            note(node.lineno, 0, scope, node.name)
        elif isinstance(node, ast.Name):
            note(node.lineno, 0 if isinstance(node.ctx, (ast.Store, ast.Del)) else 1, scope, node.id)
        for child in ast.iter_child_nodes(node):
            visit_statement(child, scope, prefix)

    def visit_expression(node, scope):
        visit_statement(node, scope, "")

    visit(ast.parse(text), None, "")
    # A name read in a function that never binds it is the module's.
    return {line: ({(scope, name) for scope, name in bound},
                   {(scope if name in bound_in.get(scope, ()) else None, name) for scope, name in read})
            for line, (bound, read) in found.items()}


if __name__ == "__main__":
    for a, b in STEPS:
        changed, added, removed = step_changes(read(a), read(b))
        print(f"{a} -> {b}: size {diff_size(read(a), read(b))}")
        print(f"  changed {sorted(changed)}\n  added {sorted(added)}\n  removed {sorted(removed)}")
        fa, fb = flags(read(a)), flags(read(b))
        print(f"  flags added {sorted(set(fb) - set(fa))} removed {sorted(set(fa) - set(fb))}")
