"""lean/ holds each script with every optional part deleted: a trainer a reader would copy as it is.

A lean copy is what tools/strip_optional.py makes of its script, byte for byte, so the two cannot
drift apart (`python tools/strip_optional.py <script> > lean/<script>` after any change). It leaves
no debris: no import, function, class or module-level name that nothing uses, no local variable
assigned and never read (the full scripts are held to the same). It trains what its script trains,
bitwise: the deleted parts are checks, messages and options that the default run never enters
(tests/test_copiers_map.py proves the same of lean ddp_full.py and fsdp.py, resumes included).
"""
import ast
import re
import sys

import pytest

from conftest import ROOT, check, launch, TINY
from test_resume import assert_bitwise_equal
from test_static import SCRIPTS

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402
import strip_optional  # noqa: E402

LEAN = ROOT / "lean"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lean_copy_is_its_script_with_every_optional_part_deleted(script):
    assert (LEAN / script).read_text() == strip_optional.strip((ROOT / script).read_text()), \
        f"lean/{script} is stale: python tools/strip_optional.py {script} > lean/{script}"


def unused(text):
    """What a reader would delete: "import x" never read, a top-level function, class or name
    nothing refers to, a local variable assigned and never read, a parameter never read (but
    `args`, the run's settings, which every step's functions take alike, and "_name"). Imports kept
    for their side effect say so ("# noqa: F401")."""
    tree = ast.parse(text)
    lines = text.splitlines()
    loads = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "noqa: F401" not in lines[node.lineno - 1]:
            for alias in node.names:
                name = (alias.asname or alias.name).split(".")[0]
                if name not in loads:
                    found.append(f"line {node.lineno}: import {name}")
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        found += [f"line {node.lineno}: {name} is never used" for name in names
                  if name not in loads and name != "main"]
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            read = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            read |= {name for n in ast.walk(function) if isinstance(n, (ast.Global, ast.Nonlocal)) for name in n.names}
            for node in ast.walk(function):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    if node.targets[0].id not in read and not node.targets[0].id.startswith("_"):
                        found.append(f"line {node.lineno}: {node.targets[0].id} is assigned, never read")
            arguments = function.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                if arg.arg not in read | {"self", "args"} and not arg.arg.startswith("_"):
                    found.append(f"line {function.lineno}: {function.name}'s {arg.arg} is never read")
    return found


@pytest.mark.parametrize("folder", ["lean", "."])
@pytest.mark.parametrize("script", SCRIPTS)
def test_no_import_or_name_is_left_that_nothing_uses(script, folder):
    assert not unused((ROOT / folder / script).read_text())


def pyflakes_findings(path):
    """pyflakes' findings in a file (an undefined name, an unused import or variable, ...), but an
    import that says it is kept for its side effect ("# noqa: F401")."""
    from pyflakes.checker import Checker
    from pyflakes.messages import UnusedImport

    text = path.read_text()
    lines = text.splitlines()
    return [f"{path.parent.name}/{path.name}:{m.lineno}: {m.message % m.message_args}"
            for m in Checker(ast.parse(text), filename=str(path)).messages
            if not (isinstance(m, UnusedImport) and "noqa: F401" in lines[m.lineno - 1])]


@pytest.mark.parametrize("folder", ["lean", ".", "tests", "tools", "bench"])
def test_pyflakes_finds_nothing(folder):
    # A name only a deleted part defined is an error only the stripped path would meet, at run time.
    assert [f for path in sorted((ROOT / folder).glob("*.py")) for f in pyflakes_findings(path)] == []


def test_pyflakes_finds_a_name_that_only_a_deleted_part_defines(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(strip_optional.strip("def f(x):\n    # [optional: a]\n    y = x + 1\n    return y\n"))
    assert [f.split(": ", 1)[1] for f in pyflakes_findings(script)] == ["undefined name 'y'"]


# torchrun's own flags, which the launch commands in the docstrings pass to torchrun, not the script.
LAUNCHER_FLAGS = {"--standalone", "--nproc_per_node", "--nnodes", "--max-restarts", "--rdzv-backend",
                  "--rdzv-endpoint", "--rdzv-id"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lean_copy_mentions_no_flag_it_lacks(script):
    # A comment, docstring or message that names a deleted flag tells the reader to use what is gone.
    text = (LEAN / script).read_text()
    flags = {name for flag, found in ladder.flags(text).items() for name in (flag, *found["aliases"])}
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", text))
    assert not mentioned - flags - LAUNCHER_FLAGS


def test_the_debris_check_finds_debris():
    # The check above, on code with one of each kind of debris it looks for.
    text = ("import os\nimport sys  # noqa: F401\nA = 1\n\n\ndef helper():\n    pass\n\n\n"
            "def main(args, afresh):\n    x = 2\n    y = 3\n    return y\n")
    assert [re.sub(r"line \d+: ", "", item) for item in unused(text)] == \
        ["import os", "A is never used", "helper is never used", "x is assigned, never read",
         "main's afresh is never read"]


# The reference runs test_equivalence.py launches too (the same name, so each runs once).
REFERENCES = {"single_gpu.py": ("single16", ["--batch-size", "16"], None),
              "dataparallel.py": ("dp16", ["--batch-size", "16"], None),
              "ddp_basic.py": ("basic_w2", ["--batch-size", "8"], 2),
              "ddp_amp_accum.py": ("accum_default_w2", ["--batch-size", "8"], 2)}


@pytest.mark.parametrize("script", REFERENCES)
def test_the_lean_copy_trains_what_its_script_trains_bitwise(script, runs, tmp_path):
    name, args, nproc = REFERENCES[script]
    reference = runs.get(name, script, args, nproc=nproc)
    check(launch(str(LEAN / script), [*TINY, *args, "--out-dir", str(tmp_path)], nproc=nproc))
    assert_bitwise_equal(reference, tmp_path)
