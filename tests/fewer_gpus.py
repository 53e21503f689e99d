"""Run a ladder script as torchrun starts it, on a machine that shows FEWER_GPUS CUDA devices.

    FEWER_GPUS=1 torchrun --nproc_per_node=2 tests/fewer_gpus.py SCRIPT --backend gloo ARGS

A CPU stand-in for a launch with more processes than GPUs: torch.cuda reports FEWER_GPUS devices
(set_device does nothing), so the processes whose local rank is too high meet the script's check
of the GPU count, and the others do not. Give the script --backend gloo: no GPU is really there.
"""
import os
import runpy
import sys

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: int(os.environ["FEWER_GPUS"])
torch.cuda.set_device = lambda device: None
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
