"""Run ddp_full.py (or fsdp.py) with SIGTERM delivered to one process at a chosen sample.

    SIGTERM_RANK=R SIGTERM_AT_SAMPLE=P SIGTERM_IN=train|val torchrun ... tests/sigterm_at_sample.py \
        SCRIPT ARGS

A stand-in for a scheduler's SIGTERM landing in training or in validation, at a moment chosen in
advance instead of raced for: the process of rank R sends itself SIGTERM as its training (or
validation) loader draws the P-th sample (from 0) of its share in the first epoch -- with batches
of 8, P = 48 is the first sample of its 7th batch. The script runs as it is; only its training
(ResumableSampler) or validation (ShardSampler) sampler is wrapped.
"""
import importlib.util
import os
import signal
import sys

path = os.path.join(os.getcwd(), sys.argv[1])
spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
sampler = {"train": script.ResumableSampler, "val": script.ShardSampler}[os.environ["SIGTERM_IN"]]
sampler_iter, epochs_seen = sampler.__iter__, [0]


def signalling_iter(self):
    epochs_seen[0] += 1
    for position, index in enumerate(sampler_iter(self)):
        if (epochs_seen[0] == 1 and position == int(os.environ["SIGTERM_AT_SAMPLE"])
                and os.environ.get("RANK", "0") == os.environ["SIGTERM_RANK"]):
            os.kill(os.getpid(), signal.SIGTERM)
        yield index


sampler.__iter__ = signalling_iter
sys.argv = [sys.argv[1], *sys.argv[2:]]
sys.exit(script.main())
