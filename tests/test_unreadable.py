"""A file that cannot be read is one warning naming it, from the process that met it, and the run
goes on: nothing is lost, and every exactness promise still holds.

The generated image tree with one training PNG truncated to 40 bytes (what a broken copy leaves;
PIL cannot identify it), another whose second image-data chunk has a garbled type (PIL opens it,
then raises SyntaxError "broken PNG file" as it decodes), and one validation PNG emptied (ddp_full.py,
where unreadable files are handled). In training, ReadableSamples gives an unreadable sample's place
to the next readable one in index order, loaded with the key's seed (SeededSamples): the same choice
in every process, worker and resume, so ddp_full as a world of one on the global batch still trains
what it trains on 2 (test_equivalence.py's tolerances). In validation the sample is left out, never replaced (a stand-in
would count another sample twice): 8 of 9 images scored. Both are counted in metrics.jsonl
(train_unreadable, val_unreadable) and on a line after the epoch's.
"""
import fcntl
import re
import shutil
import struct
import zlib

import pytest

from conftest import CLASSES, IMAGEFOLDER, check, launch, metrics, script_traceback
from test_equivalence import assert_same_training
from test_resume import assert_bitwise_equal

TRAIN_BROKEN = ("train", CLASSES[1], "3.png")
TRAIN_GARBLED = ("train", CLASSES[2], "5.png")
VAL_BROKEN = ("val", CLASSES[0], "1.png")


def garble(path):
    """Split the PNG's image data in two chunks, then garble the second one's type."""
    data = path.read_bytes()
    start = data.index(b"IDAT") - 4
    length = struct.unpack(">I", data[start:start + 4])[0]
    payload, rest = data[start + 8:start + 8 + length], data[start + 12 + length:]

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    half = len(payload) // 2
    path.write_bytes(data[:start] + chunk(b"IDAT", payload[:half]) + chunk(b"\x01\x02\x03\x04", payload[half:])
                     + rest)


@pytest.fixture(scope="session")
def broken_tree(runs, image_tree):
    root = runs.root / "broken_images"
    with open(runs.root / "broken_images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (runs.root / "broken_images.done").exists():
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(image_tree, root)
            train_file = root.joinpath(*TRAIN_BROKEN)
            train_file.write_bytes(train_file.read_bytes()[:40])
            garble(root.joinpath(*TRAIN_GARBLED))
            root.joinpath(*VAL_BROKEN).write_bytes(b"")
            (runs.root / "broken_images.done").touch()
    return root


def broken_args(tree, workers):
    return [*IMAGEFOLDER, "--data-dir", str(tree), "--workers", str(workers)]


def warnings_naming(result, parts):
    path = "/".join(parts)
    return [line for line in result.stderr.splitlines() if "warning:" in line and path in line]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreadable_image_is_named_skipped_and_counted_and_ddp_still_equals_one_process(
        broken_tree, tmp_path, workers):
    args = broken_args(broken_tree, workers)
    single = check(launch("ddp_full.py", [*args, "--batch-size", "8", "--out-dir", str(tmp_path / "single")]))
    ddp = check(launch("ddp_full.py", [*args, "--out-dir", str(tmp_path / "ddp")], nproc=2))
    for result in (single, ddp):
        assert script_traceback(result, "ddp_full.py") == []
        # Once an epoch each (2 epochs), from the one process whose shard holds the file, named.
        for parts, outcome in ((TRAIN_BROKEN, "trained on the next readable sample in its place"),
                               (TRAIN_GARBLED, "trained on the next readable sample in its place"),
                               (VAL_BROKEN, "left out of validation")):
            lines = warnings_naming(result, parts)
            assert len(lines) == 2 and all(line.endswith(outcome) for line in lines), result.stderr
            assert all(re.match(r"ddp_full\.py: warning: rank [01]: cannot read ", line) for line in lines), lines
        assert "broken PNG file" in warnings_naming(result, TRAIN_GARBLED)[0]  # PIL's SyntaxError
        assert [result.stdout.count(f"epoch {epoch}: unreadable files skipped: 3") for epoch in (1, 2)] == [1, 1]
    for record in metrics(tmp_path / "single") + metrics(tmp_path / "ddp"):
        assert (record["train_unreadable"], record["val_unreadable"], record["val_samples"]) == (2, 1, 8)
    assert_same_training(tmp_path / "single", tmp_path / "ddp")


@pytest.mark.slow
def test_resume_past_an_unreadable_image_with_workers_is_bitwise(broken_tree, tmp_path):
    # 2 processes x 4 of 24 images: 3 optimizer steps an epoch; stopped mid-epoch 1, then finished.
    args = broken_args(broken_tree, 2)
    check(launch("ddp_full.py", [*args, "--out-dir", str(tmp_path / "straight")], nproc=2))
    check(launch("ddp_full.py", [*args, "--max-steps", "2", "--out-dir", str(tmp_path / "resumed")], nproc=2))
    check(launch("ddp_full.py", [*args, "--out-dir", str(tmp_path / "resumed")], nproc=2))
    assert_bitwise_equal(tmp_path / "straight", tmp_path / "resumed")


def test_a_data_set_none_of_whose_first_images_can_be_read_is_one_error_line(image_tree, tmp_path):
    tree = tmp_path / "unreadable"
    shutil.copytree(image_tree, tree)
    for image in tree.rglob("*.png"):
        image.write_bytes(b"")
    result = launch("ddp_full.py", [*broken_args(tree, 0), "--out-dir", str(tmp_path / "out")])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "the data cannot be read: 17 samples in a row cannot be read" in errors[0], \
        result.stderr
    assert script_traceback(result, "ddp_full.py") == []
