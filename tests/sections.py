"""Sections "your data and model" as users write them, pasted into the scripts by tests/test_sections.py.

Each defines every name the scripts take from the section (TASK_HOOKS), and none of the demo's flags.

LM        a character-level language model: a causal transformer (dropout, blocks in a ModuleList, a
          registered mask buffer, an output layer tied to the embedding); batch_loss returns the mean
          cross-entropy over the batch's tokens and the batch's token count, as an LM author writes it.
LM_SAMPLES the same section counting samples: on fixed-length sequences the same loss, a unit apart.
PADDED    the same model on sequences of varied lengths, padded: targets past a sequence's end are
          -100 (cross_entropy's ignore_index), the loss a mean over the batch's real tokens, the count
          those tokens (a tensor, as `mask.sum()` gives it).
DICTS     batches that are dicts of tensors, a model with a frozen part (an embedding that does not
          train) and a head that only batches holding a rare kind of sample use: DDP needs
          --find-unused-parameters for it.
"""

_LM_MODEL = '''

class Block(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.dropout = nn.Dropout(dropout)
        # Causal: a token attends to itself and the tokens before it (state dicts leave it out).
        self.register_buffer("mask", torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        attended = self.dropout(scores.softmax(dim=-1)) @ v
        x = x + self.dropout(self.out(attended.transpose(1, 2).reshape(batch, length, WIDTH)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class CharModel(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        nn.init.normal_(self.embedding.weight, std=0.02)  # small: it is the output layer too
        self.position = nn.Parameter(torch.zeros(LENGTH, WIDTH))
        self.blocks = nn.ModuleList([Block(dropout) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embedding.weight  # tied, as GPT-2's

    def forward(self, tokens):
        x = self.embedding(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(args, num_outputs):
    return CharModel(args.dropout)


def pretrained_weights(args):
    raise ConfigError("this task has no pretrained weights")


def shard_units(model):
    return list(model.blocks)  # fsdp.py: the tied embedding and head stay the root's


init_weights = None
'''

LM = '''
# --- your data and model ------------------------------------------------------------------------
# A character-level language model: each next character of a noisy counting text.

VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 24, 12, 32, 4, 2
EVAL_METRICS = ("loss",)
RESUME_MAY_CHANGE_TASK = ()


def add_task_arguments(parser):
    parser.add_argument("--sequences", type=int, default=96, help="training sequences (default: 96)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout (default: 0.1)")


def make_text(num_samples, seed):
    """Sequences of LENGTH + 1 characters, each mostly the one after the last, sometimes any."""
    generator = torch.Generator().manual_seed(seed)
    jumps = torch.randint(VOCAB, (num_samples, LENGTH + 1), generator=generator)
    steps = torch.where(torch.rand(num_samples, LENGTH + 1, generator=generator) < 0.8, 1, jumps)
    tokens = steps.cumsum(dim=1) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def build_datasets(args):
    return (TensorDataset(*make_text(args.sequences, 2 * args.seed + 1)),
            TensorDataset(*make_text(37, 2 * args.seed + 2)), VOCAB)
''' + _LM_MODEL + '''

def batch_loss(model, batch):
    tokens, targets = batch
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())  # the mean over tokens
    return loss, targets.numel()


def evaluate_batch(model, batch):
    tokens, targets = batch
    loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten(), reduction="sum")
    return torch.stack([loss.double()]), targets.numel()
'''

LM_SAMPLES = LM.replace("    return loss, targets.numel()\n", "    return loss, len(targets)\n", 1)
assert LM_SAMPLES != LM

