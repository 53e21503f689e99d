"""In-memory data through the scripts' loader: a sample at a time, or a batch at a time.

    .venv/bin/python bench/loader.py               # docs/bench/loader.md
    .venv/bin/python bench/loader.py --quick --out DIR

The scripts' synthetic data is a TensorDataset read with 0 loader workers: the DataLoader indexes
it one sample at a time and stacks the samples (default_collate), on the training thread. A batch
sampler instead (batch_size=None, BatchSampler) indexes each tensor once with the batch's indices.
Both read the same samples in the same order; this measures samples/s of the loader alone, no
model, one thread, median of 3 rounds.
"""
import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

ROOT = Path(__file__).resolve().parent.parent


def loader(dataset, batch_size, batched):
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
    if batched:
        return DataLoader(dataset, batch_size=None, sampler=BatchSampler(sampler, batch_size, drop_last=False))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def rate(dataset, batch_size, batched):
    start, samples = time.perf_counter(), 0
    for _, labels in loader(dataset, batch_size, batched):
        samples += len(labels)
    return samples / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, for the smoke test")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench"), help="output folder (default: docs/bench)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = ["# In-memory data: a sample at a time or a batch at a time", "",
             f"Written by `bench/loader.py{' --quick' if args.quick else ''}` on {datetime.date.today()}; torch "
             f"{torch.__version__}, {os.cpu_count()} CPUs, one thread. Samples/s of the DataLoader alone (no model), "
             "random order, batches of 64, median of 3 rounds.", "",
             "| images | samples | a sample at a time (today) | a batch at a time | ratio |", "| --- | --- | --- | --- | --- |"]
    for size, count in ((32, 512), (224, 128)) if args.quick else ((32, 8192), (224, 1024)):
        dataset = TensorDataset(torch.randn(count, 3, size, size), torch.randint(10, (count,)))
        today, batched = ([rate(dataset, 64, b) for _ in range(3)] for b in (False, True))
        today, batched = statistics.median(today), statistics.median(batched)
        lines.append(f"| {size}x{size} | {count} | {today:.0f} | {batched:.0f} | {batched / today:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
