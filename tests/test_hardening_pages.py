"""The hardening pages answer "do I need it?": docs/hardening/README.md opens on a table of
situations, each with the command that keeps the parts it needs, and every part's section opens
with the situation that needs it. No page passes 30,000 characters (a script's parts go on over
several pages). tools/make_diffs.py writes them from tools/ladder_manifest.py (NEEDED_WHEN, KEEP_FOR).
"""
import ast
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402
import make_diffs  # noqa: E402
import strip_optional  # noqa: E402
from ladder_manifest import NEEDED_WHEN  # noqa: E402


@pytest.mark.parametrize("script", ladder.LADDER)
def test_each_part_opens_with_the_situation_that_needs_it_on_pages_of_at_most_30000_characters(script):
    pages = make_diffs.hardening_pages(script, ROOT)
    assert all(len(text) <= 30_000 for text in pages.values()), {path: len(text) for path, text in pages.items()}
    sections = re.split(r"^## ", "\n".join(pages.values()), flags=re.M)[1:]
    parts = strip_optional.tags(ladder.read(script, ROOT))
    assert sorted(section.split("\n", 1)[0] for section in sections) == sorted(parts)
    for section in sections:
        assert section.split("\n")[2].startswith("**You need it** "), section[:200]


def test_every_situation_names_a_part_some_script_has():
    parts = {name for script in ladder.LADDER for name in strip_optional.tags(ladder.read(script, ROOT))}
    assert set(NEEDED_WHEN) == parts


def test_each_command_of_the_index_keeps_exactly_its_parts_and_leaves_a_script_pyflakes_passes(tmp_path):
    # The commands as the page prints them, run as a copier runs them.
    rows = re.findall(r"^\| (.+?) \| \[`(\S+)`\]\(\S+\) \| `(python tools/strip_optional\.py .+) > my_trainer\.py` \|$",
                      (ROOT / "docs" / "hardening" / "README.md").read_text(), re.M)
    assert len(rows) >= 15
    for situation, script, command in rows:
        words = shlex.split(command)
        keep = words[words.index("--keep") + 1:]
        result = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, check=True)
        assert words[2] == script and set(strip_optional.tags(result.stdout)) == set(keep), situation
        ast.parse(result.stdout)
        copy = tmp_path / "my_trainer.py"
        copy.write_text(result.stdout)
        flakes = subprocess.run([sys.executable, "-m", "pyflakes", str(copy)], capture_output=True, text=True)
        undefined = [line for line in flakes.stdout.splitlines() if "undefined name" in line]
        assert not undefined, (situation, undefined)
