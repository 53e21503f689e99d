"""Read the ladder's scripts as named regions, and compare neighbours: the shared code of the
diff guard (tests/test_ladder_diffs.py) and of the generated diffs (tools/make_diffs.py).

A region is one top-level statement of a script together with the comments and blank lines above
it: "docstring", "imports" (all import statements), a function or class by its name, a constant by
its name, "__main__" for the `if __name__ == "__main__":` guard. Comparing regions ignores
whitespace (indentation, blank lines, spacing) but not comments: comments are content.
"""
import ast
import difflib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LADDER = ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py"]
STEPS = list(zip(LADDER, LADDER[1:]))
# What each step adds: the one concept its diff teaches.
CONCEPTS = {
    "dataparallel.py": "nn.DataParallel, and why not",
    "ddp_basic.py": "DistributedDataParallel under torchrun",
    "ddp_amp_accum.py": "mixed precision and gradient accumulation",
    "ddp_full.py": "exact validation, checkpoints, exact resume, clusters",
}


def region_name(node):
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return "docstring"
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return "imports"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
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


def read(name, root=ROOT):
    return (Path(root) / name).read_text()


if __name__ == "__main__":
    for a, b in STEPS:
        changed, added, removed = step_changes(read(a), read(b))
        print(f"{a} -> {b}: size {diff_size(read(a), read(b))}")
        print(f"  changed {sorted(changed)}\n  added {sorted(added)}\n  removed {sorted(removed)}")
        fa, fb = flags(read(a)), flags(read(b))
        print(f"  flags added {sorted(set(fb) - set(fa))} removed {sorted(set(fa) - set(fb))}")
