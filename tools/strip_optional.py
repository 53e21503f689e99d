"""Delete the optional parts of a ladder script: what the script tags "# [optional: NAME]".

    python tools/strip_optional.py ddp_full.py > my_trainer.py                # every optional part
    python tools/strip_optional.py ddp_full.py --keep init-from > my_trainer.py  # all but init-from

The rule, stated in ddp_full.py's and fsdp.py's docstrings, every script listing its parts and what each deletion
gives up (the copier's map): a line that is only the tag goes, with what it stands above -- the
statement or except clause that starts on the next line that is not a comment (a whole `if`,
function or class), or, inside a docstring, the lines up to a blank line or the next tag; a line
that ends in the tag goes alone (a one-line statement, a decorator, an argument, an entry of a
literal). A section ("# --- title") left with no code goes too. A tag may name two parts,
"# [optional: A, B]": what it tags goes when either goes (a part that needs another).
tests/test_copiers_map.py runs what this leaves.
"""
import argparse
import ast
import re
import sys
from pathlib import Path

TAG = re.compile(r"#\s*\[optional: ([^\]]+)\]\s*$")
MAP = "A copier's map:"  # the docstring's paragraph that lists the parts, to its end
SECTION = "# --- "  # a section's header


def tag_names(match):
    return [name.strip() for name in match.group(1).split(",")]


def tags(text):
    """{NAME: number of tags naming it} in the text."""
    found = {}
    for line in text.splitlines():
        match = TAG.search(line)
        for name in tag_names(match) if match else []:
            found[name] = found.get(name, 0) + 1
    return found


def tagged_lines(text, names=None):
    """The numbers (from 1) of the lines the parts tagged with any of `names` (None: every tagged
    part) are made of: what deleting them deletes, the map aside."""
    lines = text.splitlines(keepends=True)
    # Every statement and except clause, at any depth, by its first line (a decorator's, for a
    # decorated one).
    extent, decorators, in_docstring = {}, set(), set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            in_docstring.update(range(node.lineno + 1, node.end_lineno))
        if isinstance(node, (ast.stmt, ast.ExceptHandler)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            extent.setdefault(first, node.end_lineno)  # ast.walk meets the outer statement first
            decorators.update(d.lineno for d in getattr(node, "decorator_list", []))
    drop = set()
    for number, line in enumerate(lines, start=1):
        match = TAG.search(line)
        if not match or names is not None and not set(tag_names(match)) & set(names):
            continue
        if line.strip() == match.group(0).strip():
            below = number + 1
            while below <= len(lines) and lines[below - 1].lstrip().startswith("#"):
                below += 1  # the comments that explain the statement go with it
            end = extent.get(below, below)
            if number in in_docstring:  # a paragraph: to a blank line, another tag or the end
                while end + 1 in in_docstring and lines[end].strip() and not TAG.search(lines[end]):
                    end += 1
            drop.update(range(number, end + 1))
        elif number in extent and extent[number] > number and number not in decorators:
            raise ValueError(f"line {number}: a tag at the end of a statement's first line would "
                             f"delete only that line; put it on a line of its own above")
        else:
            drop.add(number)
    return drop


def strip(text, names=None):
    """The text without the parts tagged with any of `names` (None: every tagged part)."""
    lines = text.splitlines(keepends=True)
    drop = tagged_lines(text, names)
    if names is None or set(names) >= set(tags(text)):
        # Every part deleted: the map that lists them goes too, to the end of the docstring.
        first = next((n for n, line in enumerate(lines, start=1) if line.startswith(MAP)), None)
        if first is not None:
            end = next(n for n in range(first, len(lines) + 1) if lines[n - 1].startswith('"""'))
            drop.update(range(first - (first > 1 and not lines[first - 2].strip()), end))
    # A docstring whose last paragraph went closes on its text's last line, as the others do.
    for number, line in enumerate(lines, start=1):
        above = number - 1
        while above in drop:
            above -= 1
        closing = line.strip() == '"""' and line[0] == " " and number not in drop
        closing = closing and above < number - 1
        if closing and TAG.fullmatch(lines[above].strip()) and lines[above - 1].strip():
            joined = lines[above - 1].rstrip("\n") + '"""\n'
            if len(joined) <= 101 and not lines[above - 1].lstrip().startswith("#"):
                lines[above - 1] = joined
                drop.add(number)
    kept = [line for number, line in enumerate(lines, start=1) if number not in drop]
    # A section ("# --- title") whose code all went: its header and comments go too.
    headers = [k for k, line in enumerate(kept) if line.startswith(SECTION)] + [len(kept)]
    for start, end in reversed(list(zip(headers, headers[1:]))):
        if all(not line.strip() or line.lstrip().startswith("#") for line in kept[start:end]):
            del kept[start:end]
    kept = re.sub(r"\n{4,}", "\n\n\n", "".join(kept))  # two blank lines at most where code went
    ast.parse(kept)  # still Python
    return kept


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", help="a ladder script, or a copy of one")
    parser.add_argument("--keep", nargs="*", default=[], metavar="NAME",
                        help="optional parts to keep, by their tag's NAME (default: keep none)")
    args = parser.parse_args(argv)
    text = Path(args.script).read_text()
    unknown = set(args.keep) - set(tags(text))
    if unknown:
        parser.error(f"no part tagged {', '.join(sorted(unknown))} in {args.script}; "
                     f"its parts: {', '.join(sorted(tags(text)))}")
    sys.stdout.write(strip(text, set(tags(text)) - set(args.keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
