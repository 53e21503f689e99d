"""The CUDA branches, checked on a CPU with stand-ins: what the GPU check confirms on a GPU.

The suite itself runs on the CPU even on a GPU machine (conftest.py hides the GPUs): a test that
needs a GPU's behaviour reproduces it here, with the meta device standing in for a device other
than the CPU, or by replaying what torch does on GPUs (DataParallel's chunking).
"""
import argparse
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import base_env, TINY
from test_static import SCRIPTS
from test_validation import load_script


def test_the_suite_hides_gpus_from_itself_and_from_every_launch():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available()
    probe = "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.device_count())"
    result = subprocess.run([sys.executable, "-c", probe], env=base_env(), capture_output=True, text=True)
    assert result.stdout.split() == ["''", "0"], result.stdout + result.stderr


def test_a_checkpoint_restores_onto_another_device_than_the_cpu(runs, monkeypatch):
    # A GPU run restores into a model on its GPU, with device=cuda. Random states can only be set
    # from CPU byte tensors (check_rng_state in ATen's Generator.h): loading the file with
    # map_location=<the device> breaks every resume on a GPU with "RNG state must be a
    # torch.ByteTensor". The meta device stands in for the GPU: a model, an optimizer and a device
    # that are not the CPU.
    module = load_script("ddp_full.py")
    out_dir = runs.get("full_w2", "ddp_full.py", ["--batch-size", "8"], nproc=2)
    path = out_dir / "checkpoints" / "step_000000012.pt"
    args = module.parse_args([*TINY, "--batch-size", "8", "--out-dir", str(out_dir)])
    args.accum_steps = module.accum_steps_for(args, 2)  # decided in train(), as the world is known
    meta = torch.device("meta")
    model = module.build_model(args, module.NUM_SYNTHETIC_CLASSES).to(meta)
    optimizer = module.build_optimizer(args, model)
    scheduler = module.build_scheduler(args, optimizer, steps_per_epoch=12)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    checkpoint = module.load_checkpoint(path, args)
    monkeypatch.setattr(module.dist, "get_world_size", lambda: 2)  # rank 1 of the 2 that wrote it
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "copying from a non-meta parameter ... is a no-op"
        state = module.restore(checkpoint, path, model, optimizer, scheduler, scaler, rank=1)
        assert torch.equal(torch.get_rng_state(), checkpoint["rank_states"][1]["rng"]["torch"])
    # The epoch's partial sums stay as loaded: train_one_epoch adds them, .to(device), to its own.
    assert state.train_totals.device == torch.device("cpu")
    assert optimizer.state[model.classifier.weight]["momentum_buffer"].device == meta


def test_dataparallel_never_gives_a_gpu_a_single_sample():
    # DataParallel scatters a batch with torch.chunk (comm.scatter, no chunk sizes given), one
    # chunk per GPU. BatchNorm cannot train on one sample ("Expected more than 1 value per
    # channel"). CIFAR-10's 50,000 samples at batch 64 leave a last batch of 16: on 6 GPUs that is
    # 3,3,3,3,3,1. Replayed here for the batches dataparallel.py's loader makes, on 2 to 8 GPUs.
    module = load_script("dataparallel.py")
    args = module.parse_args(["--batch-size", "64"])
    cifar_sized = TensorDataset(torch.zeros(50_000, 1))
    loader, _ = module.build_loaders(args, cifar_sized, cifar_sized, torch.device("cpu"))
    sizes = {len(batch) for batch in loader.batch_sampler}
    for gpus in range(2, 9):
        for size in sizes:
            chunks = [len(chunk) for chunk in torch.empty(size).chunk(gpus)]
            assert min(chunks) >= 2, (size, gpus, chunks)


def test_batchnorm_really_fails_on_a_chunk_of_one_sample():
    # The premise of the replay above, with the scripts' resnet18 at 32 pixels (1x1 at the end).
    module = load_script("dataparallel.py")
    model = module.build_model(module.parse_args(["--model", "resnet18"]), 10).train()
    try:
        model(torch.zeros(1, 3, 32, 32))
    except ValueError as err:
        assert "Expected more than 1 value per channel" in str(err)
    else:
        raise AssertionError("BatchNorm trained on one sample")


def test_pinned_memory_keeps_the_batch_and_its_unreadable_files_apart(monkeypatch):
    # On CUDA the loaders pin each batch (pin_memory=True), and torch's pin_memory rebuilds the
    # structure it is given: the (batch, unreadable files) pair of collate_readable must come out
    # as it went in -- a tuple, the file names as strings, a batch of nothing as None. CPU stand-in:
    # torch's own pin_memory with Tensor.pin_memory made the identity (pinning needs a GPU).
    from torch.utils.data._utils.pin_memory import pin_memory

    module = load_script("ddp_full.py")
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    items = [((torch.ones(3, 4, 4), torch.tensor(1)), []), (None, ["a.png (broken)"]),
             ((torch.zeros(3, 4, 4), torch.tensor(2)), [])]
    (images, labels), unreadable = pin_memory(module.collate_readable(items))
    assert images.shape == (2, 3, 4, 4) and labels.tolist() == [1, 2] and unreadable == ["a.png (broken)"]
    batch, unreadable = pin_memory(module.collate_readable([(None, ["b.png (broken)"])]))
    assert batch is None and unreadable == ["b.png (broken)"]


