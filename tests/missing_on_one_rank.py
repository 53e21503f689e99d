"""Run a ladder script as torchrun starts it, with a directory that one process cannot see.

    MISSING_RANK=1 MISSING_DIR=/data/train torchrun --nproc_per_node=2 tests/missing_on_one_rank.py SCRIPT ARGS

A CPU stand-in for a node whose disk lacks what the others have: in the process of rank
MISSING_RANK, os.path.isdir says no for MISSING_DIR; every other process sees it as it is.
"""
import os
import runpy
import sys

if os.environ.get("RANK") == os.environ["MISSING_RANK"]:
    isdir, missing = os.path.isdir, os.path.abspath(os.environ["MISSING_DIR"])
    os.path.isdir = lambda path: os.path.abspath(path) != missing and isdir(path)
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
