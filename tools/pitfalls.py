"""The pitfalls the ladder fixes: the pitfall guide (docs/pitfalls.md, written by make_diffs.py) and
the mutations that tools/mutation_check.py puts back to show that each guard fails.

fix: (script, a string found on exactly one line of it) -- the line the guide links to.
guards: pytest node ids that must fail once `mutation` (script, old text, new text) is applied.
"""

# The section "What the scripts get right, and why" of docs/pitfalls.md, as markdown (links relative
# to docs/): make_diffs.py writes it above the numbered pitfalls.
WHY = """\
The tutorials these scripts grew from carry common mistakes, and GPUs, BatchNorm and clusters add
more. Each is fixed here and guarded by a test; [The pitfalls, one by one](#the-pitfalls-one-by-one)
lists them all, each with its mutation-checked guard.

- **Same data order in every configuration.** The shuffle is a pure function of (seed, epoch):
  `single_gpu.py` reseeds its sampler's generator each epoch; the DDP scripts call
  `DistributedSampler.set_epoch(epoch)`. Without `set_epoch` every epoch repeats epoch 0's order.
- **Validation is exact.** Losses are summed per sample and divided by the sample count — never a
  mean of batch means. `ddp_basic.py` validates on rank 0 alone through `model.module` (the DDP
  wrapper's forward would start a buffer broadcast that the other ranks never join: a hang).
  `ddp_full.py` gives each rank an unpadded shard (`DistributedSampler` pads with repeats, which
  would be counted) and all-reduces the sums and the count once after the loop.
- **A file that cannot be read costs one warning, not the run.** Real image folders hold truncated
  and corrupt files; left alone, one ends the run in a DataLoader worker's traceback, the other
  processes die on a closed connection, and everything since the last checkpoint is lost. Stopping
  with a checkpoint instead would need every process to agree before the forward of the batch that
  holds the file, a collective per batch ahead of the one the preemption check already runs; and a
  user would rather have the epoch than a stop over one photo. So `ddp_full.py` and `fsdp.py`, the
  scripts for long runs, skip it (`ReadableSamples`): in training the next readable sample in index
  order takes its place, loaded with the missing sample's seed (`SeededSamples`) — a choice made
  from (seed, epoch, index) alone, so one process still trains what DDP trains and a resume is still
  bitwise; in validation the sample is left out (a stand-in would count another sample twice) and
  the mean is over the rest. Steps 1-4, lessons on one concept each, stop at such a file.
  The process that met the file prints one line naming it, once an epoch (`ddp_full.py: warning:
  rank 1: cannot read …/3.png (cannot identify image file): trained on the next readable sample in
  its place`), a line after the epoch's says `epoch E: unreadable files skipped: N`, and
  `metrics.jsonl` counts them (`train_unreadable`, `val_unreadable`). What counts as unreadable is
  what reading a broken file raises (`UNREADABLE`): `OSError` (PIL's `UnidentifiedImageError`, a
  truncated image, a file gone) and `SyntaxError`, which PIL raises for a PNG with a broken chunk; a
  bug in a transform still raises. More than `MAX_UNREADABLE_IN_A_ROW` (16) unreadable in a row is a broken data set,
  not a broken file: among the first samples of either set it is one `error:` line at start; met
  later, in a worker, it is still a traceback. Tested with a PNG truncated to 40 bytes, one with a
  garbled chunk and an empty one, `--workers 0` and `2` (`tests/test_unreadable.py`). A copier who
  does not want this deletes the part `unreadable files` (the copier's map).
- **Sharded validation scores the saved model, BatchNorm included.** After the last step each
  process holds BatchNorm running statistics of its own micro-batches (DDP broadcasts rank 0's at
  the start of each forward; each process then updates its own). Scored with them, the shards
  belong to no single model: a resnet18 run reported 278/397 correct where its saved model scores
  276/397. `ddp_full.py` broadcasts rank 0's buffers before validating; tested with resnet18 on 2
  and 3 processes against a one-process evaluation of `model.pt`.
- **Accumulation syncs once per step.** `no_sync()` must cover the forward *and* the backward of
  every micro-batch but the last (DDP decides during the forward); each micro-batch is backwarded
  once, its mean loss weighted by its count, and the step's gradients are divided by all processes'
  count (one all-reduce of a number a step), so that the epoch's short last group and short last
  batch, a process holding fewer real tokens, and a count in tokens rather than samples all train
  as one process's batch of the same samples (the sampler's padding aside).
- **A run that diverges stops, and nothing that is not finite is written.** At each progress line
  the processes all-reduce their loss sums (the line prints all processes' loss): a loss not
  finite on any of them, a gradient norm not finite without fp16's scaler, or fp16's loss scale
  below 1 stops every process there, one line naming the step, the value and what to try, exit
  status 3. Before a checkpoint or `model.pt` is written, its values not finite are counted on
  every process: a loss shows an update that went wrong a step later. `ddp_full.py` and `fsdp.py`
  note the divergence, so that torchrun's restart stops at once instead of diverging again, and a
  resume from the checkpoint before it may lower `--lr`.
- **Mixed precision uses `torch.autocast` and `torch.amp.GradScaler(device)`**, not the deprecated
  `torch.cuda.amp`; the scaler steps and updates once per optimizer step, and `unscale_` comes
  before clipping. bf16 needs no scaler.
- **`LOCAL_RANK` from the environment**, which torchrun and the legacy launcher both set (torch's
  elastic agent); `--local-rank`, which the legacy launcher also passes, is accepted and not read.
  `device_ids` is given on CUDA only.
- **Rank 0 writes; the unwrapped model is saved** (no `module.` prefix). Writes go to a temporary
  file and `os.replace` — a reader sees the old file or the new one, never half of one.
- **Checkpoints load onto the CPU.** `torch.load(map_location=<cuda device>)` would carry the saved
  random states to the GPU, and `torch.set_rng_state`, `torch.cuda.set_rng_state` and
  `Generator.set_state` take CPU byte tensors only: every resume on a GPU would end in
  `TypeError: RNG state must be a torch.ByteTensor`. `load_state_dict` copies weights and optimizer
  state to the model's device by itself. Tested with the meta device standing in for the GPU.
- **DataParallel never hands a GPU a short last batch's one sample.** It splits a batch with
  `torch.chunk`: CIFAR-10's last batch of 16 on 6 GPUs is 3,3,3,3,3,1, and BatchNorm fails on the
  chunk of one. `dataparallel.py` drops the short last batch (its docstring also says that
  BatchNorm's running statistics come from GPU 0's chunk alone, and to choose a `--batch-size`
  whose chunks hold two samples or more). Tested by replaying the chunking for 2 to 8 GPUs.
- **Teardown.** torch 2.14 + gloo aborts a worker at exit ("terminate called without an active
  exception", about one run in six) if a DDP model is alive at `destroy_process_group()`. The model
  lives inside `train()`, and `cleanup_distributed()` collects garbage before destroying the group.
  That collection is instant because what lives for the whole run (modules, the process group,
  the data) is collected once and frozen (`gc.freeze()`) before the model is built; the
  interpreter's own collection at exit then skips it too (0.8 s less teardown on 2 processes).
  The same abort came back, once in a CI run of the whole suite, from a group that outlived
  `destroy_process_group()` with nothing of ours holding it: `torch.compile`, and the meta-device
  check of the model (`check_model_fits`, in `ddp_full.py` and `fsdp.py`), import `torch._dynamo`,
  which imports `torch.distributed.nn.functional`, whose collectives take the default group as a
  default argument, read at import. Imported after `init_process_group`, it kept the group, and
  its gloo threads, alive to the interpreter's exit. `setup_distributed()` now imports it first, so
  the defaults hold None; `tests/test_teardown.py` checks, for each DDP script (and after a
  `--compile` run), that no gloo thread is left running once `main()` returns (three were, before).
- **Bad input gets one line and a non-zero exit** (status 2): `--batch-size 0`, `--accum-steps 0`,
  nccl without CUDA, `--sync-bn` without CUDA, an unknown `--model`, a missing or empty data
  directory, more processes than samples, and in `ddp_full.py` and `fsdp.py` a model that cannot
  take the data (checked on the meta device before any work), a missing, truncated or
  mismatched checkpoint, processes that found different checkpoints, an `--out-dir` where no file
  can be written (checked by writing one before training starts, not discovered at the first
  save). Rank 0 reports; errors found while rank 0 prepares the output directory or the data reach
  every rank through a collective (`rank0_only`), so no rank is left waiting for a peer that has
  exited.
- **What goes wrong midway is one line too, and loses nothing** (`ddp_full.py` and `fsdp.py`, the
  scripts for long runs; steps 1-4 stop with a traceback).
  - *A write that fails* — a full disk or a permission, for a checkpoint, `model.pt` or
    `metrics.jsonl`: one line from the process that met it, naming the file, the reason, the space
    left on its file system and what is intact (`ddp_full.py: error: cannot write
    runs/ddp_full/checkpoints/step_000000024.pt: No space left on device (0.00 MiB free there);
    the files already in --out-dir are whole; the newest complete checkpoint is
    runs/ddp_full/checkpoints/step_000000012.pt: fix that, then run the same command
    again`), and exit status **74** (`EX_IOERR`), which a requeueing script can tell from bad
    input (2), a crash (1) and a preemption (75). Every file is written to a temporary name and
    renamed (`save_file`, `metrics.jsonl` included, rewritten whole each epoch), so the old file
    stays whole and no temporary file is left; torch.save's own report of a full disk, a
    RuntimeError ("unexpected pos") raised while handling the OSError, is recognised. Rank 0 writes
    inside `rank0_only`, so the other processes wait for its verdict and all stop at the same
    point: left alone they would die in their next collective on a closed connection, a traceback
    each. `fsdp.py`'s shards are written by every process: `dcp.save` hands all of them the
    failures, each process that failed prints its line with its rank, and rank 0 removes the
    partial `.step_N.tmp/`. **What to do next:** free space (or move `--out-dir` with its files
    to a roomier disk) and run the same command: `ddp_full.py` and `fsdp.py` resume from the
    checkpoint the line names. Under
    `--max-restarts` torchrun restarts the group after status 74 as after any failed worker: each
    restart resumes and stops with the same line until there is space.
  - *An error that only some processes meet* is printed by each process that meets it, with its
    rank: 8 processes on a 4-GPU node end in four lines `ddp_full.py: error: rank 5: local rank 5
    but only 4 GPUs are visible: start at most one process per GPU` (as many as reach the check
    before torchrun stops the rest) instead of silence. Bad input that every process meets stays
    one line from rank 0. Data that one process cannot see (its node's disk lacks it) is the same:
    rank 0 reads the data first, then the first process of each other node, then the rest (one
    writer per node's directory), and an all-gather of their verdicts after each turn
    (`rank0_first`, `stop_if_any_failed`) makes each process that failed print its line with its rank while every
    process stops there — before, the line was lost and rank 0 died in DDP's first collective.
  - *A section "your data and model" without a name the script uses* is checked before any work
    (`check_task`): one line naming it and what it must do (see
    [Your own data and model](your-task.md)).

  Tested with a real small file system (a tmpfs in a private mount namespace, `unshare`), a CPU
  stand-in for the GPU count (`tests/fewer_gpus.py`), a process that cannot see the data
  (`tests/missing_on_one_rank.py`) and sections with each name removed (`tests/test_failures.py`).
"""