PADDED = LM.replace('''
def build_datasets(args):
    return (TensorDataset(*make_text(args.sequences, 2 * args.seed + 1)),
            TensorDataset(*make_text(37, 2 * args.seed + 2)), VOCAB)
''', '''
def padded(tokens, targets, seed):
    """Each sequence cut to a length of its own (4 to LENGTH), padded: token 0, target -100."""
    lengths = torch.randint(4, LENGTH + 1, (len(tokens), 1), generator=torch.Generator().manual_seed(seed))
    past_end = torch.arange(LENGTH) >= lengths
    return TensorDataset(tokens.masked_fill(past_end, 0), targets.masked_fill(past_end, -100))


def build_datasets(args):
    return (padded(*make_text(args.sequences, 2 * args.seed + 1), 7),
            padded(*make_text(37, 2 * args.seed + 2), 8), VOCAB)
''', 1).replace('''
def batch_loss(model, batch):
    tokens, targets = batch
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())  # the mean over tokens
    return loss, targets.numel()
''', '''
def batch_loss(model, batch):
    tokens, targets = batch
    # The mean over the batch's real tokens (cross_entropy leaves out the targets -100), and their count.
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    return loss, (targets != -100).sum()
''', 1).replace("    return torch.stack([loss.double()]), targets.numel()\n",
                "    return torch.stack([loss.double()]), (targets != -100).sum()\n", 1)
assert PADDED.count("-100") == 5, PADDED.count("-100")

DICTS = '''
# --- your data and model ------------------------------------------------------------------------
# Readings as dicts of tensors, a frozen embedding of each reading's sensor, and an alarm head that
# only the rare readings marked as alarms train (many batches have none).

SENSORS, FEATURES = 12, 6
EVAL_METRICS = ("loss",)
RESUME_MAY_CHANGE_TASK = ()


def add_task_arguments(parser):
    parser.add_argument("--readings", type=int, default=96, help="training readings (default: 96)")


class Readings(torch.utils.data.Dataset):
    def __init__(self, num_samples, seed):
        generator = torch.Generator().manual_seed(seed)
        self.sensor = torch.randint(SENSORS, (num_samples,), generator=generator)
        self.values = torch.randn(num_samples, FEATURES, generator=generator)
        self.alarm = torch.rand(num_samples, generator=generator) < 0.05
        self.target = self.values.sum(dim=1, keepdim=True).tanh() + 0.1 * self.sensor[:, None]

    def __len__(self):
        return len(self.sensor)

    def __getitem__(self, index):
        return {"sensor": self.sensor[index], "values": self.values[index], "alarm": self.alarm[index],
                "target": self.target[index]}


def build_datasets(args):
    return Readings(args.readings, 2 * args.seed + 1), Readings(37, 2 * args.seed + 2), 1


class Model(nn.Module):
    def __init__(self, num_outputs):
        super().__init__()
        self.sensors = nn.Embedding(SENSORS, 4)
        self.sensors.weight.requires_grad_(False)  # frozen: a fixed embedding of each sensor
        self.body = nn.Sequential(nn.Linear(FEATURES + 4, 32), nn.Tanh(), nn.Linear(32, num_outputs))
        self.alarm_head = nn.Linear(FEATURES, 1)

    def forward(self, batch):
        features = torch.cat([batch["values"], self.sensors(batch["sensor"])], dim=1)
        alarms = batch["alarm"]
        # The alarm head scores the alarms alone: a batch holding none leaves it out of the step.
        alarm_scores = self.alarm_head(batch["values"][alarms]).squeeze(1) if alarms.any() else None
        return self.body(features), alarm_scores


def build_model(args, num_outputs):
    return Model(num_outputs)


def pretrained_weights(args):
    raise ConfigError("this task has no pretrained weights")


def shard_units(model):
    return [model.body]


init_weights = None


def batch_loss(model, batch):
    predictions, alarm_scores = model(batch)
    squared = F.mse_loss(predictions, batch["target"], reduction="none").sum(dim=1)
    if alarm_scores is not None:
        squared[batch["alarm"]] += (alarm_scores - 1).square()
    return squared.mean(), len(squared)


def evaluate_batch(model, batch):
    squared = F.mse_loss(model(batch)[0].float(), batch["target"], reduction="sum")
    return torch.stack([squared.double()]), len(batch["target"])
'''

# The form FSDP2 needs: every process runs every parameter in every step (a parameter that some
# process leaves out makes it reduce-scatter other sizes there: gloo aborts, pytorch#158719), here
# the alarm head on the batch's alarms, none or some: an empty selection still gives it a gradient.
DICTS_EVERY_STEP = DICTS.replace(
    '''        alarm_scores = self.alarm_head(batch["values"][alarms]).squeeze(1) if alarms.any() else None
''', '''        alarm_scores = self.alarm_head(batch["values"][alarms]).squeeze(1)
''', 1)
assert DICTS_EVERY_STEP != DICTS
