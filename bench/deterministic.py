"""Run a ladder script with deterministic GPU kernels, for the GPU check's exact resume comparisons:

    torchrun ... bench/deterministic.py ddp_full.py ARGS

cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when its first handle is made: set here,
before torch is imported), cuDNN's deterministic algorithms, and torch's deterministic
implementations where it has them (warn_only: an operation without one warns and runs as it is,
and the comparison then shows what it changed). The script itself is run unchanged.
"""
import os
import runpy
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.deterministic = True
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