PITFALLS = [
    {
        "title": "no_sync around the backward only",
        "mistake": "calling the forward outside `model.no_sync()` and only the backward inside it (or backward "
                   "twice on one graph, which raises, or with `retain_graph=True`, which doubles the gradient)",
        "symptom": "gradients are still all-reduced on every micro-batch: DDP decides during the forward",
        "correct": "one forward and one backward per micro-batch, both inside `no_sync()` except the group's last",
        "fix": [("ddp_amp_accum.py", "sync_context = contextlib.nullcontext() if last_in_group else model.no_sync()")],
        "guards": ["tests/test_equivalence.py::test_accumulation_all_reduces_gradients_once_per_optimizer_step"],
        "mutation": ("ddp_amp_accum.py",
                     "        with sync_context:\n"
                     "            with autocast(args, device):\n"
                     "                loss, count = batch_loss(model, batch)\n",
                     "        with autocast(args, device):\n"
                     "            loss, count = batch_loss(model, batch)\n"
                     "        with sync_context:\n"),
    },
    {
        "title": "Accumulation that all-reduces every micro-step",
        "mistake": "accumulating gradients without `no_sync()`",
        "symptom": "K all-reduces per optimizer step instead of one: accumulation saves no communication",
        "correct": "`no_sync()` on every micro-batch but the last of its group",
        "fix": [("ddp_amp_accum.py", "sync_context = contextlib.nullcontext() if last_in_group else model.no_sync()")],
        "guards": ["tests/test_equivalence.py::test_accumulation_all_reduces_gradients_once_per_optimizer_step"],
        "mutation": ("ddp_amp_accum.py", "contextlib.nullcontext() if last_in_group else model.no_sync()",
                     "contextlib.nullcontext()"),
    },
    {
        "title": "Validation loss as a sum of batch means",
        "mistake": "adding up `F.cross_entropy(logits, labels)` (a batch mean) and dividing by the sample count, "
                   "or averaging the batch means",
        "symptom": "a validation loss off by the batch size; with a short last batch, samples weigh unequally",
        "correct": "sum per-sample losses (`reduction=\"sum\"`) and divide by the number of samples",
        "fix": [("ddp_full.py", 'loss = F.cross_entropy(logits, labels, reduction="sum")')],
        "guards": ["tests/test_validation.py::test_ddp_full_sharded_validation_equals_one_process_evaluation"],
        "mutation": ("ddp_full.py", 'loss = F.cross_entropy(logits, labels, reduction="sum")',
                     "loss = F.cross_entropy(logits, labels)"),
    },
    {
        "title": "Validation on rank 0 through the DDP wrapper",
        "mistake": "`if rank == 0: evaluate(model, ...)` with the DDP-wrapped model",
        "symptom": "a hang (30 minutes, then a gloo/nccl timeout) with BatchNorm: the wrapper's forward starts a "
                   "buffer broadcast that the other ranks never join",
        "correct": "evaluate through `model.module` (ddp_basic, rank 0 alone) or on every rank (ddp_full)",
        "fix": [("ddp_basic.py", "val_totals = evaluate(args, model.module, val_loader, device)")],
        "guards": ["tests/test_launch.py::test_resnet18_with_batchnorm_validates_on_rank_0_without_hanging"],
        "mutation": ("ddp_basic.py", "val_totals = evaluate(args, model.module, val_loader, device)",
                     "val_totals = evaluate(args, model, val_loader, device)"),
    },
    {
        "title": "DistributedSampler padding counted as data",
        "mistake": "validating with `DistributedSampler`, which repeats samples until the set divides evenly",
        "symptom": "`val_samples` 104 for 103 samples on 2 processes; metrics that depend on the world size",
        "correct": "an unpadded shard per rank (`ShardSampler`) and one all-reduce of sums and counts",
        "fix": [("ddp_full.py", "val_sampler = ShardSampler(val_set, world_size, rank)")],
        "guards": ["tests/test_validation.py::test_ddp_full_sharded_validation_equals_one_process_evaluation"],
        "mutation": ("ddp_full.py", "val_sampler = ShardSampler(val_set, world_size, rank)",
                     "val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)"),
    },
    {
        "title": "Forgotten set_epoch",
        "mistake": "not calling `sampler.set_epoch(epoch)` before each epoch",
        "symptom": "every epoch sees epoch 0's order; results differ from a one-process run",
        "correct": "`train_loader.sampler.set_epoch(epoch)` at the top of every epoch",
        "fix": [("ddp_basic.py", "train_loader.sampler.set_epoch(epoch)")],
        "guards": ["tests/test_equivalence.py::test_ddp_on_2_processes_matches_one_process_on_the_global_batch"],
        "mutation": ("ddp_basic.py", "        train_loader.sampler.set_epoch(epoch)\n", "        pass\n"),
    },
    {
        "title": "Clipping before unscale_",
        "mistake": "`clip_grad_norm_` on fp16-scaled gradients",
        "symptom": "the norm of gradients multiplied by the loss scale (65536) is clipped: steps shrink to nothing",
        "correct": "`scaler.unscale_(optimizer)` first, once per step, then clip",
        "fix": [("ddp_amp_accum.py", "scaler.unscale_(optimizer)")],
        "guards": ["tests/test_amp.py::test_fp16_grad_scaler_unscales_before_clipping_and_stays_near_float32"],
        "mutation": ("ddp_amp_accum.py", "            scaler.unscale_(optimizer)\n", "            pass\n"),
    },
    {
        "title": "The deprecated torch.cuda.amp API",
        "mistake": "`torch.cuda.amp.autocast()` / `torch.cuda.amp.GradScaler()`",
        "symptom": "FutureWarnings; on a CPU-only machine the CUDA scaler silently disables itself",
        "correct": "`torch.autocast(device.type, ...)` and `torch.amp.GradScaler(device.type, ...)`",
        "fix": [("ddp_amp_accum.py", "scaler = torch.amp.GradScaler(device.type")],
        "guards": ["tests/test_static.py::test_no_deprecated_amp_api"],
        "mutation": ("ddp_amp_accum.py", "torch.amp.GradScaler(device.type, enabled=",
                     "torch.cuda.amp.GradScaler(enabled="),
    },
    {
        "title": "bf16 autocast never entered",
        "mistake": "an autocast whose `enabled=` leaves bf16 out (written for fp16 and its GradScaler)",
        "symptom": "none: the run is float32 throughout, its losses those of float32, its speed not bf16's",
        "correct": "`torch.autocast(device.type, dtype=..., enabled=args.amp != \"none\")`; tested by the dtypes "
                   "of the convolutions and matrix products that ran (`tests/precision_probe.py`)",
        "fix": [("ddp_amp_accum.py", "return torch.autocast(device.type, dtype=AMP_DTYPES[args.amp]")],
        "guards": ["tests/test_amp.py::test_autocast_runs_every_convolution_and_matrix_product_in_the_precision_"
                   "asked[ddp_amp_accum.py-bf16]"],
        "mutation": ("ddp_amp_accum.py", 'enabled=args.amp != "none")', 'enabled=args.amp == "fp16")'),
    },
    {
        "title": "Autocast in another precision than asked",
        "mistake": "`--amp bf16` mapped to `torch.float16` (or the other way round)",
        "symptom": "fp16's narrow range without a GradScaler: small gradients underflow to zero, large "
                   "activations overflow to inf, and the run says bf16",
        "correct": "one table from the flag to the dtype (`AMP_DTYPES`), read by autocast; tested by the dtypes "
                   "that ran",
        "fix": [("ddp_amp_accum.py", '"bf16": torch.bfloat16')],
        "guards": ["tests/test_amp.py::test_autocast_runs_every_convolution_and_matrix_product_in_the_precision_"
                   "asked[ddp_amp_accum.py-bf16]"],
        "mutation": ("ddp_amp_accum.py", '"bf16": torch.bfloat16', '"bf16": torch.float16'),
    },
    {
        "title": "bf16 that does not train: the optimizer step left to fp16's path",
        "mistake": "the optimizer stepped only where a GradScaler is in use (the bf16 branch of a two-branch "
                   "loop forgets `optimizer.step()`)",
        "symptom": "none but the numbers: the loss does not fall, the weights stay where they started",
        "correct": "one path for every precision: `scaler.step(optimizer)` always (a disabled scaler is a plain "
                   "step); tested from a model past the plateau, where float32 learns within 16 steps",
        "fix": [("ddp_full.py", "        scaler.step(optimizer)")],
        "guards": ["tests/test_amp.py::test_bf16_learns_where_float32_learns",
                   "tests/test_amp.py::test_bf16_follows_float32_over_its_first_steps"],
        "mutation": ("ddp_full.py", "        scaler.step(optimizer)\n",
                     "        scaler.step(optimizer) if scaler.is_enabled() else None\n"),
    },
    {
        "title": "--local_rank versus LOCAL_RANK",
        "mistake": "reading only `--local_rank` (torchrun passes none) or not accepting it (the legacy launcher "
                   "passes `--local-rank=N`)",
        "symptom": "every process on GPU 0, or `unrecognized arguments: --local-rank=1`",
        "correct": "`LOCAL_RANK` from the environment, which both launchers set (torch's elastic agent), and the "
                   "flag accepted, its value unread",
        "fix": [("ddp_basic.py", 'parser.add_argument("--local-rank", "--local_rank"')],
        "guards": ["tests/test_cluster.py::test_two_identical_runs_are_bitwise_identical_even_through_the_legacy_launcher"],
        "mutation": ("ddp_full.py", 'parser.add_argument("--local-rank", "--local_rank"',
                     'parser.add_argument("--gpu-index"'),
    },
    {
        "title": "device_ids on CPU",
        "mistake": "`DDP(model, device_ids=[local_rank])` for a CPU model",
        "symptom": "ValueError at construction: device_ids only work with single-device GPU modules",
        "correct": "`device_ids=[local_rank]` on CUDA, `None` on CPU",
        "fix": [("ddp_basic.py", 'device_ids=[local_rank] if device.type == "cuda" else None')],
        "guards": ["tests/test_equivalence.py::test_ddp_on_2_processes_matches_one_process_on_the_global_batch"],
        "mutation": ("ddp_basic.py", 'device_ids=[local_rank] if device.type == "cuda" else None',
                     "device_ids=[local_rank]"),
    },
    {
        "title": "The module. prefix",
        "mistake": "saving `model.state_dict()` of the DDP wrapper",
        "symptom": "every key starts with `module.`: the bare model reports missing and unexpected keys, and "
                   "`strict=False` silently loads nothing",
        "correct": "save `model.module.state_dict()`",
        "fix": [("ddp_full.py", '"model": model.module.state_dict(),')],
        "guards": ["tests/test_resume.py::test_checkpoint_holds_the_unwrapped_model_and_everything_resume_needs"],
        "mutation": ("ddp_full.py", '"model": model.module.state_dict(),', '"model": model.state_dict(),'),
    },
    {
        "title": "Non-atomic checkpoints",
        "mistake": "`torch.save(obj, path)` straight onto the file a reader or a restart may load",
        "symptom": "a kill or a failure mid-write leaves a truncated file where a good one stood",
        "correct": "write a temporary file in the same directory, then `os.replace`",
        "fix": [("ddp_full.py", "os.replace(tmp, path)")],
        "guards": ["tests/test_static.py::test_save_file_leaves_the_old_file_whole_when_a_write_fails"],
        "mutation": ("ddp_full.py", '        tmp = Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}")\n',
                     "        tmp = Path(path)\n"),
    },
    {
        "title": "Every rank writes checkpoints",
        "mistake": "saving on every process (or on each node's local rank 0)",
        "symptom": "N writers race on one file of a shared file system, or each node fills its own disk",
        "correct": "only global rank 0 writes; the others hand it their per-process state",
        "fix": [("ddp_full.py", "dist.gather_object(per_process, gathered, dst=0)")],
        "guards": ["tests/test_cluster.py::test_two_nodes_of_two_processes_train_as_one_node_of_four_and_only_global_rank_0_writes"],
        "mutation": ("ddp_full.py", "    rank0_only(rank, save_file, checkpoint, path)\n",
                     "    save_file(checkpoint, path)\n"),
    },
    {
        "title": "Inexact resume: the GradScaler",
        "mistake": "restoring weights and optimizer but re-creating the GradScaler",
        "symptom": "the resumed run steps with the initial loss scale, not the one it had reached: it drifts",
        "correct": "checkpoint `scaler.state_dict()` and load it on resume",
        "fix": [("ddp_full.py", 'scaler.load_state_dict(checkpoint["scaler"])')],
        "guards": ["tests/test_resume.py::test_resume_restores_the_grad_scaler_state"],
        "mutation": ("ddp_full.py", '    scaler.load_state_dict(checkpoint["scaler"])\n', "    pass\n"),
    },
    {
        "title": "Inexact resume: the random state",
        "mistake": "not saving and restoring each process's random generators",
        "symptom": "after a resume, dropout (and any random draw of the training process) differs from the "
                   "uninterrupted run",
        "correct": "rank 0 gathers every process's Python and torch RNG states; each process restores its own",
        "fix": [("ddp_full.py", "set_rng_state(state.rng)")],
        "guards": ["tests/test_sections.py::test_a_language_model_with_dropout_resumes_bitwise[ddp_full.py]"],
        "mutation": ("ddp_full.py", "    set_rng_state(state.rng)\n", "    pass\n"),
    },
    {
        "title": "Inexact resume: the position in the epoch",
        "mistake": "restarting a mid-epoch checkpoint at the beginning of its epoch",
        "symptom": "the first samples of the epoch are trained on twice, and the epoch runs long",
        "correct": "skip the samples all processes already consumed in the epoch (`set_start`)",
        "fix": [("ddp_full.py", "train_loader.sampler.set_start(")],
        "guards": ["tests/test_resume.py::test_resume_mid_epoch_then_at_an_epoch_boundary_is_bitwise_equal_to_an_uninterrupted_run"],
        "mutation": ("ddp_full.py", "train_loader.sampler.set_start(state.epoch_position)",
                     "train_loader.sampler.set_start(0)"),
    },
    {
        "title": "A collective inside `if rank == 0`",
        "mistake": "calling code that all-reduces (here: sharded evaluation) on rank 0 only",
        "symptom": "rank 0 waits in a collective the others never enter: a hang until the timeout",
        "correct": "every rank calls every collective, in the same order",
        "fix": [("ddp_full.py", "# Every process evaluates its shard through model.module: shards differ in length, and")],
        "guards": ["tests/test_validation.py::test_ddp_full_sharded_validation_equals_one_process_evaluation"],
        "mutation": ("ddp_full.py", "        val_start = time.perf_counter()\n"
                                    "        val_totals = evaluate(args, model.module, val_loader, device)\n",
                     "        val_start = time.perf_counter()\n"
                     "        val_totals = (evaluate(args, model.module, val_loader, device) if rank == 0\n"
                     "                      else torch.zeros(4, dtype=torch.float64, device=device))\n"),
    },
    {
        "title": "Per-process versus global batch size (and the learning rate)",
        "mistake": "treating `--batch-size` as global (dividing it by the world size), or scaling the world size "
                   "without thinking about the learning rate",
        "symptom": "a different global batch than intended: results change with the number of GPUs",
        "correct": "batch size per process; global batch = batch x world size x accumulation, printed at start; "
                   "lr used as given ([flags.md](flags.md#batch-size-and-learning-rate))",
        "fix": [("ddp_basic.py", 'log(f"global batch {args.batch_size * world_size} =')],
        "guards": ["tests/test_equivalence.py::test_ddp_weights_do_not_depend_on_world_size"],
        "mutation": ("ddp_basic.py", "        batch_size=args.batch_size,\n",
                     "        batch_size=max(1, args.batch_size * 2 // world_size),\n"),
    },
    {
        "title": "BatchNorm statistics under DDP (SyncBatchNorm)",
        "mistake": "assuming BatchNorm sees the global batch, or converting to SyncBatchNorm where it cannot run",
        "symptom": "each process normalises with its own small batch; `SyncBatchNorm` on CPU raises "
                   "`ValueError: SyncBatchNorm layers only work with GPU modules` inside DDP",
        "correct": "plain BatchNorm by default; `--sync-bn` (ddp_full) converts with "
                   "`nn.SyncBatchNorm.convert_sync_batchnorm` before wrapping in DDP, on CUDA only, and says so "
                   "in one line on a CPU",
        "fix": [("ddp_full.py", 'raise ConfigError("--sync-bn needs CUDA GPUs: SyncBatchNorm runs on GPUs only")')],
        "guards": ["tests/test_bad_input.py::test_sync_bn_without_cuda_is_one_clear_error"],
        "mutation": ("ddp_full.py", '    if args.sync_bn and device.type != "cuda":\n        raise ConfigError("--sync-bn',
                     '    if False:\n        raise ConfigError("--sync-bn'),
    },
    {
        "title": "A restart that starts over",
        "mistake": "restarting crashed workers (torchrun --max-restarts) with a script that does not resume by itself",
        "symptom": "every restart trains from step 0: a job that crashes now and then never finishes",
        "correct": "`--resume auto` by default: the same command resumes from the newest readable checkpoint",
        "fix": [("ddp_full.py", 'parser.add_argument("--resume", default="auto",')],
        "guards": ["tests/test_cluster.py::test_killed_worker_is_restarted_and_the_run_ends_bitwise_as_if_never_killed"],
        "mutation": ("ddp_full.py", 'parser.add_argument("--resume", default="auto",',
                     'parser.add_argument("--resume", default="none",'),
    },
    {
        "title": "SIGTERM ignored",
        "mistake": "no handler for SIGTERM, which schedulers send before SIGKILL on preemption",
        "symptom": "the job dies mid-step and loses everything since its last periodic checkpoint",
        "correct": "a handler that asks for a stop; all ranks agree on the batch, checkpoint, and exit 75",
        "fix": [("ddp_full.py", "signal.signal(signal.SIGTERM, self.request)")],
        "guards": ["tests/test_cluster.py::test_sigterm_exits_with_status_75_after_its_checkpoint"],
        "mutation": ("ddp_full.py", "        self.previous_handler = signal.signal(signal.SIGTERM, self.request)\n",
                     "        self.previous_handler = None\n"),
    },
    {
        "title": "Resuming from a torn checkpoint",
        "mistake": "`--resume auto` taking the newest file whatever its state",
        "symptom": "a truncated newest checkpoint stops every restart with a load error",
        "correct": "report the unreadable file in one line and fall back to the previous one",
        "fix": [("ddp_full.py", 'log(f"skipping: {err}")')],
        "guards": ["tests/test_cluster.py::test_auto_resume_skips_a_torn_checkpoint_and_falls_back_to_the_previous_one"],
        "mutation": ("ddp_full.py", '            log(f"skipping: {err}")\n', "            raise\n"),
    },
    {
        "title": "Resuming on another number of processes",
        "mistake": "the data position kept per process, or as steps times the new world's global batch",
        "symptom": "a smaller or larger cluster skips or repeats samples of the resumed epoch (or refuses the run)",
        "correct": "record how far the epoch's order all processes together got and deal the rest afresh; "
                   "--global-batch-size keeps the global batch",
        "fix": [("ddp_full.py", "train_loader.sampler.set_start(state.epoch_position)")],
        "guards": ["tests/test_world_change.py::"
                   "test_without_global_batch_size_a_resume_on_fewer_processes_goes_on_with_a_smaller_global_batch"],
        "mutation": ("ddp_full.py", "train_loader.sampler.set_start(state.epoch_position)",
                     "train_loader.sampler.set_start(\n            state.step_in_epoch * args.accum_steps * args.batch_size * world_size)"),
    },
    {
        "title": "Random states loaded onto the GPU",
        "mistake": "`torch.load(checkpoint, map_location=device)` with a CUDA device",
        "symptom": "every resume on a GPU ends in `TypeError: RNG state must be a torch.ByteTensor`: random "
                   "states can only be restored from CPU byte tensors",
        "correct": "load to the CPU (`map_location=\"cpu\"`); `load_state_dict` copies weights and optimizer "
                   "state to the model's device, and the random states stay where they must be",
        "fix": [("ddp_full.py", 'checkpoint = torch.load(path, map_location="cpu", weights_only=True,')],
        "guards": ["tests/test_gpu_paths.py::test_a_checkpoint_restores_onto_another_device_than_the_cpu"],
        # The meta device stands in for the GPU, which CI does not have.
        "mutation": ("ddp_full.py", 'checkpoint = torch.load(path, map_location="cpu", weights_only=True,',
                     'checkpoint = torch.load(path, map_location="meta", weights_only=True,'),
    },
    {
        "title": "BatchNorm statistics that differ across ranks in sharded validation",
        "mistake": "validating each shard with that process's own BatchNorm running statistics",
        "symptom": "after the last step each process holds statistics of its own micro-batches: the shards are "
                   "scored by different models, none of them the saved one (measured: 278/397 correct reported, "
                   "276/397 for the saved model)",
        "correct": "broadcast rank 0's buffers before scoring, so every shard is scored by the model rank 0 saves",
        "fix": [("ddp_full.py", "    broadcast_buffers(model)")],
        "guards": ["tests/test_validation.py::test_sharded_validation_with_batchnorm_scores_the_saved_model"],
        "mutation": ("ddp_full.py", "    broadcast_buffers(model)\n    model.eval()", "    model.eval()"),
    },
    {
        "title": "A resume that loses the BatchNorm statistics",
        "mistake": "checkpointing or restoring the parameters alone (`named_parameters()`, or a load with "
                   "`strict=False` that skips what is missing)",
        "symptom": "BatchNorm's running statistics start afresh at every resume: the resumed model scores and "
                   "trains differently, and a model without buffers (the demo CNN) cannot show it",
        "correct": "save rank 0's whole `state_dict()` (parameters and buffers) and load it strictly",
        "fix": [("ddp_full.py", '        model.load_state_dict(checkpoint["model"])')],
        "guards": ["tests/test_cluster.py::test_sigterm_stops_after_the_optimizer_step_and_a_batchnorm_model_resumes_bitwise"
                   "[ddp_full.py-0]"],
        "mutation": ("ddp_full.py", '        model.load_state_dict(checkpoint["model"])',
                     '        model.load_state_dict({name: checkpoint["model"][name] for name, _ in '
                     'model.named_parameters()}, strict=False)'),
    },
    {
        "title": "Processes that resume from different checkpoints",
        "mistake": "letting every process pick its checkpoint alone, on nodes that do not share a file system "
                   "(or share a stale one)",
        "symptom": "a node that does not see the newest checkpoint starts afresh while the others resume; DDP's "
                   "first broadcast hides it, the epochs then differ and the run hangs or fails later",
        "correct": "one collective after each process found its checkpoint: all must name the same one, or every "
                   "process stops with one line naming both views",
        "fix": [("ddp_full.py", "if found != views[0][0]:")],
        "guards": ["tests/test_cluster.py::test_nodes_that_see_different_checkpoints_stop_with_one_line_and_write_nothing"],
        "mutation": ("ddp_full.py", "if found != views[0][0]:", "if False:"),
    },
    {
        "title": "A stop request that waits for the end of validation",
        "mistake": "checking for SIGTERM only after an optimizer step (or only at the end of an epoch)",
        "symptom": "a SIGTERM during a long validation is acted on after it; torchrun SIGKILLs the workers when "
                   "its grace period (30 s) ends, and the run loses everything since its last checkpoint",
        "correct": "all processes all-reduce the flag at every batch, in training and in validation (a shard a "
                   "batch shorter than the longest polls once more), reading each result one batch later so none "
                   "waits; the checkpoint then resumes with validation",
        "fix": [("ddp_full.py", "if PREEMPTION.poll():  # before every batch")],
        "guards": ["tests/test_cluster.py::test_sigterm_during_validation_stops_within_two_batches_and_resume_is_bitwise"],
        # Both of validation's polls go (one alone would leave the processes' polls unmatched: a hang).
        "mutation": ("ddp_full.py",
                     "        if PREEMPTION.poll():  # before every batch: as often on every process, see below\n"
                     "            return None\n"
                     "        # [optional: unreadable files]\n"
                     "        batch, unreadable = report_unreadable(batch, unreadable, \"left out of validation\")\n"
                     "        # [optional: unreadable files]\n"
                     "        if batch is None:  # none of its files could be read\n"
                     "            continue\n"
                     "        with autocast(args, device):\n"
                     "            sums, count = evaluate_batch(model, to_device(batch, device, args.channels_last))\n"
                     "        totals[:-1] += sums\n"
                     "        totals[-1] += count\n"
                     "    # [optional: preemption, mid-epoch]\n"
                     "    # Shards differ by one sample at most: one a batch shorter than the longest polls once more.\n"
                     "    if len(loader) < math.ceil(len(loader.dataset) / (dist.get_world_size() * args.batch_size)) \\\n"
                     "            and PREEMPTION.poll():\n"
                     "        return None\n",
                     "        batch, unreadable = report_unreadable(batch, unreadable, \"left out of validation\")\n"
                     "        if batch is None:\n"
                     "            continue\n"
                     "        with autocast(args, device):\n"
                     "            sums, count = evaluate_batch(model, to_device(batch, device, args.channels_last))\n"
                     "        totals[:-1] += sums\n"
                     "        totals[-1] += count\n"),
    },
    {
        "title": "A stop between a forward and its optimizer step",
        "mistake": "acting on an agreed stop at the batch it is agreed at, before the step its forwards belong to",
        "symptom": "the forwards since the last step have moved BatchNorm's running statistics; the checkpoint holds "
                   "the last step with them, and the resume runs those forwards again: a BatchNorm model resumes "
                   "to other weights (resnet18: 60 of 122 tensors differ), a model without buffers bitwise",
        "correct": "poll the flag at every batch, so that all agree soon, and stop after the group's optimizer step",
        "fix": [("ddp_full.py", "if PREEMPTION.agreed:  # after the step"), ("fsdp.py", "if PREEMPTION.agreed:  # after the step")],
        "guards": ["tests/test_cluster.py::test_sigterm_stops_after_the_optimizer_step_and_a_batchnorm_model_resumes_bitwise"],
        "mutation": ("ddp_full.py", "        PREEMPTION.poll()  # every batch, so that all agree soon; they stop after the group's step\n",
                     "        if PREEMPTION.poll():\n            return None\n"),
    },
    {
        "title": "DataParallel handing a GPU one sample",
        "mistake": "keeping a short last batch under DataParallel with BatchNorm",
        "symptom": "DataParallel splits a batch with `torch.chunk`: CIFAR-10's last batch of 16 on 6 GPUs is "
                   "3,3,3,3,3,1, and BatchNorm fails on the chunk of one (\"Expected more than 1 value per channel\")",
        "correct": "drop the short last batch in dataparallel.py's training loader",
        "fix": [("dataparallel.py", "drop_last=True")],
        "guards": ["tests/test_gpu_paths.py::test_dataparallel_never_gives_a_gpu_a_single_sample"],
        "mutation": ("dataparallel.py", "sampler=train_sampler, drop_last=True, **loader_args)",
                     "sampler=train_sampler, **loader_args)"),
    },
    {
        "title": "A learning-rate schedule missing from the checkpoint",
        "mistake": "saving the model and the optimizer but not `scheduler.state_dict()`",
        "symptom": "a resumed run starts the schedule again: a second warm-up in the middle of training, and a "
                   "decay that no longer ends at the last step",
        "correct": "save and restore the scheduler's state with the optimizer's",
        "fix": [("ddp_full.py", 'scheduler.load_state_dict(checkpoint["scheduler"])')],
        "guards": ["tests/test_recipe.py::test_resume_is_bitwise_equal_to_an_uninterrupted_run"],
        "mutation": ("ddp_full.py", '        scheduler.load_state_dict(checkpoint["scheduler"])\n', ""),
    },
    {
        "title": "A schedule stepped per micro-batch",
        "mistake": "calling `scheduler.step()` after every backward when accumulating gradients",
        "symptom": "the schedule runs K times too fast: warm-up ends early and the rate reaches 0 a fraction "
                   "of the way through training",
        "correct": "`scheduler.step()` once per optimizer step, after `optimizer.step()`",
        "fix": [("ddp_amp_accum.py", "then one schedule step per optimizer step")],
        "guards": ["tests/test_recipe.py::test_learning_rate_moves_once_per_optimizer_step_with_accumulation"],
        "mutation": ("ddp_amp_accum.py",
                     "        group_count += count\n        if not last_in_group:\n            continue\n",
                     "        group_count += count\n        if not last_in_group:\n            scheduler.step()\n"
                     "            continue\n"),
    },
    {
        "title": "`_orig_mod.` keys in the saved model",
        "mistake": "`model = torch.compile(model)` and then saving `model.state_dict()`",
        "symptom": "every key of model.pt starts with `_orig_mod.`: it no longer loads into the plain model",
        "correct": "compile in place, `model.compile()`: the module keeps its class and its keys",
        "fix": [("single_gpu.py", "        model.compile()")],
        "guards": ["tests/test_compile.py::test_single_gpu_compiled_saves_plain_keys"],
        "mutation": ("single_gpu.py", "        model.compile()\n", "        model = torch.compile(model)\n"),
    },
    {
        "title": "A compile that compiles nothing",
        "mistake": "calling `torch.compile(model)` and keeping the uncompiled model (it returns a new module), or "
                   "compiling the DDP wrapper of a model whose forward is torch.nn's own code",
        "symptom": "training runs eager with no error: dynamo's counters show no graph captured",
        "correct": "`model.compile()` in place, before DDP wraps the model",
        "fix": [("ddp_amp_accum.py", "        model.compile()")],
        "guards": ["tests/test_compile.py::test_compile_under_ddp_captures_the_model_and_recompiles_only_for_shape_and_grad_mode"],
        "mutation": ("ddp_amp_accum.py", "        model.compile()\n", "        torch.compile(model)\n"),
    },
    {
        "title": "Workers' random state carried across epochs",
        "mistake": "random augmentation drawn from the data-loader workers' own generators",
        "symptom": "workers are seeded once, when they start, and persistent ones carry their state from epoch "
                   "to epoch; a resumed run starts new workers (102 of 122 tensors of resnet18 differed after "
                   "an epoch-boundary resume, measured), and a sample's crop depends on the worker, --workers "
                   "and the world size",
        "correct": "seed each sample's draws from (seed, epoch, index): SeededSamples, keyed by EpochKeys",
        "fix": [("ddp_full.py", "seed = ((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63")],
        "guards": ["tests/test_augmentation.py::test_resume_of_resnet18_with_augmenting_workers_is_bitwise_mid_epoch_and"
                   "_at_an_epoch_boundary"],
        "mutation": ("ddp_full.py", "        epoch, index = key\n",
                     "        epoch, index = key\n        return self.dataset[index], []\n"),
    },
    {
        "title": "A process group kept alive past destroy_process_group",
        "mistake": "letting torch import `torch.distributed.nn.functional` after `init_process_group` (it does "
                   "so lazily, with torch.compile or at the first forward on the meta device): its functions "
                   "take the default group as a default argument, read once at import",
        "symptom": "the group and its gloo threads outlive `destroy_process_group()` and end with the "
                   "interpreter, which now and then aborts a finished run (`terminate called without an "
                   "active exception`, exit -6; torchrun reports the run as failed)",
        "correct": "import it before `init_process_group`: the defaults then hold None",
        "fix": [("ddp_amp_accum.py", "    from torch.distributed.nn import functional")],
        "guards": ["tests/test_teardown.py::test_no_gloo_thread_outlives_main_after_a_compiled_run"],
        "mutation": ("ddp_amp_accum.py",
                     "    from torch.distributed.nn import functional  # noqa: F401\n",
                     ""),
    },
    {
        "title": "An unreadable image ends the run",
        "mistake": "letting a file that cannot be read (truncated, corrupt, gone) raise in the data loader",
        "symptom": "a traceback from a DataLoader worker mid-epoch, the other processes' gloo \"Connection "
                   "closed by peer\", and everything since the last checkpoint lost (measured: one truncated "
                   "PNG, 134 lines of output)",
        "correct": "skip it: in training the next readable sample takes its place, chosen from the key alone "
                   "(exactness holds); in validation it is left out; one warning names it, and metrics.jsonl "
                   "counts it",
        "fix": [("ddp_full.py", "                unreadable = unreadable or [describe_unreadable")],
        "guards": ["tests/test_unreadable.py::test_an_unreadable_image_is_named_skipped_and_counted_and_ddp_still_equals_one_process"],
        "mutation": ("ddp_full.py",
                     "            except UNREADABLE as err:\n                # Its own file is reported",
                     "            except ArithmeticError as err:\n                # Its own file is reported"),
    },
    {
        "title": "An unreadable validation image replaced by another",
        "mistake": "scoring a stand-in (the next readable image) where a validation image cannot be read",
        "symptom": "the stand-in is counted twice: metrics of a set that does not exist",
        "correct": "leave the unreadable sample out of validation (ReadableSamples), count it, and score the rest",
        "fix": [("ddp_full.py", "return ReadableSamples(train_set, stand_in=True), ReadableSamples(val_set, stand_in=False)")],
        "guards": ["tests/test_unreadable.py::test_an_unreadable_image_is_named_skipped_and_counted_and_ddp_still_equals_one_process"],
        "mutation": ("ddp_full.py", "ReadableSamples(val_set, stand_in=False)", "ReadableSamples(val_set, stand_in=True)"),
    },
    {
        "title": "FSDP: a process that skips a validation forward",
        "mistake": "letting a process whose validation shard has run out (or whose batch was all unreadable) "
                   "skip its forward, as DDP allows",
        "symptom": "every forward all-gathers each unit's parameters from all processes: the others wait in the "
                   "gather until the collective timeout (gloo: 30 minutes) and the job dies",
        "correct": "every process runs as many forwards (the longest shard's batches); without a batch, one on a "
                   "spare batch, its result discarded",
        "fix": [("fsdp.py", "            evaluate_batch(model, spare)")],
        "guards": ["tests/test_fsdp.py::test_fsdp_sharded_validation_with_uneven_shards_equals_one_process_evaluation"],
        "mutation": ("fsdp.py", "            evaluate_batch(model, spare)\n", "            pass\n"),
    },
    {
        "title": "FSDP: the optimizer built before sharding",
        "mistake": "building the optimizer on the model, then calling `fully_shard`",
        "symptom": "fully_shard puts new sharded parameters (DTensors) in the model's place; the optimizer holds "
                   "the old ones, which never get a gradient: the weights never change, silently, until the first "
                   "checkpoint stops the run with a bare `KeyError: 0`",
        "correct": "shard first, then build the optimizer on `model.parameters()`",
        "fix": [("fsdp.py", "    optimizer = build_optimizer(args, model)")],
        "guards": ["tests/test_fsdp.py::test_fsdp_on_2_processes_with_accumulation_trains_what_one_process_trains"],
        "mutation": ("fsdp.py",
                     "    units = shard_model(args, model, values, device, world_size)\n"
                     "    del values  # in every process's shards now: free rank 0's host copy\n"
                     "    # After sharding: built before, the optimizer would step the full parameters fully_shard freed.\n"
                     "    optimizer = build_optimizer(args, model)\n",
                     "    optimizer = build_optimizer(args, model)\n"
                     "    units = shard_model(args, model, values, device, world_size)\n"),
    },
    {
        "title": "FSDP: a sharded state dict saved with torch.save by rank 0",
        "mistake": "checkpointing `model.state_dict()` (and the optimizer's) with `torch.save` on rank 0, as DDP does",
        "symptom": "rank 0's state dict holds rank 0's shards only: the rest of the model and its optimizer state "
                   "are never written, and no resume is possible",
        "correct": "`torch.distributed.checkpoint.save` on every process: each writes its own shards, rank 0 the "
                   "metadata that lets any number of processes read them back",
        "fix": [("fsdp.py", 'dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)')],
        "guards": ["tests/test_fsdp.py::test_fsdp_resume_mid_epoch_and_at_an_epoch_boundary_is_bitwise"],
        "mutation": ("fsdp.py", 'dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)',
                     'rank == 0 and torch.save({"model": model_state, "optimizer": optimizer_state}, '
                     'path / "state.pt")'),
    },
    {
        "title": "FSDP: each shard clipped by its own norm",
        "mistake": "computing the gradient norm from each process's local shards (`p.grad.to_local()`) and "
                   "clipping by it",
        "symptom": "each process scales its part of the gradient by another factor: the update is no longer the "
                   "clipped global gradient, and differs from DDP's",
        "correct": "`clip_grad_norm_(model.parameters(), ...)` over the sharded (DTensor) gradients: the global "
                   "norm, the same on every process",
        "fix": [("fsdp.py", "grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)")],
        "guards": ["tests/test_fsdp.py::test_fsdp_clips_by_the_global_norm_as_ddp_full_does"],
        "mutation": ("fsdp.py", "grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)",
                     "local = torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()])\n"
                     "            for p in model.parameters():\n"
                     "                p.grad.to_local().mul_(torch.clamp(args.clip_grad_norm / (local + 1e-6), "
                     "max=1.0))\n"
                     "            grad_norm = torch.distributed.tensor.DTensor.from_local(local, "
                     "p.grad.device_mesh)"),
    },
    {
        "title": "FSDP: BatchNorm under a bf16 parameter policy",
        "mistake": "one bf16 `MixedPrecisionPolicy` for the whole model, BatchNorm included",
        "symptom": "on CPU: \"expected scalar type BFloat16 but found Float\" in the first forward (bf16 weights "
                   "beside BatchNorm's float32 running statistics, which FSDP does not cast)",
        "correct": "a model with BatchNorm keeps float32 parameters in every unit (`param_dtype=None`) and runs its "
                   "forward under autocast, as `ddp_full.py` does (bitwise its weights)",
        "fix": [("fsdp.py", "    if dtype != torch.float32 and has_batchnorm(model):")],
        "guards": ["tests/test_fsdp.py::test_fsdp_low_precision_trains_resnet18_as_ddp_full_with_no_cast_around_"
                   "batchnorm[bf16]"],
        "mutation": ("fsdp.py", "    if dtype != torch.float32 and has_batchnorm(model):", "    if False:"),
    },
    {
        "title": "torch.compile over activation checkpointing with a context_fn",
        "mistake": "letting `--compile` and `--activation-checkpointing` run together",
        "symptom": "dynamo stops at the first forward: \"checkpoint not implemented for ... context_fn\" "
                   "(the context that keeps BatchNorm's statistics), a traceback from every process",
        "correct": "one line at start-up, before any work: use one of the two",
        "fix": [("fsdp.py", "    if args.compile and args.activation_checkpointing:")],
        "guards": ["tests/test_fsdp.py::test_fsdp_compile_with_activation_checkpointing_is_one_clear_line"],
        "mutation": ("fsdp.py", "    if args.compile and args.activation_checkpointing:", "    if False:"),
    },
    {
        "title": "FSDP over gloo on a torch that sums the gradients",
        "mistake": "trusting `fully_shard` to average the gradients over gloo (CPU) on any torch that has it",
        "symptom": "torch 2.7 and 2.8 sum them over gloo (pytorch#162338): on 2 processes each gradient twice "
                   "the mean, and the CNN's weights 0.05 from one process's after 24 steps; nothing fails",
        "correct": "over gloo with more than one process, torch 2.9 or later, or one line at start-up saying so",
        "fix": [("fsdp.py", '    if backend == "gloo" and dist.get_world_size() > 1 and torch.__version__ < "2.9":')],
        "guards": ["tests/test_fsdp.py::test_fsdp_over_gloo_on_a_torch_that_sums_the_gradients_is_one_clear_line"],
        "mutation": ("fsdp.py", 'dist.get_world_size() > 1 and torch.__version__ < "2.9":',
                     'dist.get_world_size() > 1 and torch.__version__ < "2.7":'),
    },
    {
        "title": "FSDP: BatchNorm cast to float32 around every layer",
        "mistake": "keeping BatchNorm in float32 under `--amp` by casting (a float32 `param_dtype`, which casts each "
                   "unit's input to float32, or hooks that cast each layer's input to float32 and its output back)",
        "symptom": "casts around every unit or layer, float32 copies kept for the backward, and other arithmetic "
                   "than autocast's: the weights end away from `ddp_full.py`'s (0.10 with the hooks)",
        "correct": "`param_dtype=None`: float32 parameters, inputs as they come, and autocast casting each operation "
                   "as in `ddp_full.py`: the same weights, bit for bit",
        "fix": [("fsdp.py", "keep = fsdp.MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)")],
        "guards": ["tests/test_fsdp.py::test_fsdp_low_precision_trains_resnet18_as_ddp_full_with_no_cast_around_"
                   "batchnorm[bf16]"],
        "mutation": ("fsdp.py", "keep = fsdp.MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)",
                     # A float32 param_dtype on float32 parameters would be a no-op (FSDP then casts
                     # unit inputs that autocast casts back, losslessly): put back the hooks instead.
                     "keep = fsdp.MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)\n"
                     "        for layer in model.modules():\n"
                     "            if isinstance(layer, nn.modules.batchnorm._BatchNorm):\n"
                     "                layer.register_forward_pre_hook(lambda _, inputs: tuple(x.float() for x in inputs))\n"
                     "                layer.register_forward_hook(lambda _, inputs, out: out.to(inputs[0].dtype))"),
    },
    {
        "title": "FSDP: BatchNorm in a unit of its own inside the blocks",
        "mistake": "keeping BatchNorm's parameters float32 under `--amp` with units of their own (one for all its "
                   "layers, or one each) inside the blocks, whose parameters are gathered in bf16",
        "symptom": "with `--activation-checkpointing`, each block recomputed in the backward runs BatchNorm's FSDP "
                   "hooks, which claim the forward's root; torch 2.11 never frees it, and from the second step on "
                   "every forward skips the wait for the optimizer's writes before its all-gathers: a silent race "
                   "on CUDA (on CPU a warning that modules \"did not run forward before backward\"). And a unit "
                   "per layer is 70 units for resnet50 instead of 17, each gathered and reduced on its own",
        "correct": "no unit inside a block: a model with BatchNorm keeps float32 parameters in every unit and runs "
                   "under autocast; the forward root is free and the model's own at every forward (counted by "
                   "`tests/fsdp_probe.py`, on torch 2.11 and 2.14)",
        "fix": [("fsdp.py", "    units = units_of(model)  # the section's units, then the root")],
        "guards": ["tests/test_fsdp.py::test_activation_checkpointing_leaves_fsdps_forward_root_free_for_every_forward"],
        "mutation": ("fsdp.py", "    units = units_of(model)  # the section's units, then the root\n",
                     "    units = units_of(model)  # the section's units, then the root\n"
                     "    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]\n"
                     "    if norms and args.amp != \"none\":\n"
                     "        fsdp.fully_shard(norms, mesh=mesh, mp_policy=policy)\n"),
    },
    {
        "title": "FSDP: a unit for every layer in a container",
        "mistake": "taking every module inside an `nn.Sequential` or `nn.ModuleList` as a unit, single layers "
                   "included",
        "symptom": "a stem's and each downsampling layer's few parameters become units of their own, each an "
                   "all-gather in forward and in backward and a reduce-scatter: convnext_tiny gets 28 units, 10 of "
                   "them one layer, instead of its 18 blocks",
        "correct": "the units are the blocks a model repeats (modules built of layers whose class it uses more than "
                   "once); containers are searched, not taken, and a single layer in one is the root's",
        "fix": [("fsdp.py", "        return (not isinstance(module, containers) and uses[type(module)] > 1 and")],
        "guards": ["tests/test_fsdp_units.py::test_a_torchvision_models_units_are_the_blocks_it_repeats[convnext_tiny]"],
        "mutation": ("fsdp.py", "        return (not isinstance(module, containers) and uses[type(module)] > 1 and\n"
                                "                any(is_layer(inner) for inner in module.modules() if inner is not module))",
                     "        return not isinstance(module, containers) and any(True for _ in module.parameters())"),
    },
    {
        "title": "FSDP: tied weights split between units",
        "mistake": "sharding a module as a unit while it shares a parameter with a module outside it (a read-out "
                   "tied to the embedding)",
        "symptom": "torch 2.14: a `ValueError` traceback from every process at the first forward (\"Parameter "
                   "'readout.weight' is shared with a parameter already managed by another FSDP group\")",
        "correct": "modules that share a parameter are one unit (`fully_shard` of a list) or all the root's: "
                   "`find_blocks` leaves such a block to the root, and a unit the section names that splits a tie "
                   "is one line at start-up",
        "fix": [("fsdp.py", "        if tied := shares_parameters(model, unit):")],
        "guards": ["tests/test_fsdp_units.py::test_units_a_section_may_not_return_are_one_line_naming_them[tied]"],
        "mutation": ("fsdp.py", "        if tied := shares_parameters(model, unit):", "        if tied := None:"),
    },
    {
        "title": "FSDP with --compile: a transformer compiled whole",
        "mistake": "`model.compile()` on the whole model before sharding a transformer",
        "symptom": "nothing fails: dynamo gives the root's forward up at FSDP's first hook (a break in the loop over "
                   "the blocks, the frame then run eagerly) and compiles each block as it runs",
        "correct": "compile each unit on its own, then shard it, as torchtitan does: FSDP's hooks run between the "
                   "graphs, none breaks (a model with BatchNorm, or with torch.nn layers as units, stays whole)",
        "fix": [("fsdp.py", "        module.compile(dynamic=False)")],
        "guards": ["tests/test_compile.py::test_fsdp_compiles_a_transformer_unit_by_unit_without_a_graph_break"],
        "mutation": ("fsdp.py", "    for module in modules:\n        module.compile(dynamic=False)\n",
                     "    model.compile(dynamic=False)\n"),
    },
    {
        "title": "FSDP with --compile: a block's forward recompiled with symbolic shapes",
        "mistake": "`model.compile()` with its default shapes before `fully_shard`",
        "symptom": "FSDP's hooks split the compiled forward at every unit, so each residual block's forward is "
                   "compiled again for each stage's shapes; dynamo makes them symbolic and the backward fails in "
                   "inductor on CPU (resnet18, torch 2.14: \"Cannot convert expression to float\"), a traceback "
                   "from every process at the first step",
        "correct": "`model.compile(dynamic=False)`: each shape compiles once (up to dynamo's recompile limit, "
                   "then the block runs eagerly)",
        "fix": [("fsdp.py", "        model.compile(dynamic=False)")],
        "guards": ["tests/test_compile.py::test_fsdp_compiles_resnet18_whose_blocks_change_shape_from_stage_to_stage"],
        "mutation": ("fsdp.py", "        model.compile(dynamic=False)", "        model.compile()"),
    },
    {
        "title": "FSDP: --init-from loaded into a model built at random",
        "mistake": "building the whole model on rank 0 (random values first), then loading --init-from's file into it",
        "symptom": "rank 0 holds the model twice at start-up, its random values and the file's read into memory "
                   "(resnet18: 99 MiB over the imports, against 81 read from the file memory-mapped), and spends "
                   "the random initialisation of a model about to be overwritten",
        "correct": "starting afresh from a file, rank 0 reads it memory-mapped straight into the shards' broadcast, "
                   "checking every key and shape against the meta-device model; nothing is built",
        "fix": [("fsdp.py", "if not unsaved or init_weights:")],
        "guards": ["tests/test_fsdp.py::test_fsdp_starts_from_an_init_from_file_that_rank_0_reads_without_building_the_model"],
        "mutation": ("fsdp.py", "if not unsaved or init_weights:", "if False:"),
    },
    {
        "title": "FSDP: a section's init_weights drawn from one seed on a CPU",
        "mistake": "seeding every process alike before each initialises its own shards",
        "symptom": "on GPUs DTensor draws a shard as its slice of one random tensor; a CPU mesh has no such generator, "
                   "and each process draws its shard from the same numbers: the first convolution's channels 0-15 "
                   "equal to 16-31, a symmetry that training must break",
        "correct": "on a CPU each process draws from a seed of its own (seed + rank); on GPUs one seed",
        "fix": [("fsdp.py", "set_seed(args.seed if device.type == \"cuda\" else args.seed + dist.get_rank())")],
        "guards": ["tests/test_fsdp.py::test_fsdp_with_a_sections_init_weights_builds_nothing_whole_and_each_process_"
                   "draws_its_own_shards"],
        "mutation": ("fsdp.py", "set_seed(args.seed if device.type == \"cuda\" else args.seed + dist.get_rank())",
                     "set_seed(args.seed)"),
    },
    {
        "title": "FSDP: every process builds the whole model",
        "mistake": "`build_model` in every process, then `fully_shard` (each keeps its slice of its own copy)",
        "symptom": "before the first shard exists a node holds one whole model per process in host memory: "
                   "8 processes x 28 GB for 7 B parameters in float32, where one copy would do",
        "correct": "every process builds the model on the meta device and shards that; rank 0 alone builds the "
                   "values (and reads `--init-from`), and `set_model_state_dict(..., broadcast_from_rank0=True)` "
                   "fills every process's shards from them",
        "fix": [("fsdp.py", "    values = rank0_only(rank, initial_values, args, num_outputs)")],
        "guards": ["tests/test_fsdp.py::test_fsdp_builds_the_models_values_on_rank_0_alone_and_the_others_only_its_shapes"],
        "mutation": ("fsdp.py", "    values = rank0_only(rank, initial_values, args, num_outputs)\n",
                     "    values = initial_values(args, num_outputs)\n"),
    },
    {
        "title": "FSDP on the meta device: buffers that state dicts leave out",
        "mistake": "filling a model built on the meta device from rank 0's state dict alone",
        "symptom": "non-persistent buffers (a transformer's causal mask, rotary tables) are not in a state dict: "
                   "after `to_empty` they hold whatever the memory held, and the model computes garbage",
        "correct": "after the state dict, rank 0 copies its values' buffers into the sharded model and "
                   "broadcasts each to every process",
        "fix": [("fsdp.py", "                    buffer.copy_(values[name])")],
        "guards": ["tests/test_seam.py::test_fsdp_copy_trains_what_one_process_trains_and_validates_exactly"],
        "mutation": ("fsdp.py", "                    buffer.copy_(values[name])\n", "                    pass\n"),
    },
    {
        "title": "Activation checkpointing counts each batch twice in BatchNorm's statistics",
        "mistake": "`torch.utils.checkpoint` around a block with BatchNorm, and nothing else",
        "symptom": "the recomputation in backward is a second training-mode forward: it updates the running "
                   "mean and variance again (pytorch#96136); the weights are right, the model validated and "
                   "saved is not the one trained without checkpointing",
        "correct": "the recomputation runs in a context (`context_fn`) that gives the block's buffers their "
                   "values from before it back",
        "fix": [("fsdp.py", "context_fn=lambda: (contextlib.nullcontext(), buffers_kept(block))")],
        "guards": ["tests/test_fsdp.py::test_fsdp_activation_checkpointing_trains_bitwise_the_same_model[resnet18-bf16]"],
        "mutation": ("fsdp.py", "buffers_kept(block))", "contextlib.nullcontext())"),
    },
    {
        "title": "Activation checkpointing without the first run's random state",
        "mistake": "recomputing a block's forward with `preserve_rng_state=False`, to save the state's copy",
        "symptom": "dropout and stochastic depth drop other elements in the recomputation than in the forward: "
                   "the gradients are of another network than the loss",
        "correct": "leave `preserve_rng_state` on (the default): the recomputation starts from the random state "
                   "the forward started from",
        "fix": [("fsdp.py", "            forward, *args, use_reentrant=False,")],
        "guards": ["tests/test_fsdp.py::test_fsdp_activation_checkpointing_trains_bitwise_the_same_model[efficientnet_b0]"],
        "mutation": ("fsdp.py", "            forward, *args, use_reentrant=False,",
                     "            forward, *args, use_reentrant=False, preserve_rng_state=False,"),
    },
    {
        "title": "FSDP: the data position counted in this run's processes",
        "mistake": "resuming mid-epoch by skipping steps x accumulation x batch x the *current* number of "
                   "processes (or each process's own share, as ddp_full.py does)",
        "symptom": "on as many processes as before, exact; on another number, samples of the epoch are skipped "
                   "or seen twice",
        "correct": "keep the position in the epoch's order as the samples all processes consumed "
                   "(`epoch_position`), and deal the rest of the order afresh to this run's processes",
        "fix": [("fsdp.py", "train_loader.sampler.set_start(state.epoch_position)")],
        "guards": ["tests/test_fsdp.py::test_fsdp_resumes_on_4_then_3_processes_resharded_at_the_same_sample"],
        "mutation": ("fsdp.py", "train_loader.sampler.set_start(state.epoch_position)",
                     "train_loader.sampler.set_start(state.step_in_epoch * args.accum_steps * args.batch_size "
                     "* world_size)"),
    },
    {
        "title": "FSDP: model.pt saved from rank 0's state_dict()",
        "mistake": "`torch.save(model.state_dict())` on rank 0 of a sharded model",
        "symptom": "rank 0's DTensor shards, not the model: the file does not load into the plain model",
        "correct": "`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))` "
                   "on every process: rank 0 receives the whole model on its CPU, with the plain model's keys",
        "fix": [("fsdp.py", "full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,")],
        "guards": ["tests/test_fsdp.py::test_fsdp_on_2_processes_with_accumulation_trains_what_one_process_trains"],
        "mutation": ("fsdp.py", "full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,\n"
                                "                                                                cpu_offload=True))",
                     "full = model.state_dict()"),
    },
    {
        "title": "FSDP: DTensor's caches keep the process group alive",
        "mistake": "destroying the process group with DTensor's caches of sharding plans still full",
        "symptom": "the caches hold the device mesh, and the mesh its process group: its gloo threads run on "
                   "after destroy_process_group() until the interpreter's exit, where they can abort a finished "
                   "run (\"terminate called without an active exception\")",
        "correct": "empty the caches first (`release_device_meshes` in `cleanup_distributed`), as torch's own "
                   "tests do",
        "fix": [("fsdp.py", "    release_device_meshes()")],
        "guards": ["tests/test_teardown.py::test_no_gloo_thread_outlives_main_after_a_finished_run"],
        "mutation": ("fsdp.py", "    release_device_meshes()\n    gc.collect()\n", "    gc.collect()\n"),
    },
    {
        "title": "FSDP: a sharded checkpoint keeps some process's BatchNorm statistics",
        "mistake": "saving BatchNorm's running statistics as they are in each process",
        "symptom": "buffers are not sharded and each process has updated its own; dcp.save keeps one copy, from "
                   "whichever process its plan picks: a resumed resnet18 validated differently (loss 11.884 "
                   "against 11.957)",
        "correct": "broadcast rank 0's buffers (the statistics validated and saved) before the sharded save",
        "fix": [("fsdp.py", "    # rank 0's (those validated) go to every process first.")],
        "guards": ["tests/test_cluster.py::test_sigterm_stops_after_the_optimizer_step_and_a_batchnorm_model_resumes_bitwise"
                   "[fsdp.py-0]"],
        "mutation": ("fsdp.py", "    broadcast_buffers(model)\n"
                                "    model_state, optimizer_state = get_state_dict(model, optimizer)\n",
                     "    model_state, optimizer_state = get_state_dict(model, optimizer)\n"),
    },
    {
        "title": "HSDP with accumulation: an all-reduce across nodes every micro-batch",
        "mistake": "leaving FSDP's all-reduce across replicas on for every micro-batch of an accumulation group",
        "symptom": "nothing fails, and the weights are the same: each micro-batch's backward sends its reduce-"
                   "scattered gradients across the replicas (across nodes, the slowest link), K times a step with "
                   "K micro-batches (the CNN on 2 x 2 processes, 2 micro-batches: 192 all-reduces in 24 steps, not 96)",
        "correct": "model.set_requires_all_reduce(last_in_group): every micro-batch reduce-scatters within its "
                   "replica, and FSDP adds the shards up until the group's last sends their sum across, once a step",
        "fix": [("fsdp.py", "model.set_requires_all_reduce(last_in_group)")],
        "guards": ["tests/test_fsdp.py::test_hsdp_all_reduces_across_replicas_once_a_step_with_accumulation"],
        "mutation": ("fsdp.py", "        model.set_requires_all_reduce(last_in_group)\n", ""),
    },
    {
        "title": "A write that fails ends in a traceback",
        "mistake": "letting the error of a checkpoint or model write escape: the OSError (errno 28, no space "
                   "left), or the RuntimeError (\"unexpected pos\") that torch.save raises while handling it",
        "symptom": "about 100 lines of traceback from every process and torchrun, and nothing that says which "
                   "checkpoint is still whole",
        "correct": "`save_file`'s `atomic` turns the OSError, or the one behind torch.save's RuntimeError, into one line "
                   "naming the file, the space left and the newest complete checkpoint; exit status 74 (EX_IOERR)",
        "fix": [("ddp_full.py", 'raise ConfigError(f"cannot write {path}: {cause.strerror or cause} "')],
        "guards": ["tests/test_failures.py::"
                   "test_a_full_disk_at_a_checkpoint_is_one_line_exit_74_and_the_run_resumes_from_the_last_one"],
        "mutation": ("ddp_full.py", '            raise ConfigError(f"cannot write {path}: {cause.strerror or cause} "\n'
                                    '                              f"({free_space(path)}); the files already in '
                                    '--out-dir are whole",\n                              status=EXIT_WRITE_FAILED) '
                                    'from None\n', "            raise\n"),
    },
    {
        "title": "Rank 0 writes alone while the others run on",
        "mistake": "`if rank == 0: save(...)` with no word back to the other processes",
        "symptom": "when rank 0's write fails, it exits and the others die in their next collective (\"Connection "
                   "closed by peer\", a traceback each) or are killed by torchrun",
        "correct": "the others wait for rank 0's verdict (`rank0_only`): a write that fails stops every process "
                   "at the same point, with one line",
        "fix": [("ddp_full.py", "rank0_only(rank, save_file, checkpoint, path)")],
        "guards": ["tests/test_failures.py::"
                   "test_a_full_disk_at_a_checkpoint_is_one_line_exit_74_and_the_run_resumes_from_the_last_one"],
        "mutation": ("ddp_full.py", "    rank0_only(rank, save_file, checkpoint, path)\n",
                     "    if rank == 0:\n        save_file(checkpoint, path)\n"),
    },
    {
        "title": "An error only some processes meet, reported by rank 0",
        "mistake": "printing every `ConfigError` from rank 0 alone, the error a process meets by itself included "
                   "(a local rank with no GPU)",
        "symptom": "8 processes on a 4-GPU node: ranks 4-7 exit with status 2, torchrun stops the rest, and no "
                   "line says why",
        "correct": "such an error names its rank (`ConfigError(..., rank=rank)`) and that process prints it; bad "
                   "input every process meets stays one line from rank 0",
        "fix": [("ddp_full.py", 'f"are visible: start at most one process per GPU", rank=rank)')],
        "guards": ["tests/test_failures.py::test_more_processes_than_gpus_is_a_line_from_each_process_that_has_no_gpu"],
        "mutation": ("ddp_full.py", 'f"are visible: start at most one process per GPU", rank=rank)',
                     'f"are visible: start at most one process per GPU")'),
    },
    {
        "title": "A section \"your data and model\" without a name the script uses",
        "mistake": "calling a name of the section \"your data and model\" that a user's copy of it lacks",
        "symptom": "`NameError`, a traceback from every process, at start-up or midway (`pretrained_weights` at "
                   "`--init-from pretrained`, `RESUME_MAY_CHANGE_TASK` at a resume)",
        "correct": "`check_task()` first ([your-task.md](your-task.md)): a missing name is one line naming it and "
                   "what it must do, before any work",
        "fix": [("ddp_full.py", "    check_task()")],
        "guards": ["tests/test_failures.py::test_a_section_without_a_name_the_script_uses_stops_before_any_work_naming_it"
                   "[ddp_full.py-add_task_arguments]"],
        "mutation": ("ddp_full.py", "        # [optional: section check]\n        check_task()\n", ""),
    },
    {
        "title": "FSDP: a sharded write that fails leaves its directory",
        "mistake": "raising when `dcp.save` fails without removing the temporary checkpoint directory",
        "symptom": "`.step_N.tmp/` with every process's partial shards stays behind, holding the space a full disk "
                   "most needs",
        "correct": "every process gets the failures from dcp.save; rank 0 removes the directory, and each process "
                   "that failed prints its line",
        "fix": [("fsdp.py", "raise shard_write_error(err, rank, final, path) from None")],
        "guards": ["tests/test_failures.py::"
                   "test_a_full_disk_at_a_sharded_checkpoint_leaves_no_partial_directory_and_resumes"],
        "mutation": ("fsdp.py", "        if rank == 0:\n            shutil.rmtree(path, ignore_errors=True)  # a partial "
                                "checkpoint is no checkpoint\n        raise shard_write_error(",
                     "        raise shard_write_error("),
    },
    {
        "title": "Every process of another node preparing the data at once",
        "mistake": "rank 0 first, then all the others together (`if rank == 0` and a barrier)",
        "symptom": "where each node has a data directory of its own, its processes download into it together, "
                   "writing the same files at once (torn archives, failed extractions)",
        "correct": "rank 0 first, then the first process of each other node (`LOCAL_RANK` 0), then the rest: one "
                   "writer per directory, and rank 0's copy serves every node where the directory is shared",
        "fix": [("ddp_basic.py", "    for turn in turns or [rank == 0, rank != 0 and first_of_node, not first_of_node]:")],
        "guards": ["tests/test_cluster.py::test_data_preparation_runs_once_per_node_directory_on_the_first_process_"
                   "of_the_node[a-directory-per-node]"],
        "mutation": ("ddp_basic.py", "    for turn in turns or [rank == 0, rank != 0 and first_of_node, not first_of_node]:",
                     "    for turn in turns or [rank == 0, rank != 0, False]:"),
    },
    {
        "title": "A process that cannot see the data, silent",
        "mistake": "rank 0 reads the data first, then the others, each on its own: a ConfigError on another "
                   "process is printed by rank 0 only, which did not meet it",
        "symptom": "a node whose disk lacks the data exits with status 2 and no line; rank 0 runs on into DDP's "
                   "first collective and dies there on a closed connection, a traceback",
        "correct": "after the others have read it, one all-gather of their verdicts: each process that failed "
                   "prints its line with its rank, and every process stops there (`stop_if_any_failed`)",
        "fix": [("ddp_basic.py", "raise ConfigError(str(result), result.status, rank=rank)")],
        "guards": ["tests/test_failures.py::test_data_that_one_process_cannot_see_is_a_line_from_that_process"],
        "mutation": ("ddp_basic.py", "raise ConfigError(str(result), result.status, rank=rank)",
                     "raise ConfigError(str(result), result.status)"),
    },
    {
        "title": "An optional part that the rest still reads",
        "mistake": "code outside a part's `# [optional: NAME]` tags that reads what the part defines: the "
                   "recipe line printing `args.lr_schedule`, the section \"your data and model\" calling "
                   "`read_state_dict` of `--init-from`",
        "symptom": "a copier deletes what the copier's map says may go, and the trainer dies at start-up "
                   "(`AttributeError: 'Namespace' object has no attribute 'lr_schedule'`) or at the first use",
        "correct": "what a part defines is read inside its own tags only; `tests/test_copiers_map.py` deletes "
                   "each part, then all, checks that no deleted flag or function is read, and runs the rest",
        "fix": [("ddp_full.py", "    constant lr       --lr-schedule constant: --lr throughout, no warm-up")],
        "guards": ["tests/test_copiers_map.py::test_each_part_deletes_alone_and_the_rest_reads_nothing_it_defined",
                   "tests/test_copiers_map.py::test_the_lean_copy_trains_resumes_and_validates_as_the_full_script"],
        "mutation": ("ddp_full.py", '            f", schedule {args.lr_schedule}"  # [optional: constant lr]\n',
                     '            f", schedule {args.lr_schedule}"\n'),
    },
    {
        "title": "BatchNorm given a training batch of one sample",
        "mistake": "a model that ends in a 1x1 feature map (resnet18 fed 32-pixel images) with BatchNorm, and a "
                   "training batch of 1: `--batch-size 1`, or an epoch's last batch of the samples a process gets",
        "symptom": "`ValueError: Expected more than 1 value per channel when training`, a traceback; at an "
                   "epoch's end, after the epoch's work, from the processes whose last batch holds one sample",
        "correct": "`check_model_fits` also runs the smallest training batch, in training mode, on the meta "
                   "device: one `error:` line before anything is trained, naming the batch",
        "fix": [("ddp_full.py", '        batch_loss(model.train(), to_device(batch, "meta", False))')],
        "guards": ["tests/test_bad_input.py::"
                   "test_an_epochs_last_batch_of_one_sample_per_process_is_found_before_training"],
        "mutation": ("ddp_full.py", '        batch_loss(model.train(), to_device(batch, "meta", False))\n', ""),
    },
    {
        "title": "A run started among a later run's checkpoints",
        "mistake": "starting afresh (`--resume none`), or from an older checkpoint, in an --out-dir whose "
                   "checkpoints/ holds later steps, and resuming by the newest step",
        "symptom": "the run's first restart (torchrun's `--max-restarts`, a requeued job, the same command) "
                   "goes on from the later checkpoint: another run's weights, schedule and history, silently",
        "correct": "`find_checkpoint` refuses a start before the newest checkpoint there: one line naming it, "
                   "before any step, nothing written",
        "fix": [("ddp_full.py", "if candidates and int(CHECKPOINT_NAME.match(candidates[0].name)[1]) > start:")],
        "guards": ["tests/test_resume.py::"
                   "test_a_run_that_starts_before_its_out_dirs_newest_checkpoint_is_one_clear_error_and_writes_nothing"],
        "mutation": ("ddp_full.py", "if candidates and int(CHECKPOINT_NAME.match(candidates[0].name)[1]) > start:",
                     "if False:"),
    },
    {
        "title": "A resume's first step in DDP's first-step bucket",
        "mistake": "resuming a DDP run on 3 or more processes as it stands: DDP all-reduces a run's first "
                   "step in one bucket of every gradient and re-buckets them after it, in backward's order",
        "symptom": "the resumed run's first step sums the gradients in another order than the run it resumes "
                   "did at that step, rounds otherwise, and drifts from it (bitwise on 2 processes only)",
        "correct": "a resume on 3 or more processes takes one throwaway step first, undone by the restore, so "
                   "every real step all-reduces in the buckets the run had",
        "fix": [("ddp_full.py", "if dist.get_world_size() > 2:  # DDP re-buckets after a first step")],
        "guards": ["tests/test_augmentation.py::"
                   "test_resume_of_resnet18_on_three_processes_with_augmenting_workers_is_bitwise"],
        "mutation": ("ddp_full.py", "if dist.get_world_size() > 2:  # DDP re-buckets after a first step",
                     "if False:  # DDP re-buckets after a first step"),
    },
    {
        "title": "A task's flag of type Path in the checkpoint",
        "mistake": "saving `vars(args)` in the checkpoint as it is, where a section's flag has `type=Path`",
        "symptom": "every checkpoint is written, and none can be read: `torch.load(weights_only=True)` refuses "
                   "a pickled Path, so every resume finds no usable checkpoint, after hours of training",
        "correct": "the settings saved as JSON values (a Path as its text), compared as JSON values at resume",
        "fix": [("ddp_full.py", '"config": json.loads(json.dumps(vars(args), default=str)),'),
                ("fsdp.py", '"config": json.loads(json.dumps(vars(args), default=str)),')],
        "guards": ["tests/test_resume.py::test_a_task_flag_of_type_path_leaves_checkpoints_a_resume_can_read"],
        "mutation": ("ddp_full.py", '"config": json.loads(json.dumps(vars(args), default=str)),',
                     '"config": vars(args),'),
    },
    {
        "title": "fp16's skipped first step taken for a misordered schedule",
        "mistake": "leaving torch's warning to speak when fp16's GradScaler skips the first optimizer step, "
                   "as GPUs often make it do: `Detected call of lr_scheduler.step() before optimizer.step()`",
        "symptom": "every process warns of a call order the script does not make; a user who quiets it by "
                   "stepping the schedule only after a step taken leaves the schedule a step behind for each "
                   "skip, short of its end",
        "correct": "a skipped step keeps its place in the schedule, which ends with the run, and the script "
                   "filters that one warning, saying why",
        "fix": [("ddp_amp_accum.py", 'warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step"'),
                ("ddp_full.py", 'warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step"'),
                ("fsdp.py", 'warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step"')],
        "guards": ["tests/test_amp.py::test_an_fp16_step_the_scaler_skips_takes_its_rate_and_warns_nothing"
                   "[ddp_amp_accum.py]"],
        "mutation": ("ddp_amp_accum.py",
                     'warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)',
                     "pass"),
    },
    {
        "title": "A copy of the checkpoint in every process",
        "mistake": "resuming with a plain `torch.load` of the checkpoint in every process",
        "symptom": "a node's processes each read the model and its optimizer state into host memory at once: "
                   "8 GPUs, 8 copies (a 1.5-billion-parameter model with AdamW: about 150 GB), and the resume "
                   "dies of the out-of-memory killer on a node that trains it with room to spare",
        "correct": "`torch.load(..., mmap=True)` (for a zip file, as `torch.save` writes): the file's pages, "
                   "shared in the page cache and read as they are restored; a process that writes a page "
                   "(a CPU's optimizer state, restored in place) gets a copy of that page alone",
        "fix": [("ddp_full.py", "mmap=zipfile.is_zipfile(path))  # not zip")],
        "guards": ["tests/test_resume.py::"
                   "test_a_resume_maps_the_checkpoint_into_memory_rather_than_reading_a_copy_into_each_process"],
        "mutation": ("ddp_full.py", "mmap=zipfile.is_zipfile(path))  # not zip", "mmap=False)  # not zip"),
    },
    {
        "title": "A negative --accum-steps that trains nothing",
        "mistake": "using `--accum-steps` as given, unchecked, where a trainer without up-front value checks "
                   "(a lean copy) meets it",
        "symptom": "with a negative count no group of micro-batches ever ends: the run takes no optimizer step, "
                   "prints its epochs (the loss flat), saves its initial weights and exits 0; 0 divides by zero",
        "correct": "`train()` checks the count where it meets it: one line, exit 2, nothing written (the value "
                   "checks say the same before any work in the whole scripts)",
        "fix": [("ddp_amp_accum.py", "if args.accum_steps < 1:"), ("ddp_full.py", "if args.accum_steps < 1:"),
                ("fsdp.py", "if args.accum_steps < 1:")],
        "guards": ["tests/test_bad_input.py::test_a_negative_accum_steps_is_one_clear_error_in_the_lean_copy_too"
                   "[ddp_amp_accum.py--1]"],
        "mutation": ("lean/ddp_amp_accum.py", "if args.accum_steps < 1:", "if False:"),
    },
    {
        "title": "A resume on other data, its schedule misplaced",
        "mistake": "letting `--data-dir` change on a resume (the data staged elsewhere, as it may) without "
                   "checking that it holds the same data",
        "symptom": "the restored schedule counts the checkpoint's steps per epoch: on half the images the "
                   "cosine runs past its end and the rate climbs back to its peak, on more it never reaches "
                   "zero; no error, exit 0",
        "correct": "the checkpoint records the training set's size and a resume on another is one line, exit 2, "
                   "nothing written; the same data in another folder resumes bitwise",
        "fix": [("ddp_full.py", 'if checkpoint["train_set_size"] != len(train_loader.dataset):'),
                ("fsdp.py", 'if checkpoint["train_set_size"] != len(train_loader.dataset):')],
        "guards": ["tests/test_resume.py::test_a_resume_may_move_the_data_but_not_change_it[ddp_full.py]"],
        "mutation": ("ddp_full.py", 'if checkpoint["train_set_size"] != len(train_loader.dataset):', "if False:"),
    },
    {
        "title": "A random split drawn before the seed",
        "mistake": "seeding just before the model is built, after the data section has run",
        "symptom": "a section that splits its data at random (`random_split` on the global generator) draws "
                   "from torch's own seed, which differs between processes and runs: each process holds "
                   "another split, one trains on another's held-out samples, and `--seed` repeats nothing",
        "correct": "`set_seed(args.seed)` first, before the data section: every process and every run draws "
                   "the same split; and again before the model, whose weights start from the seed alone",
        "fix": [(script, "set_seed(args.seed)  # first: a random split the data section draws is the same")
                for script in ("single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py",
                               "ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_data.py::"
                   "test_a_random_split_in_the_data_section_is_the_same_in_every_process_and_every_run[ddp_basic.py]"],
        "mutation": ("ddp_basic.py", "set_seed(args.seed)  # first:", "pass  # first:"),
    },
    {
        "title": "A stray WORLD_SIZE taken for the world",
        "mistake": "reading the world size from `WORLD_SIZE` in the environment, while a run without `RANK` "
                   "(plain `python`) starts a group of one",
        "symptom": "a `WORLD_SIZE=2` left in the shell: the one process samples its share of two, trains on "
                   "half the data and says \"2 processes\", exit 0",
        "correct": "the size of the group the process joined, `dist.get_world_size()`",
        "fix": [(script, "return rank, local_rank, dist.get_world_size(), device")
                for script in ("ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_equivalence.py::"
                   "test_a_stray_world_size_under_plain_python_is_a_world_of_one_that_trains_on_all_the_data"
                   "[ddp_basic.py]"],
        "mutation": ("ddp_basic.py", "return rank, local_rank, dist.get_world_size(), device",
                     'return rank, local_rank, int(os.environ.get("WORLD_SIZE", 1)), device'),
    },
    {
        "title": "A short last batch weighed as a full one in accumulation",
        "mistake": "dividing each micro-batch's mean loss by the number of micro-batches in its group",
        "symptom": "where a process's samples do not divide by --batch-size, the epoch's last group is a mean "
                   "of means: its short batch's samples weigh more than the others', and `--accum-steps 5 "
                   "--batch-size 8` on 2 processes no longer trains what one process does with 80 (the CNN's "
                   "weights 1.2e-3 apart after 2 epochs of 186 samples); nothing fails",
        "correct": "each micro-batch's mean weighted by its count, the step's gradients divided by all "
                   "processes' count (`divide_by_count`): the group's mean, a short last batch included",
        "fix": [(script, "scaler.scale(loss * (count / held)).backward()")
                for script in ("ddp_amp_accum.py", "ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_equivalence.py::"
                   "test_accumulation_matches_one_process_on_the_global_batch_including_a_short_last_batch"
                   "[ddp_amp_accum.py]"],
        "mutation": ("ddp_amp_accum.py", "scaler.scale(loss * (count / held)).backward()",
                     "scaler.scale(loss / (group_end - group_start)).backward()"),
    },
    {
        "title": "A token count that scales the step",
        "mistake": "weighing each micro-batch's mean by its count over the group's samples (`held`) and "
                   "stopping there, as if the count were always samples",
        "symptom": "a section that counts tokens, as the demo counts its labels and an LM author counts "
                   "targets, scales every gradient by the tokens per sample: a character model's copy of "
                   "ddp_amp_accum.py, ddp_full.py or fsdp.py trains to `loss nan` (or a loss in the "
                   "hundreds of thousands) where the same section counting samples learns; with padded "
                   "sequences, processes holding fewer real tokens weigh as much as the others; exit 0",
        "correct": "the step's gradients divided by the count of all processes' micro-batches "
                   "(`divide_by_count`, one all-reduce of a number a step): the global batch's mean over "
                   "its samples or tokens, whichever the section counts",
        "fix": [(script, "per_sample = divide_by_count(model, group_count, held)")
                for script in ("ddp_amp_accum.py", "ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_sections.py::"
                   "test_a_section_counting_tokens_trains_as_the_same_section_counting_samples[ddp_amp_accum.py]"],
        "mutation": ("ddp_amp_accum.py", "        per_sample = divide_by_count(model, group_count, held)\n",
                     "        per_sample = torch.ones((), dtype=torch.float64)\n"),
    },
    {
        "title": "A divergence only one process sees",
        "mistake": "checking each process's own loss for nan (or none at all)",
        "symptom": "the process whose loss went nan stops and the others train on, to die in their next "
                   "collective on a closed connection, a traceback each; unchecked, every process trains on "
                   "nan weights to the end, writes them and exits 0",
        "correct": "at every progress line one all-reduce of the processes' sums: where any loss is not "
                   "finite, every process stops at that line, one line from rank 0, exit status 3",
        "fix": [(script, "seen = totals.clone()") for script in ("ddp_basic.py", "ddp_amp_accum.py",
                                                                "ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_divergence.py::"
                   "test_a_loss_that_is_not_finite_on_one_process_stops_every_process_in_one_line[ddp_amp_accum.py]"],
        "mutation": ("ddp_amp_accum.py", "    seen = totals.clone()\n    dist.all_reduce(seen)\n",
                     "    seen = totals.clone()\n"),
    },
    {
        "title": "Weights that are not finite, written",
        "mistake": "writing a checkpoint or `model.pt` as it is, trusting the loss checked at the last "
                   "progress line",
        "symptom": "an update that went wrong after the last progress line (a loss shows it a step later) is "
                   "saved: a checkpoint of nan weights, which `--keep-last 1` keeps in place of the last "
                   "finite one, and the same command resumes from it",
        "correct": "every value counted before a write, on every process, all-reduced: one not finite and "
                   "nothing is written, every process stops with exit status 3, the newest checkpoint stays "
                   "the last finite one",
        "fix": [("ddp_full.py", "stop_if_not_finite(args, tensors_in([checkpoint, per_process]), path.name)"),
                ("fsdp.py", "stop_if_not_finite(args, tensors_in([checkpoint, per_process, shards]), path.name)")]
               + [(script, 'stop_if_not_finite(args, model') for script in (
                   "single_gpu.py", "dataparallel.py", "ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py")]
               + [("fsdp.py", 'stop_if_not_finite(args, tensors_in(model.state_dict()), "model.pt")')],
        "guards": ["tests/test_divergence.py::test_weights_that_are_not_finite_are_never_written[ddp_full.py]"],
        "mutation": ("ddp_full.py", "    stop_if_not_finite(args, tensors_in([checkpoint, per_process]), path.name)\n", ""),
    },
    {
        "title": "A restart that replays a divergence",
        "mistake": "letting torchrun's restart resume a run that diverged as it resumes any other",
        "symptom": "under `--max-restarts 3` each restart resumes from the checkpoint before the divergence, "
                   "with the same settings, and diverges again: three times the time, three identical errors",
        "correct": "the run notes the divergence in `--out-dir` (`diverged.json`); a start from the same "
                   "checkpoint with the same settings stops at once in one line that says what to change",
        "fix": [(script, "    stop_if_repeating(args, path)  #") for script in ("ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_divergence.py::test_a_restart_does_not_replay_a_divergence[ddp_full.py]"],
        "mutation": ("ddp_full.py", "        stop_if_repeating(args, path)  # [optional: divergence note]\n", ""),
    },
    {
        "title": "A resume after a divergence that keeps the old --lr",
        "mistake": "allowing another `--lr` on resume but restoring the schedule as saved",
        "symptom": "LambdaLR's state holds its base rates: the resumed run goes on with the rate that "
                   "diverged, whatever `--lr` says, and diverges again",
        "correct": "after the restore the schedule's base rates are this run's `--lr`, and the current rate "
                   "recomputed at the same step (the same value where `--lr` did not change)",
        "fix": [(script, "scheduler.base_lrs = [base * lr / saved for base in scheduler.base_lrs]")
                for script in ("ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_divergence.py::"
                   "test_after_a_divergence_a_lower_lr_goes_on_from_the_checkpoint_before_it[ddp_full.py]"],
        "mutation": ("ddp_full.py", "        scheduler.base_lrs = [base * lr / saved for base in scheduler.base_lrs]\n",
                     "        pass\n"),
    },
    {
        "title": "fp16 skipping every step in silence",
        "mistake": "taking every step the GradScaler skips for the usual overflow",
        "symptom": "gradients that overflow fp16 whatever the scale: every step is skipped, the scale halves "
                   "toward 0, the weights never change, and the run ends with exit 0 and the starting model",
        "correct": "skipped steps are normal until the scale falls below 1, where even the unscaled gradients "
                   "overflow fp16: there every process stops, one line suggesting bf16, exit status 3",
        "fix": [(script, "if scaler.is_enabled() and (scale := scaler.get_scale() * per_sample.item()) < 1:")
                for script in ("ddp_amp_accum.py", "ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_divergence.py::"
                   "test_fp16_skips_steps_whose_gradients_overflow_until_the_loss_scale_falls_below_1[ddp_amp_accum.py]"],
        "mutation": ("ddp_amp_accum.py", "if scaler.is_enabled() and (scale := scaler.get_scale() * per_sample.item()) < 1:",
                     "if False:"),
    },
    {
        "title": "Attention left to its fused kernels under --deterministic",
        "mistake": "taking `torch.use_deterministic_algorithms(True, warn_only=True)` for deterministic attention",
        "symptom": "on CUDA, flash, memory-efficient and cuDNN attention only warn under warn_only and add their "
                   "backward's blocks in any order: a transformer's resume is not bitwise under the flag that "
                   "promises it, one warning in the log",
        "correct": "under `--deterministic`, on CUDA only, the fused attention kernels off, the math one left "
                   "(matmuls and a softmax); the CPU's attention untouched",
        "fix": [(script, "            torch.backends.cuda.enable_flash_sdp(False)")
                for script in ("ddp_full.py", "fsdp.py")],
        "guards": ["tests/test_gpu_paths.py::"
                   "test_deterministic_on_cuda_gives_attention_its_math_kernel_and_leaves_the_cpus_alone[ddp_full.py]"],
        "mutation": ("ddp_full.py", "            torch.backends.cuda.enable_flash_sdp(False)\n", ""),
    },
]
