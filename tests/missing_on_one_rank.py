"""Run a ladder script as torchrun starts it, with a directory that one process cannot see.

    MISSING_RANK=1 MISSING_DIR=/data/train torchrun --nproc_per_node=2 tests/missing_on_one_rank.py SCRIPT ARGS

A CPU stand-in for a node whose disk lacks what the others have: in the process of rank
MISSING_RANK, listing MISSING_DIR (os.scandir, as torchvision's ImageFolder does), creating a
file in it (tempfile.TemporaryFile, as the scripts' out-dir check does), or opening or testing a
path in it (open, os.stat: a checkpoint given by --resume), finds no such directory; every other
process sees it as it is.
"""
import builtins
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

    def inside_missing(path):
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(missing + os.sep)

    def without_missing(function):
        def call(path, *args, **kwargs):
            if inside_missing(path):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
            return function(path, *args, **kwargs)
        return call

    os.scandir, temporary_file = scandir_without_missing, tempfile.TemporaryFile
    tempfile.TemporaryFile = temporary_file_not_in_missing
    os.stat, builtins.open = without_missing(os.stat), without_missing(builtins.open)
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
