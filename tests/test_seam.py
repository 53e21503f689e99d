"""A user who copies a script replaces its section "your data and model" and nothing else.

Each script is copied with that section swapped for the one docs/your-task.md shows whole, a task
unlike the demo -- token sequences
(int64) through an embedding, a regression target, mean squared error and mean absolute error,
none of the demo's flags, a buffer that state dicts leave out -- and the harness's core claims
are checked on the copies: single_gpu.py and dataparallel.py train what one DDP process trains;
one process trains what DDP on 2 processes trains; accumulation
all-reduces once per optimizer step; sharded validation equals a one-process evaluation; a run
stopped and resumed ends bitwise equal to one never stopped. The machinery outside the section does
not depend on images or classes. The section defines every name the scripts take from it
(ddp_full.py and fsdp.py check that at start-up).

Tolerances are test_equivalence.py's and test_validation.py's: float32 sums split differently
(measured here after 16 steps: max weight difference 7.5e-8 for 2 processes, 1.2e-7 with
accumulation; validation metrics within 2.2e-8, relative, of the one-process evaluation).
"""
import importlib.util
import json
import re
import sys

import pytest
import torch

from conftest import ROOT, check, launch, max_weight_difference, metrics, weights
from test_equivalence import LOSS_ATOL, WEIGHT_ATOL
from test_resume import assert_bitwise_equal
from test_validation import VAL_LOSS_RTOL

sys.path.insert(0, str(ROOT / "tools"))
import ladder  # noqa: E402

pytestmark = pytest.mark.slow  # the second tier: python -m pytest -n 2 -m slow tests



def section_on_the_page():
    """The whole section docs/your-task.md shows, under its heading "A whole section for another
    task": read from the page, so that what a reader copies is what the suite runs."""
    page = (ROOT / "docs" / "your-task.md").read_text()
    part = page[page.index("## A whole section for another task"):]
    return "\n" + re.search(r"```python\n(.*?)```", part, re.S).group(1)


SEAM = section_on_the_page()
# 256 sequences, 2 epochs: global batch 32 (1 x 32, 2 x 16, 2 x 8 x 2 micro-batches): 16 steps.
ARGS = ["--epochs", "2", "--log-interval", "1000", "--lr", "0.2"]
DDP_SCRIPTS = ["ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"]
COPIED = ["single_gpu.py", "dataparallel.py", *DDP_SCRIPTS]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The scripts with only their seam replaced, as a user's copies."""
    folder = tmp_path_factory.mktemp("copies")
    for name in COPIED:
        (folder / name).write_text(ladder.replace_seam(ladder.read(name, ROOT), SEAM))
    (folder / "count_allreduces.py").write_text((ROOT / "tests" / "count_allreduces.py").read_text())
    return folder


def run(copies, runs, name, script, args, nproc, **kwargs):
    return runs.get(name, str(copies / script), [*ARGS, *args], nproc=nproc, tiny=False, **kwargs)


@pytest.mark.parametrize("script", COPIED)
def test_only_the_seam_differs_and_no_demo_flag_is_left(copies, script):
    original, copy = ladder.regions(ladder.read(script, ROOT)), ladder.regions((copies / script).read_text())
    seam = set(ladder.regions(SEAM.replace("# --- your", "x = 0\n# --- your", 1))) - {"x"}
    for name in original.keys() & copy.keys() - seam:
        assert ladder.normalize(original[name]) == ladder.normalize(copy[name]), name
    flags = set(ladder.flags((copies / script).read_text()))
    assert not flags & {"--data", "--data-dir", "--download", "--image-size", "--model", "--train-samples"}


def test_one_process_trains_what_ddp_on_two_trains(copies, runs):
    one = run(copies, runs, "seam_basic_w1", "ddp_basic.py", ["--batch-size", "32"], None)
    two = run(copies, runs, "seam_basic_w2", "ddp_basic.py", ["--batch-size", "16"], 2)
    assert max_weight_difference(weights(one), weights(two)) <= WEIGHT_ATOL
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_ATOL and a["val_samples"] == b["val_samples"] == 101
    assert metrics(one)[-1]["train_loss"] < metrics(one)[0]["train_loss"]  # it learns


@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py"])
def test_the_one_device_copies_train_what_one_ddp_process_trains(copies, runs, script):
    # The same seed, batches and steps: DDP on one process adds no arithmetic (DataParallel on a
    # CPU calls the model itself).
    one = run(copies, runs, "seam_basic_w1", "ddp_basic.py", ["--batch-size", "32"], None)
    copy = run(copies, runs, f"seam_{script.removesuffix('.py')}", script, ["--batch-size", "32"], None)
    assert max_weight_difference(weights(one), weights(copy)) <= WEIGHT_ATOL
    assert [r["val_samples"] for r in metrics(copy)] == [101, 101]


