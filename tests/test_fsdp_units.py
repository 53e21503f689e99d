"""fsdp.py's units: the modules sharded one by one are those the section "your data and model" names.

The section's shard_units returns them: the CNN's convolutions, and for a torchvision model the
blocks it repeats (find_blocks, also the default of a section written before the hook). The
models are built on the meta device (shapes only), so every family is checked in a second; the
counts are torchvision's architectures (resnet18: 4 stages of 2 residual blocks). What a section
may not return -- a module outside the model, one twice, one inside another, tied weights split
between units -- is one line before any work. Training with the section's units, tied weights
included, is tests/test_seam.py's.
"""
import collections
import subprocess

import pytest
import torch
import torch.nn as nn
import torchvision.models as models

from conftest import TINY
from test_bad_input import assert_one_clear_error
from test_validation import load_script

fsdp = load_script("fsdp.py")


def units_of(name, **kwargs):
    with torch.device("meta"):
        model = models.get_model(name, num_classes=10, **kwargs)
    units = fsdp.units_of(model)
    assert all(len(unit) == 1 for unit in units)  # a module each, none a list
    return [module for module, in units]


FAMILIES = [
    ("resnet18", {"BasicBlock": 8}),
    ("resnet50", {"Bottleneck": 16}),
    ("vit_b_16", {"EncoderBlock": 12}),
    # Not the stem's and the downsampling layers' 10 single layers: they are the root's.
    ("convnext_tiny", {"CNBlock": 18}),
    ("swin_t", {"SwinTransformerBlock": 12, "PatchMerging": 3}),
    # Not the stem's and the last convolution with its norm: containers, searched.
    ("mobilenet_v3_small", {"InvertedResidual": 11}),
    ("efficientnet_b0", {"MBConv": 16}),
    ("densenet121", {"_DenseLayer": 58}),
]


@pytest.mark.parametrize("name, blocks", FAMILIES, ids=[name for name, _ in FAMILIES])
def test_a_torchvision_models_units_are_the_blocks_it_repeats(name, blocks):
    assert collections.Counter(type(unit).__name__ for unit in units_of(name)) == blocks


def test_inception_modules_that_are_attributes_not_in_a_container_are_units_too():
    units = units_of("googlenet", aux_logits=False, init_weights=False)
    # Its 9 Inception modules, and the stem's 3 convolutions with their norms (the same class).
    assert collections.Counter(type(unit).__name__ for unit in units) == {"Inception": 9, "BasicConv2d": 3}


def test_the_cnns_units_are_its_three_convolutions_as_its_section_says():
    model = fsdp.SmallCNN(10)
    assert fsdp.shard_units(model) == [model.features[0], model.features[3], model.features[6]]


def test_a_model_without_blocks_gets_its_layers():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert fsdp.find_blocks(model) == [model[0], model[2], model[4]]


def test_the_layers_a_model_without_blocks_gets_are_the_outermost():
    # Attention holds parameters of its own (in_proj_weight) and a Linear inside it: one unit, not two
    # nested ones, which fully_shard could not take.
    model = nn.ModuleDict({"attention": nn.MultiheadAttention(8, 2), "head": nn.Linear(8, 2)})
    assert fsdp.find_blocks(model) == [model["attention"], model["head"]]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)


class Tied(nn.Module):
    """An embedding and a read-out sharing one tensor (a language model's tie), and two blocks."""

    def __init__(self, tie_in_block=False):
        super().__init__()
        self.embedding = nn.Embedding(6, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.readout = nn.Linear(4, 6, bias=False)
        self.readout.weight = self.embedding.weight
        if tie_in_block:
            self.blocks[1].fc1.weight = self.blocks[0].fc1.weight


def test_default_units_leave_tied_weights_to_the_root():
    model = Tied()
    assert fsdp.find_blocks(model) == [model.blocks[0], model.blocks[1]]
    # Two blocks sharing a tensor: neither is a unit (each would gather its own copy).
    assert fsdp.find_blocks(Tied(tie_in_block=True)) == []


def test_tied_weights_modules_are_one_unit_as_a_list(monkeypatch):
    model = Tied()
    monkeypatch.setattr(fsdp, "shard_units", lambda model: [[model.embedding, model.readout], model.blocks[0]])
    assert fsdp.units_of(model) == [[model.embedding, model.readout], [model.blocks[0]]]


@pytest.mark.parametrize("units, message", [
    (lambda model: [model.readout], "shard_units returned readout, which shares a parameter with "
                                    "embedding.weight outside it (tied weights)"),
    (lambda model: [model.blocks[0], model.blocks[0].fc1], "shard_units returned blocks.0.fc1 inside "
                                                           "blocks.0: units cannot nest"),
    (lambda model: [model.blocks[0], model.blocks[0]], "shard_units returned blocks.0 twice"),
    # The read-out with a block, not with the embedding it is tied to.
    (lambda model: [[model.blocks[0], model.readout]], "shard_units returned blocks.0, readout, which shares a "
                                                       "parameter with embedding.weight outside it"),
    (lambda model: [nn.Linear(4, 4)], "shard_units returned a Linear that is not a module inside the model"),
    (lambda model: [model], "shard_units returned a Tied that is not a module inside the model but the model "
                            "itself, the root, which is always the last unit"),
    (lambda model: None, "shard_units returned a NoneType, not a list of modules"),  # a forgotten return
], ids=["tied", "nested", "twice", "tie-split-in-a-list", "not-in-the-model", "the-root", "no-return"])
def test_units_a_section_may_not_return_are_one_line_naming_them(units, message):
    model = Tied()
    with pytest.raises(fsdp.ConfigError) as error:
        fsdp.check_units(model, units(model))
    assert message in str(error.value)


def test_a_section_returning_nested_units_stops_fsdp_py_with_one_clear_line(tmp_path, capsys):
    module = load_script("fsdp.py")
    module.shard_units = lambda model: [model.features, model.features[0]]
    status = module.main([*TINY, "--out-dir", str(tmp_path)])
    result = subprocess.CompletedProcess(["fsdp.py"], status, *capsys.readouterr())
    assert_one_clear_error(result, "fsdp.py", "shard_units returned features.0 inside features: units cannot nest")
    assert not (tmp_path / "metrics.jsonl").exists()
