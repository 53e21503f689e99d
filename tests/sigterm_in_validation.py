"""Run ddp_full.py with SIGTERM delivered to one process while it validates.

    SIGTERM_RANK=R SIGTERM_AT_SAMPLE=P torchrun ... tests/sigterm_in_validation.py ARGS

A stand-in for a scheduler's SIGTERM landing during validation, at a moment chosen in advance
instead of raced for: the process of rank R sends itself SIGTERM as its validation loader draws
the P-th sample (from 0) of its shard in the first epoch -- with batches of 8, P = 48 is the first
sample of its 7th batch. The script runs as it is; only its validation sampler is wrapped.
"""
import importlib.util
import os
import signal
import sys

spec = importlib.util.spec_from_file_location("ddp_full", os.path.join(os.getcwd(), "ddp_full.py"))
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
shard_iter, epochs_seen = script.ShardSampler.__iter__, [0]


def signalling_iter(sampler):
    epochs_seen[0] += 1
    for position, index in enumerate(shard_iter(sampler)):
        if (epochs_seen[0] == 1 and position == int(os.environ["SIGTERM_AT_SAMPLE"])
                and os.environ.get("RANK", "0") == os.environ["SIGTERM_RANK"]):
            os.kill(os.getpid(), signal.SIGTERM)
        yield index


script.ShardSampler.__iter__ = signalling_iter
sys.argv = ["ddp_full.py", *sys.argv[1:]]
sys.exit(script.main())
