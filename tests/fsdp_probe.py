"""Run fsdp.py's main() under torchrun and record what a test cannot see from outside.

    PROBE_DIR=DIR [PROBE_SCRIPT=COPY] torchrun ... tests/fsdp_probe.py ARGS

Each process records, for the number of processes W it runs in and its rank R:
- DIR/samples_w<W>_r<R>.txt: one line "epoch index" per training sample its sampler hands out,
  as the loader takes it (--workers 0 takes indices one batch at a time, so a stopped run records
  only what it trained on);
- DIR/shards_w<W>_r<R>.json: at each checkpoint, the elements of its parameter shards and of its
  optimizer state shards, per parameter name, and each parameter's whole size;
- DIR/restored_w<W>.pt (rank 0): after a resume, the full model and optimizer state as restored,
  gathered from every process's shards;
- DIR/built_w<W>_r<R>.txt: one line per model build_model made, the device its parameters are on
  (meta: shapes only), and "init_weights_from" where that process read --init-from;
- with PROBE_INITIAL=1, DIR/initial_w<W>.pt (rank 0): the model's state as shard_model left it,
  before any training, gathered from every process's shards;
- with PROBE_OPS=1, DIR/ops_w<W>_r<R>.json: over training (train_one_epoch, forward and backward),
  the micro-batches, the dtype casts (aten._to_copy) and BatchNorm's calls by the dtype of their
  input (a float32 input under --amp bf16 is a cast BatchNorm did not need);
- with PROBE_ROOT=1, DIR/root_w<W>_r<R>.json: over training, for each micro-batch, whether FSDP's
  forward root (the state that runs the once-per-forward work, among it the wait for the
  optimizer's writes before the first all-gather) was free when its forward began, which state then
  claimed it (the model's own: "root"), and every claim made during a backward (a recomputed
  block's unit claims it there; unless the end of the backward frees it, the next forward finds it
  taken and skips that work: torch 2.11 does not free it, 2.14 does);
- with PROBE_OVERFLOW=1, an inf planted at the first optimizer step in rank 1's shard of the first
  parameter's gradient alone (where a reduce-scatter leaves an overflow: in one process's shard), and
  DIR/scales_w<W>_r<R>.json: after each step, the GradScaler's scale and whether this process's
  shard of that parameter changed.
Nothing of the script is changed but these records; the script's own code does the work.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# LADDER_ROOT: another copy of the scripts, as in conftest.py (the mutation check's).
ROOT = Path(os.environ.get("LADDER_ROOT") or Path(__file__).resolve().parent.parent)
# PROBE_SCRIPT: a copy of fsdp.py with another section (a test's), else the repository's own.
spec = importlib.util.spec_from_file_location("fsdp", os.environ.get("PROBE_SCRIPT") or ROOT / "fsdp.py")
fsdp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fsdp)  # defines everything, runs nothing
probe_dir = Path(os.environ["PROBE_DIR"])


def where():
    return f"w{dist.get_world_size()}_r{dist.get_rank()}"


sampler_iter = fsdp.ResumableSampler.__iter__


def recording_iter(self):
    with open(probe_dir / f"samples_{where()}.txt", "a") as f:
        for index in sampler_iter(self):
            f.write(f"{self.epoch} {index}\n")
            f.flush()
            yield index


fsdp.ResumableSampler.__iter__ = recording_iter
build_model, init_weights_from = fsdp.build_model, fsdp.init_weights_from


def record_built(line):
    with open(probe_dir / f"built_{where()}.txt", "a") as f:
        f.write(line + "\n")


def recording_build(args, num_outputs):
    model = build_model(args, num_outputs)
    record_built(next(model.parameters()).device.type)
    return model


def recording_init(args, model):
    record_built("init_weights_from")
    return init_weights_from(args, model)


fsdp.build_model, fsdp.init_weights_from = recording_build, recording_init
save_checkpoint = fsdp.save_checkpoint


def recording_save(args, model, optimizer, scheduler, scaler, state):
    names = {id(p): name for name, p in model.named_parameters()}
    record = {"params": {name: p.to_local().numel() for name, p in model.named_parameters()},
              "whole": {name: p.numel() for name, p in model.named_parameters()},
              "optimizer": {names[id(p)]: sum(v.to_local().numel() for v in s.values()
                                              if isinstance(v, torch.Tensor) and v.dim() > 0)
                            for p, s in optimizer.state.items()}}
    (probe_dir / f"shards_{where()}.json").write_text(json.dumps(record))
    return save_checkpoint(args, model, optimizer, scheduler, scaler, state)


fsdp.save_checkpoint = recording_save
restore = fsdp.restore


def recording_restore(checkpoint, path, model, optimizer, *rest):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    state = restore(checkpoint, path, model, optimizer, *rest)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    restored = {"model": get_model_state_dict(model, options=full),
                "optimizer": get_optimizer_state_dict(model, optimizer, options=full)}
    if dist.get_rank() == 0:
        torch.save(restored, probe_dir / f"restored_w{dist.get_world_size()}.pt")
    return state


fsdp.restore = recording_restore


class CountingOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_to_copy":
            self.counts["casts"] += 1
        elif "batch_norm" in name and "backward" not in name:
            key = str(args[0].dtype)
            self.counts["batch_norm_inputs"][key] = self.counts["batch_norm_inputs"].get(key, 0) + 1
        return func(*args, **(kwargs or {}))


if os.environ.get("PROBE_INITIAL"):
    shard_model = fsdp.shard_model

    def recording_shard_model(args, model, *rest):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        units = shard_model(args, model, *rest)
        initial = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save(initial, probe_dir / f"initial_w{dist.get_world_size()}.pt")
        return units

    fsdp.shard_model = recording_shard_model

if os.environ.get("PROBE_OPS"):
    ops = {"micro_batches": 0, "casts": 0, "batch_norm_inputs": {}}
    train_one_epoch, batch_loss = fsdp.train_one_epoch, fsdp.batch_loss

    def counting_batch_loss(model, batch):
        ops["micro_batches"] += 1
        return batch_loss(model, batch)

    def counting_epoch(*args, **kwargs):
        with CountingOps(ops):
            result = train_one_epoch(*args, **kwargs)
        (probe_dir / f"ops_{where()}.json").write_text(json.dumps(ops))
        return result

    fsdp.train_one_epoch, fsdp.batch_loss = counting_epoch, counting_batch_loss
if os.environ.get("PROBE_ROOT"):
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    forwards, in_backward_claims, current = [], [], {}
    root_pre_forward = FSDPState._root_pre_forward

    def recording_root_pre_forward(self, module, args, kwargs):
        if self._state_ctx.iter_forward_root is None and current:
            claimer = "root" if self is current["root"] else type(module).__name__
            (current["record"]["claimed_by"].append if current["in_forward"] else in_backward_claims.append)(claimer)
        return root_pre_forward(self, module, args, kwargs)

    FSDPState._root_pre_forward = recording_root_pre_forward
    train_one_epoch_root, batch_loss_root = fsdp.train_one_epoch, fsdp.batch_loss

    def recording_batch_loss(model, batch):
        state = model._get_fsdp_state()
        current.update(root=state, in_forward=True,
                       record={"free": state._state_ctx.iter_forward_root is None, "claimed_by": []})
        forwards.append(current["record"])
        try:
            return batch_loss_root(model, batch)
        finally:
            current["in_forward"] = False

    def recording_epoch(*args, **kwargs):
        fsdp.batch_loss = recording_batch_loss
        try:
            return train_one_epoch_root(*args, **kwargs)
        finally:
            fsdp.batch_loss = batch_loss_root
            current.clear()
            (probe_dir / f"root_{where()}.json").write_text(json.dumps(
                {"forwards": forwards, "claims_in_backward": in_backward_claims}))

    fsdp.train_one_epoch = recording_epoch
if os.environ.get("PROBE_OVERFLOW"):
    unscale, update = torch.amp.GradScaler.unscale_, torch.amp.GradScaler.update
    steps, before = [], {}

    def planting_unscale(self, optimizer):
        param = optimizer.param_groups[0]["params"][0]
        before["shard"] = param.detach().to_local().clone()
        before["param"] = param
        if not steps and dist.get_rank() == 1:
            param.grad.to_local().view(-1)[0] = float("inf")
        return unscale(self, optimizer)

    def recording_update(self, *args, **kwargs):
        update(self, *args, **kwargs)
        changed = not torch.equal(before["param"].detach().to_local(), before["shard"])
        steps.append({"scale": self.get_scale(), "changed": changed})
        (probe_dir / f"scales_{where()}.json").write_text(json.dumps(steps))

    torch.amp.GradScaler.unscale_, torch.amp.GradScaler.update = planting_unscale, recording_update
sys.exit(fsdp.main(sys.argv[1:]))
