"""Random augmentation is a pure function of (seed, epoch, sample index): exact with any workers.

Data-loader workers are seeded once, when they start, and persistent workers carry their random
state from epoch to epoch; a resumed run starts new workers, and a sample lands on whichever worker
its batch goes to. Augmentation drawn from those generators made a resume inexact even at an epoch
boundary, and made the crop a sample gets depend on --workers and the world size. SeededSamples
seeds each sample's draws from its key instead. On the generated image tree (random crops and
flips, 24 training images): a resume of resnet18 with --workers 2 is bitwise, mid-epoch and at an epoch
boundary; one process on the global batch trains what 2 processes train, with 0 and 2 workers,
within test_equivalence.py's WEIGHT_ATOL (the same samples, augmented alike; only the float sums
split differently). SeededSamples is ddp_full.py's (and fsdp.py's): the machinery of long runs.
"""
import random

import pytest
import torch

from conftest import IMAGEFOLDER
from test_equivalence import assert_same_training
from test_resume import assert_bitwise_equal, run_full
from test_validation import load_script

pytestmark = pytest.mark.slow  # second tier, as a whole


def image_args(image_tree, workers):
    return [*IMAGEFOLDER, "--data-dir", str(image_tree), "--workers", str(workers)]


def epoch_of_batches(script, image_tree, workers, epoch=1):
    module = load_script(script)
    args = module.parse_args(["--data", "imagefolder", "--data-dir", str(image_tree), "--image-size", "16",
                              "--batch-size", "4", "--workers", str(workers)])
    train_set, val_set, _ = module.build_datasets(args)
    loader, _ = module.build_loaders(args, train_set, val_set, torch.device("cpu"), rank=0, world_size=1)
    loader.sampler.set_epoch(epoch)
    return [images for (images, _), _unreadable in loader]


# 3 workers on a 2-core machine: DataLoader warns, and the test means it.
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_the_same_sample_gets_the_same_augmentation_with_0_1_and_3_workers(image_tree):
    by_workers = {workers: epoch_of_batches("ddp_full.py", image_tree, workers) for workers in (0, 1, 3)}
    for workers in (1, 3):
        assert len(by_workers[workers]) == len(by_workers[0]) == 6
        assert all(torch.equal(a, b) for a, b in zip(by_workers[0], by_workers[workers])), workers


def test_a_sample_is_augmented_anew_each_epoch_and_leaves_the_global_generators_alone(image_tree):
    module = load_script("ddp_full.py")
    args = module.parse_args(["--data", "imagefolder", "--data-dir", str(image_tree), "--image-size", "16"])
    train_set, _, _ = module.build_datasets(args)
    seeded = module.SeededSamples(train_set, args.seed)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    # An item is (image, label).
    first, again, next_epoch = seeded[(1, 5)][0], seeded[(1, 5)][0], seeded[(2, 5)][0]
    assert torch.equal(first, again) and not torch.equal(first, next_epoch)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state


@pytest.mark.parametrize("workers", [0, 2])
def test_one_process_on_the_global_batch_equals_ddp_full_on_2_with_augmentation(runs, image_tree, workers):
    args = image_args(image_tree, workers)
    single = runs.get(f"imagefolder_w1_workers{workers}", "ddp_full.py", [*args, "--batch-size", "8"])
    ddp = runs.get(f"imagefolder_w2_workers{workers}", "ddp_full.py", args, nproc=2)
    assert_same_training(single, ddp)


BATCHNORM = ["--model", "resnet18"]


def test_resume_of_resnet18_with_augmenting_workers_is_bitwise_mid_epoch_and_at_an_epoch_boundary(
        runs, image_tree, tmp_path):
    # 2 processes x 4 of 24 images: 3 optimizer steps an epoch. Stopped mid-epoch 1 (step 2), then at
    # its end (step 3), then run to the end: three runs, each with new workers. resnet18's BatchNorm
    # statistics are state too; its crops must repeat for them to.
    args = [*image_args(image_tree, 2), *BATCHNORM]
    reference = runs.get("imagefolder_w2_workers2_resnet18", "ddp_full.py", args, nproc=2)
    run_full(tmp_path, *args, "--max-steps", "2")
    middle = run_full(tmp_path, *args, "--max-steps", "3")
    assert "step_000000002.pt: step 2 of epoch 1" in middle.stdout
    last = run_full(tmp_path, *args)
    assert "step_000000003.pt: step 0 of epoch 2" in last.stdout
    assert_bitwise_equal(reference, tmp_path)


@pytest.mark.slow
def test_resume_of_resnet18_on_three_processes_with_augmenting_workers_is_bitwise(runs, image_tree, tmp_path):
    # DDP all-reduces a run's first step in one bucket, then re-buckets in the order backward made
    # the gradients; summed in other buckets, 3 or more processes round otherwise (2 cannot: a + b =
    # b + a), and a resume whose first step ran in the one bucket drifted (measured: 102 of resnet18's
    # 122 tensors apart). The part "primed buckets" throws a first step away, drawing a batch from
    # the augmenting workers before the restore. 3 x 4 of 24 images: 2 optimizer steps an epoch;
    # stopped after step 1, resumed with new workers.
    args = [*image_args(image_tree, 2), *BATCHNORM]
    reference = runs.get("imagefolder_w3_workers2_resnet18", "ddp_full.py", args, nproc=3)
    run_full(tmp_path, *args, "--max-steps", "1", nproc=3)
    resumed = run_full(tmp_path, *args, nproc=3)
    assert "step_000000001.pt: step 1 of epoch 1" in resumed.stdout
    assert_bitwise_equal(reference, tmp_path)
