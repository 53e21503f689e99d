"""Run tests under each CPU kernel path this machine can take, and say which kernels each took.

    .venv/bin/python tools/kernel_paths.py                      # the mixed-precision tests, both tiers
    .venv/bin/python tools/kernel_paths.py --tier1              # the README's first tier
    .venv/bin/python tools/kernel_paths.py -- -m slow -k learns  # any pytest arguments
    .venv/bin/python tools/kernel_paths.py --out docs/kernel_paths.md

oneDNN picks its kernels by the CPU (AVX2, AVX-512, AVX512-BF16, AMX), and so does ATen's own
vectorised code; each rounds bf16 and float32 sums its own way. A ceiling (ONEDNN_MAX_CPU_ISA,
ATEN_CPU_CAPABILITY) emulates a smaller CPU; above what the CPU has it changes nothing, so each row
also records what was really taken: torch's CPU capability, oneDNN's ISA, and the implementation
of a float32 and a bf16 convolution (ONEDNN_VERBOSE; "ATen" where oneDNN ran none, as for bf16 on
a CPU without AVX512-BF16). Each setting runs the tests in a pytest session of its own, and every
process it launches inherits the setting; a setting whose kernels are an earlier one's is not run
again (--every runs it). Exit status 1 if any setting failed.
"""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The default, oneDNN's ceilings (SSE41: a path of its own on a CPU without AVX-512, where the
# AVX-512 ones take the default's kernels), and ATen's, each alone.
SETTINGS = [{}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
            {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, {"ONEDNN_MAX_CPU_ISA": "SSE41"},
            {"ATEN_CPU_CAPABILITY": "default"}, {"ATEN_CPU_CAPABILITY": "avx2"}]
# The mixed-precision tests of both tiers: autocast's dtypes, bf16 against float32, fp16's
# GradScaler, FSDP's policies, and the resumes and flags tested under fp16.
MIXED_PRECISION = ["tests/test_amp.py", "tests/test_fsdp.py", "tests/test_resume.py", "tests/test_equivalence.py",
                   "-m", "slow or not slow", "-k", "bf16 or fp16 or precision or scaler or bucket"]
PROBE = """
import torch
x = torch.randn(4, 3, 16, 16)
conv = torch.nn.Conv2d(3, 8, 3)
print("CAPABILITY", torch.backends.cpu.get_cpu_capability(), flush=True)
conv(x).sum().backward()
print("BF16", flush=True)
with torch.autocast("cpu", dtype=torch.bfloat16):
    conv(x).float().sum().backward()
"""


def kernels(env):
    """(torch's CPU capability, oneDNN's ISA, float32 convolution, bf16 convolution) under env."""
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True).stdout
    capability = re.search(r"CAPABILITY (\S+)", out)
    isa = re.search(r"info,cpu,isa:([^\n]+)", out)
    fp32, _, bf16 = out.partition("BF16")

    def convolution(text):
        found = re.search(r"exec,cpu,convolution,([^,]+),forward", text)
        return found.group(1) if found else "ATen (no oneDNN convolution)"
    return (capability.group(1) if capability else "?", isa.group(1).strip() if isa else "?",
            convolution(fp32), convolution(bf16))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tier1", action="store_true", help="run the README's first tier, not the mixed-precision tests")
    parser.add_argument("--every", action="store_true",
                        help="run every setting, also those that take an earlier one's kernels")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (default: the mixed-precision tests)")
    args = parser.parse_args(argv)
    selection = args.pytest_args or (["tests"] if args.tier1 else MIXED_PRECISION)
    rows, failed, taken = [], 0, {}
    for setting in SETTINGS:
        env = {key: value for key, value in os.environ.items()
               if key not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
        env.update(setting)
        name = " ".join(f"{k}={v}" for k, v in setting.items()) or "default"
        capability, isa, fp32, bf16 = kernels(env)
        if (capability, isa, fp32, bf16) in taken and not args.every:
            # A ceiling above what the CPU has takes the kernels of a setting already run.
            rows.append(f"| {name} | {capability} | {isa} | {fp32} | {bf16} | the kernels of "
                        f"{taken[capability, isa, fp32, bf16]}: not run again | |")
            print(rows[-1], flush=True)
            continue
        taken[capability, isa, fp32, bf16] = name
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", *selection],
                                cwd=ROOT, env=env, capture_output=True, text=True)
        minutes = (time.monotonic() - start) / 60
        summary = ([line.strip("= ") for line in result.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
                   or [f"pytest exit {result.returncode}"])[-1]
        failed += result.returncode != 0
        if result.returncode:
            print("\n".join(line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))))
        rows.append(f"| {name} | {capability} | {isa} | {fp32} | {bf16} | {summary} | {minutes:.1f} |")
        print(rows[-1], flush=True)
    table = ["| setting | torch's CPU capability | oneDNN's ISA | float32 convolution | bf16 convolution | "
             "pytest | minutes |", "| --- | --- | --- | --- | --- | --- | --- |", *rows]
    print("\n".join(table))
    if args.out:
        selection_text = " ".join(selection)
        Path(args.out).write_text(
            f"# Kernel paths\n\nWritten by `tools/kernel_paths.py` on {time.strftime('%Y-%m-%d')}: "
            f"`pytest -n 2 {selection_text}` under each setting, on this CPU:\n"
            f"{_cpu_name()}.\n\n" + "\n".join(table) + "\n")
    return 1 if failed else 0


def _cpu_name():
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