class ParameterOnAGpu(torch.nn.Parameter):
    """A parameter that says it is on a GPU: what build_optimizer reads to choose AdamW's kernel."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("script", SCRIPTS)
def test_adamw_is_fused_on_gpus_and_foreach_elsewhere(monkeypatch, script):
    # fused=True: one kernel updates every parameter on CUDA (torchtitan's default, DTensors too).
    # Elsewhere AdamW's default, foreach: fused on a CPU is another kernel than the suite measures.
    chosen = []
    monkeypatch.setattr(torch.optim, "AdamW", lambda groups, **kwargs: chosen.append(kwargs["fused"]))
    module, args = load_script(script), argparse.Namespace(optimizer="adamw", lr=1e-3, weight_decay=0.05)
    for parameter in (torch.nn.Parameter, ParameterOnAGpu):
        module.build_optimizer(args, torch.nn.ParameterList([parameter(torch.zeros(2, 2)), parameter(torch.zeros(2))]))
    assert chosen == [False, True]


@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_deterministic_sets_cublas_cudnn_and_torch_to_their_deterministic_kernels(script, monkeypatch):
    # What --deterministic sets before any CUDA work, read back on the CPU (configure_cuda runs the
    # same lines on both); a resume must keep it, as it changes the arithmetic.
    module = load_script(script)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        args = module.parse_args(["--deterministic"])
        module.configure_cuda(args, torch.device("cpu"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert "deterministic" not in module.RESUME_MAY_CHANGE
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved[2:]


@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_deterministic_on_cuda_gives_attention_its_math_kernel_and_leaves_the_cpus_alone(script):
    # Under warn_only, the fused attention kernels' backwards (flash, memory-efficient, cuDNN) only
    # warn and sum in any order (ATen's attention_backward.cu): on CUDA --deterministic turns them
    # off, leaving the math kernel (matmuls and softmax). The same switch turns CPU's flash kernel
    # off (sdp_utils_cpp.cpp), deterministic already: on the CPU nothing changes.
    module = load_script(script)
    sdp = torch.backends.cuda
    switches = {"flash": sdp.enable_flash_sdp, "mem_efficient": sdp.enable_mem_efficient_sdp,
                "cudnn": sdp.enable_cudnn_sdp, "math": sdp.enable_math_sdp}
    state = {"flash": sdp.flash_sdp_enabled, "mem_efficient": sdp.mem_efficient_sdp_enabled,
             "cudnn": sdp.cudnn_sdp_enabled, "math": sdp.math_sdp_enabled}
    saved = ({name: read() for name, read in state.items()}, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        module.configure_cuda(module.parse_args(["--deterministic"]), torch.device("cpu"))
        assert {name: read() for name, read in state.items()} == dict.fromkeys(state, True)
        module.configure_cuda(module.parse_args(["--deterministic"]), torch.device("cuda", 0))
        assert {name: read() for name, read in state.items()} == {
            "flash": False, "mem_efficient": False, "cudnn": False, "math": True}
        for switch in switches.values():
            switch(True)
        module.configure_cuda(module.parse_args([]), torch.device("cuda", 0))  # without the flag: the fast ones
        assert {name: read() for name, read in state.items()} == dict.fromkeys(state, True)
    finally:
        for name, switch in switches.items():
            switch(saved[0][name])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved[3:]


FLIGHT_RECORDER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


@pytest.mark.parametrize("script", ["ddp_full.py", "fsdp.py"])
def test_the_flight_recorder_dumps_into_the_out_dir_on_cuda_and_keeps_what_the_user_set(script, monkeypatch,
                                                                                     tmp_path):
    # What setup_distributed sets on CUDA before the group starts, by torch's names: TORCH_FR_* from
    # 2.11 on (the recorder on by default), TORCH_NCCL_* before (off by default: turned on).
    module = load_script(script)
    args = module.parse_args(["--out-dir", str(tmp_path)])
    dump = str(tmp_path.resolve() / "nccl_trace_rank_")

    def set_by(version, **user):
        for name in FLIGHT_RECORDER:
            monkeypatch.delenv(name, raising=False)
        for name, value in user.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch, "__version__", version)
        module.flight_recorder(args)
        return {name: os.environ[name] for name in FLIGHT_RECORDER if name in os.environ}

    assert set_by("2.14.1+cu130") == {"TORCH_FR_DUMP_TEMP_FILE": dump}
    assert set_by("2.11.0") == {"TORCH_FR_DUMP_TEMP_FILE": dump}
    assert set_by("2.4.1") == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                               "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}
    # The user's own settings, by either name, stay as they are.
    assert set_by("2.14.1", TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/scratch/fr_") == {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}
    assert set_by("2.4.1", TORCH_NCCL_TRACE_BUFFER_SIZE="0") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}