def test_accumulation_all_reduces_once_per_step_and_matches_one_process(copies, runs):
    one = run(copies, runs, "seam_basic_w1", "ddp_basic.py", ["--batch-size", "32"], None)
    counts = runs.root / "seam_accum_counts"
    accum = run(copies, runs, "seam_accum_w2", "count_allreduces.py", ["--batch-size", "8", "--accum-steps", "2"], 2,
                env={"COUNT_SCRIPT": str(copies / "ddp_amp_accum.py"), "COUNT_DIR": str(counts)})
    for rank in (0, 1):
        assert json.loads((counts / f"rank{rank}.json").read_text())["reductions"] == 16
    assert max_weight_difference(weights(one), weights(accum)) <= WEIGHT_ATOL


def test_sharded_validation_equals_a_one_process_evaluation(copies, runs):
    out_dir = run(copies, runs, "seam_full_w2", "ddp_full.py", ["--batch-size", "16"], 2)
    spec = importlib.util.spec_from_file_location("seam_copy", copies / "ddp_full.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokens, targets = module.make_sequences(101, 2).tensors
    model = module.BagOfTokens(1)
    model.load_state_dict(weights(out_dir))
    with torch.no_grad():
        predictions = model(tokens).double()
    last = metrics(out_dir)[-1]
    assert last["val_samples"] == 101
    assert last["val_loss"] == pytest.approx(((predictions - targets) ** 2).mean().item(), rel=VAL_LOSS_RTOL)
    assert last["val_mae"] == pytest.approx((predictions - targets).abs().mean().item(), rel=VAL_LOSS_RTOL)


def test_stopped_and_resumed_run_is_bitwise_a_straight_one(copies, runs, tmp_path):
    straight = run(copies, runs, "seam_full_w2", "ddp_full.py", ["--batch-size", "16"], 2)
    stopped = [*ARGS, "--batch-size", "16", "--out-dir", str(tmp_path)]
    assert "stopped after --max-steps 5" in check(launch(str(copies / "ddp_full.py"), [*stopped, "--max-steps", "5"],
                                                         nproc=2)).stdout
    resumed = check(launch(str(copies / "ddp_full.py"), stopped, nproc=2))
    assert "step_000000005.pt: step 5 of epoch 1" in resumed.stdout
    assert_bitwise_equal(straight, tmp_path)


def test_fsdp_copy_trains_what_one_process_trains_and_validates_exactly(copies, runs):
    # Token ids (int64) through an embedding: FSDP's policy casts floating inputs only.
    one = run(copies, runs, "seam_basic_w1", "ddp_basic.py", ["--batch-size", "32"], None)
    out_dir = run(copies, runs, "seam_fsdp_w2", "fsdp.py", ["--batch-size", "8", "--accum-steps", "2"], 2)
    assert max_weight_difference(weights(one), weights(out_dir)) <= WEIGHT_ATOL
    spec = importlib.util.spec_from_file_location("seam_fsdp_copy", copies / "fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokens, targets = module.make_sequences(101, 2).tensors
    model = module.BagOfTokens(1)
    model.load_state_dict(weights(out_dir))
    with torch.no_grad():
        predictions = model(tokens).double()
    last = metrics(out_dir)[-1]
    assert last["val_samples"] == 101
    assert last["val_loss"] == pytest.approx(((predictions - targets) ** 2).mean().item(), rel=VAL_LOSS_RTOL)


# The same task through a model with blocks and a read-out tied to its embedding (a language model's
# tie), whose section names its units: the tied pair as one unit (a list), not the two blocks the
# default finds, so the start-up line ("FSDP: N units", the root counted) tells whose were sharded.
TIED_MODEL = '''

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TiedTokens(nn.Module):
    def __init__(self, num_outputs):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.readout = nn.Linear(16, VOCAB, bias=False)
        self.readout.weight = self.embedding.weight  # tied: one tensor, two modules
        self.head = nn.Linear(VOCAB, num_outputs)

    def forward(self, tokens):
        x = self.embedding(tokens).mean(dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.readout(x).softmax(dim=1))  # a language model's next-token probabilities


def build_model(args, num_outputs):  # this model in the demo task's place
    return TiedTokens(num_outputs)
'''
NAMED_UNITS = '''

def shard_units(model):
    return [[model.embedding, model.readout]]
'''


@pytest.mark.parametrize("section, units", [(TIED_MODEL + NAMED_UNITS, 2), (TIED_MODEL, 3)],
                         ids=["named-by-the-section", "found-by-default"])
def test_fsdp_copy_shards_the_units_its_section_names_tied_weights_in_the_root(tmp_path, section, units):
    # Units: the section's tied pair, gathered as one, or by default both blocks, the tied pair the
    # root's; either way the copy trains what one process trains.
    for script in ("ddp_basic.py", "fsdp.py"):
        (tmp_path / script).write_text(ladder.replace_seam(ladder.read(script, ROOT), SEAM + section))
    check(launch(str(tmp_path / "ddp_basic.py"), [*ARGS, "--batch-size", "32", "--out-dir",
                                                     str(tmp_path / "one")]))
    two = check(launch(str(tmp_path / "fsdp.py"), [*ARGS, "--batch-size", "16", "--out-dir", str(tmp_path / "two")],
                       nproc=2))
    assert f"FSDP: {units} units" in two.stdout
    assert max_weight_difference(weights(tmp_path / "one"), weights(tmp_path / "two")) <= WEIGHT_ATOL
    assert metrics(tmp_path / "two")[-1]["train_loss"] < metrics(tmp_path / "two")[0]["train_loss"]


# A whole section of another kind: a small causal transformer that predicts each next token of
# arithmetic sequences. Its blocks are fsdp.py's units (test_compile.py compiles them one by one).
TRANSFORMER = '''
# --- your data and model ------------------------------------------------------------------------
# A small causal transformer: each next token of arithmetic sequences, from the tokens before it.

VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 32, 16, 32, 4, 4
EVAL_METRICS = ("loss",)
RESUME_MAY_CHANGE_TASK = ()


def add_task_arguments(parser):
    parser.add_argument("--sequences", type=int, default=128, help="training sequences (default: 128)")


def make_sequences(num_samples, seed):
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB, (num_samples, 1), generator=generator)
    step = torch.randint(1, 4, (num_samples, 1), generator=generator)
    tokens = (start + step * torch.arange(LENGTH + 1)) % VOCAB  # arithmetic sequences
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build_datasets(args):
    return make_sequences(args.sequences, 2 * args.seed + 1), make_sequences(37, 2 * args.seed + 2), VOCAB


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, WIDTH // HEADS).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embedding = nn.Embedding(vocab, WIDTH)
        self.position = nn.Parameter(torch.zeros(LENGTH, WIDTH))
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, vocab)

    def forward(self, tokens):
        x = self.embedding(tokens) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(args, num_outputs):
    return TinyTransformer(num_outputs)


def pretrained_weights(args):
    raise ConfigError("this task has no pretrained weights")


def shard_units(model):
    return list(model.blocks)


init_weights = None


def batch_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()), len(targets)


def evaluate_batch(model, batch):
    tokens, targets = batch
    loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten(), reduction="sum")
    return torch.stack([loss.double() / LENGTH]), len(targets)
'''


# The section's init_weights: every layer's own initialisation and the buffer state dicts leave out,
# set by each process on its own shards.
OWN_INIT = '''
def init_weights(model):
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model.position_weights.copy_(torch.linspace(0.5, 1.5, LENGTH)[:, None])
'''


def test_fsdp_copy_with_init_weights_starts_from_an_init_from_file_building_nothing_whole(copies, runs, tmp_path):
    # Starting from a file, the model's values come from it (rank 0 reads it into the shards) and
    # the buffer the file lacks from init_weights: no process builds the model, and the first
    # validation scores the file's weights as the run that wrote them did.
    source = run(copies, runs, "seam_basic_w1", "ddp_basic.py", ["--batch-size", "32"], None)
    copy = tmp_path / "fsdp.py"
    copy.write_text((copies / "fsdp.py").read_text().replace(
        "\ninit_weights = None  # fsdp.py: rank 0 builds the model's values (build_model); no other script reads it\n",
        OWN_INIT, 1))
    assert "def init_weights(model):" in copy.read_text()
    probe_dir, out_dir = tmp_path / "probe", tmp_path / "run"
    probe_dir.mkdir()
    check(launch("tests/fsdp_probe.py", [*ARGS, "--batch-size", "16", "--max-steps", "1", "--init-from",
                                         str(source / "model.pt"), "--out-dir", str(out_dir)], nproc=2,
                 env={"PROBE_DIR": str(probe_dir), "PROBE_SCRIPT": str(copy)}))
    built = {r: (probe_dir / f"built_w2_r{r}.txt").read_text().split() for r in (0, 1)}
    assert [line for line in built[0] if line != "meta"] == ["init_weights_from"] and set(built[1]) == {"meta"}, built
    start, last = metrics(out_dir)[0], metrics(source)[-1]
    assert start["epoch"] == 0 and start["val_samples"] == last["val_samples"] == 101
    assert start["val_loss"] == pytest.approx(last["val_loss"], rel=VAL_LOSS_RTOL)
