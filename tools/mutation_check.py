"""Show that each pitfall's guard fails when the pitfall is put back.

For every entry of tools/pitfalls.py: copy the repository, apply the entry's mutation to the copy,
run its guard tests against the copy (LADDER_ROOT) and expect them to FAIL. Writes docs/mutations.md
and, beside it, the record docs/mutations.json: each pitfall's fingerprint, a hash of the code it
guards (the regions of the scripts that hold its fix and its mutation) and of its guards (their test
files and the harness: conftest.py, the probes, the sections).

    .venv/bin/python tools/mutation_check.py              # all (about 30 minutes on 2 AMD EPYC cores)
    .venv/bin/python tools/mutation_check.py 3 6          # only pitfalls 3 and 6
    .venv/bin/python tools/mutation_check.py --check      # all, writing nothing
    .venv/bin/python tools/mutation_check.py --changed    # only those whose fingerprint differs from
                                                          # the record's, writing nothing (CI)
    .venv/bin/python tools/mutation_check.py --changed --record   # the same, the record updated for
                                                          # those caught (a change's own check)

The full run is made before a change lands and its record committed: CI then reruns only the pitfalls
whose guarded code or guards changed since (none, for a change that landed with its record).
Exit status 1 if a guard passed on its mutation (a test that cannot fail).
"""
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ladder import ROOT, regions  # noqa: E402
from pitfalls import PITFALLS  # noqa: E402

RECORD = ROOT / "docs" / "mutations.json"

IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "data", "__pycache__", ".pytest_cache")


def check(number, pitfall):
    script, old, new = pitfall["mutation"]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ladder"
        shutil.copytree(ROOT, copy, ignore=IGNORE)
        text = (copy / script).read_text()
        assert old in text, f"pitfall {number}: mutation target not in {script}"
        (copy / script).write_text(text.replace(old, new, 1))
        env = dict(os.environ, LADDER_ROOT=str(copy), LADDER_LAUNCH_TIMEOUT="90")
        start = time.monotonic()
        # -o addopts=: every guard runs, whichever tier it belongs to (pytest.ini leaves out the second).
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                 *pitfall["guards"]], cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
    lines = [l for l in result.stdout.splitlines() if l.startswith(("E ", "FAILED", "ERROR"))]
    reason = next((l[2:].strip() for l in lines if l.startswith("E ")), lines[0] if lines else "")
    if result.returncode not in (0, 1):  # no test ran, or pytest itself failed: nothing was caught
        return False, seconds, f"pytest exit {result.returncode}: {(result.stdout + result.stderr)[-150:]}"
    return result.returncode == 1, seconds, reason[:160]


def guarded_code(script, text):
    """The regions of the script (tools/ladder.py) whose lines hold text."""
    return [f"{script}:{name}\n" + "\n".join(lines) for name, lines in regions((ROOT / script).read_text()).items()
            if text.strip() in "\n".join(lines) or any(text.strip().splitlines()[0].strip() in line for line in lines)]


def fingerprint(pitfall):
    """A hash of what decides whether the pitfall's guards fail on its mutation: the entry, the code it
    guards and its mutation's target, the guards' test files and the harness they run on."""
    script, old, _ = pitfall["mutation"]
    parts = [repr(sorted(pitfall.items()))]
    for file, text in [*pitfall["fix"], (script, old)]:
        parts += guarded_code(file, text) or [f"{file}: {text!r} not found"]
    harness = sorted({g.split("::")[0] for g in pitfall["guards"]} |
                     {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_")})
    parts += [f"{name}\n{(ROOT / name).read_text()}" for name in harness]
    return hashlib.sha256("\n\0".join(parts).encode()).hexdigest()[:16]


def main(selected, write=True, changed=False):
    rows, missed = [], 0
    fingerprints = {str(n): fingerprint(p) for n, p in enumerate(PITFALLS, 1)}
    if changed:
        recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {"fingerprints": {}}
        selected = {n for n in range(1, len(PITFALLS) + 1)
                    if recorded["fingerprints"].get(str(n)) != fingerprints[str(n)]}
        print(f"mutation check: {len(PITFALLS) - len(selected)} of {len(PITFALLS)} pitfalls unchanged since the "
              f"full run of {recorded.get('date', 'never')} (docs/mutations.json); running "
              f"{sorted(selected) or 'none'}", flush=True)
    for number, pitfall in enumerate(PITFALLS, 1):
        if (selected or changed) and number not in selected:
            continue
        failed, seconds, reason = check(number, pitfall)
        missed += not failed
        verdict = "guard failed (caught)" if failed else "GUARD PASSED (missed)"
        print(f"{number:2d}. {pitfall['title']}: {verdict} in {seconds:.0f} s -- {reason}", flush=True)
        rows.append(f"| {number} | {pitfall['title']} | `{pitfall['mutation'][0]}` | {verdict} | {seconds:.0f} s | "
                    f"{reason.replace('|', '/')} |")
    if changed and "--record" in sys.argv and not missed and selected:
        record = json.loads(RECORD.read_text()) if RECORD.exists() else {"date": "never", "fingerprints": {}}
        record["fingerprints"].update({str(n): fingerprints[str(n)] for n in selected})
        record["updated"] = {**record.get("updated", {}), **{str(n): str(datetime.date.today()) for n in selected}}
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    if write and not selected:
        header = ["# Mutation check: each pitfall put back, each guard run", "",
                  f"Run by `tools/mutation_check.py` on {datetime.date.today()} ({platform.machine()}, "
                  f"{os.cpu_count()} cores). Each row applies one mistake to a copy of the repository and runs the "
                  f"guard tests named in [pitfalls.md](pitfalls.md) against it; every guard must fail. The run's "
                  f"record, [mutations.json](mutations.json), holds each pitfall's fingerprint (the code it guards, "
                  f"its guards): CI reruns only the pitfalls whose fingerprint has changed since.", "",
                  "| # | pitfall | mutated | result | time | first failure line |", "| --- | --- | --- | --- | --- | --- |"]
        (ROOT / "docs" / "mutations.md").write_text("\n".join(header + rows) + "\n")
        if not missed:
            RECORD.write_text(json.dumps({"date": str(datetime.date.today()), "fingerprints": fingerprints},
                                         indent=1) + "\n")
    # "caught" counts as passed: the guard failed on its mutation, as it must.
    if rows:
        print(f"mutations: {len(rows) - missed} passed, {missed} failed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main({int(a) for a in sys.argv[1:] if not a.startswith("--")},
                  write=not {"--check", "--changed"} & set(sys.argv), changed="--changed" in sys.argv))
