"""Run a ladder script as torchrun starts it, with a directory that one process cannot see.

    MISSING_RANK=1 MISSING_DIR=/data/train torchrun --nproc_per_node=2 tests/missing_on_one_rank.py SCRIPT ARGS

A CPU stand-in for a node whose disk lacks what the others have: in the process of rank
MISSING_RANK, listing MISSING_DIR (os.scandir, as torchvision's ImageFolder does), or creating a
file in it (tempfile.TemporaryFile, as the scripts' out-dir check does), finds no such directory;
every other process sees it as it is.
"""
import errno
import os
import runpy
import sys
import tempfile

if os.environ.get("RANK") == os.environ["MISSING_RANK"]:
    scandir, missing = os.scandir, os.path.abspath(os.environ["MISSING_DIR"])

    def scandir_without_missing(path="."):
        if os.path.abspath(path) == missing:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return scandir(path)

    def temporary_file_not_in_missing(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == missing:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dir)
        return temporary_file(*args, dir=dir, **kwargs)

    os.scandir, temporary_file = scandir_without_missing, tempfile.TemporaryFile
    tempfile.TemporaryFile = temporary_file_not_in_missing
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
