"""Data paths: an image tree in the ImageFolder layout, CIFAR-10 in its download layout, and the
default synthetic run learning."""
import json
import re

import pytest
import torch

from conftest import CLASSES, IMAGEFOLDER, ROOT, TINY, check, launch, metrics, weights

# A number as the scripts print one: 1228, 0.0174, 1.12947e-06, the parts of 0:00:01.
NUMBER = re.compile(r"\d[\d.]*(?:e[-+]\d+)?")
# The Quickstart's run on another machine: the same seed and torch, other CPU kernels, which round
# differently and may move a few of the 1,000 validation predictions; 5 of them is 0.005.
QUICKSTART_VAL_ACC_ATOL = 0.005


@pytest.mark.slow
def test_imagefolder_tree_trains_with_one_class_per_folder_and_counts_every_val_image(runs, image_tree):
    # 3 classes x 3 val images = 9, which 2 processes do not divide: all 9 must be counted once.
    out_dir = runs.get("imagefolder_w2", "ddp_full.py", [*IMAGEFOLDER, "--data-dir", str(image_tree)], nproc=2)
    records = metrics(out_dir)
    assert len(records) == 2 and all(r["val_samples"] == 9 for r in records)
    assert weights(out_dir)["classifier.weight"].shape == (len(CLASSES), 64)


@pytest.mark.slow
def test_quickstart_training_ends_with_the_lines_the_readme_shows(tmp_path):
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    command = re.search(r"```bash\n(.*?)\n```", quickstart, re.S).group(1)
    assert command.endswith(" && .venv/bin/python single_gpu.py"), command
    shown = re.search(r"Its last lines.*?```text\n(.*?)\n```", quickstart, re.S).group(1).splitlines()
    result = check(launch("single_gpu.py", ["--out-dir", str(tmp_path)]))
    printed = result.stdout.replace(str(tmp_path), "runs/single_gpu").splitlines()[-len(shown):]
    # Every word the same; the numbers may differ (throughput and times do), except the accuracy.
    assert [NUMBER.sub("#", line) for line in printed] == [NUMBER.sub("#", line) for line in shown], printed
    accuracy = [float(re.search(r"val_acc ([\d.]+)", "\n".join(lines)).group(1)) for lines in (printed, shown)]
    assert abs(accuracy[0] - accuracy[1]) <= QUICKSTART_VAL_ACC_ATOL, accuracy


@pytest.mark.slow  # every default, 5 epochs on 2 processes: second tier
def test_default_synthetic_run_learns_and_prints_no_warnings(tmp_path):
    # The launch README's "Launching" shows (2 processes, every default), but for the output directory.
    result = launch("ddp_full.py", ["--out-dir", str(tmp_path)], nproc=2)
    check(result)
    records = metrics(tmp_path)
    assert len(records) == 5
    # Chance is 10% and a loss of ln(10) = 2.30; measured here: 10.8% -> 99.5%, 2.29 -> 0.14.
    assert records[-1]["val_acc"] >= 0.9, records
    assert records[-1]["val_acc"] > records[0]["val_acc"] + 0.5, records
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 1.0, records
    assert "Warning" not in result.stdout + result.stderr, result.stderr
    # rank 0 prints progress lines and one summary per epoch; the other rank prints nothing
    assert result.stdout.count("train_loss") == 5


def write_cifar10_layout(root, per_batch):
    """torchvision's CIFAR-10 layout, as --download leaves it: cifar-10-batches-py/ with five
    training batches, a test batch and the class names, pickled; random pixels, labels 0-9."""
    import pickle

    import numpy
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    generator = numpy.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": generator.integers(0, 256, (per_batch, 3072), dtype=numpy.uint8),
                 "labels": [i % 10 for i in range(per_batch)]}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))


def test_cifar10_in_its_download_layout_trains_on_all_its_images(tmp_path, monkeypatch, capsys):
    # Nothing can be downloaded here: the layout torchvision reads, written by hand. Its files are
    # not the real ones, so torchvision's checksum test is set aside; the scripts' code is all else.
    import torchvision.datasets.cifar as cifar
    from test_validation import load_script
    monkeypatch.setattr(cifar, "check_integrity", lambda *args: True)
    monkeypatch.setattr(cifar.CIFAR10, "_check_integrity", lambda self: True)
    write_cifar10_layout(tmp_path / "data", per_batch=4)
    out_dir = tmp_path / "out"
    status = load_script("single_gpu.py").main(
        ["--data", "cifar10", "--data-dir", str(tmp_path / "data"), "--epochs", "1", "--batch-size", "5",
         "--workers", "0", "--out-dir", str(out_dir)])
    assert status == 0, capsys.readouterr().err
    # 5 batches x 4 training images, 4 test images (the validation set), 10 classes.
    assert "20 train / 4 val" in capsys.readouterr().out
    assert metrics(out_dir)[0]["val_samples"] == 4
    assert weights(out_dir)["classifier.weight"].shape[0] == 10


# A data section that splits its data at random, as users' sections do (random_split on the global
# generator), and writes the held-out indices each process drew.
SPLITTING_SECTION = """
_build_datasets = build_datasets


def build_datasets(args):
    _, held_out = torch.utils.data.random_split(range(100), [0.8, 0.2])
    Path(args.out_dir, f"split{os.environ.get('RANK', 0)}.json").write_text(json.dumps(held_out.indices))
    return _build_datasets(args)

"""


@pytest.mark.slow  # a data section's draws, in all six: second tier, as test_seam.py's copies
@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py",
                                    "ddp_full.py", "fsdp.py"])
def test_a_random_split_in_the_data_section_is_the_same_in_every_process_and_every_run(script, tmp_path):
    # Seeded after the data, each process would split with torch's own seed, which differs between
    # processes and runs: one process would train on another's held-out samples. The seed decides.
    copy = tmp_path / script
    copy.write_text((ROOT / script).read_text().replace('\nif __name__ == "__main__":',
                                                         SPLITTING_SECTION + '\nif __name__ == "__main__":'))
    nproc = None if script in ("single_gpu.py", "dataparallel.py") else 2
    check(launch(str(copy), [*TINY, "--epochs", "1", "--out-dir", str(tmp_path / "run")], nproc=nproc))
    seeded = torch.Generator().manual_seed(0)  # --seed's default
    expected = torch.utils.data.random_split(range(100), [0.8, 0.2], generator=seeded)[1].indices
    drawn = [json.loads(path.read_text()) for path in sorted((tmp_path / "run").glob("split*.json"))]
    assert drawn == [expected] * (nproc or 1)
