"""What divide_by_count costs a step (steps 4-6): one all-reduce of a number and one multiply of every
gradient, timed against the training step it follows, on the same process group, same model.

    torchrun --standalone --nproc_per_node=2 bench/count_division.py    # gloo on CPU, nccl on CUDA

Prints a line per model (rank 0): the step's time (forward, backward with DDP's all-reduce, SGD), the
division's, and their ratio, each the median of 5 rounds.
"""
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ddp_amp_accum", ROOT / "ddp_amp_accum.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)  # defines everything, runs nothing


def timed(function, repeats):
    """Seconds per call, the median of 5 rounds of `repeats` calls (a barrier before each round)."""
    rounds = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / repeats)
    return statistics.median(rounds)


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    for name, batch in (("cnn", 64), ("resnet18", 32), ("resnet50", 16)):
        torch.manual_seed(0)
        model = script.SmallCNN(10) if name == "cnn" else torchvision.models.get_model(name, num_classes=10)
        model = DDP(model.to(device), device_ids=[device.index] if cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        images = torch.randn(batch, 3, 32, 32, device=device)
        labels = torch.randint(10, (batch,), device=device)

        def step():
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()

        count = torch.zeros((), dtype=torch.float64, device=device)

        def divide():
            count.add_(batch)
            script.divide_by_count(model, count, batch)

        step()  # DDP's first step re-buckets: not timed
        step_seconds, divide_seconds = timed(step, 5), timed(divide, 200)
        if dist.get_rank() == 0:
            print(f"{name}: step {step_seconds * 1e3:.1f} ms, divide_by_count {divide_seconds * 1e6:.0f} us, "
                  f"{divide_seconds / step_seconds:.2%} of a step ({dist.get_world_size()} processes, "
                  f"{dist.get_backend()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
