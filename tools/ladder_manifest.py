"""What each step of the ladder changes, and which concept each change serves.

Read by the diff guard (tests/test_ladder_diffs.py), which fails when the scripts and this file
disagree, and by tools/make_diffs.py, which writes a guided page per step from it.

For each step (the later script of a pair):
  concepts    the concepts the step teaches, in teaching order: (key, title, why it matters)
  regions     every region (tools/ladder.py) the step changes or adds, with the concept it serves:
              a key, or for a region that serves several, (marker, key) pairs -- each change of
              the region goes to the first pair whose marker is in its changed lines; a marker
              "removed:<text>" takes the removed statements holding <text> on their own
              (tools/ladder.py, tag_chunks)
  removed     regions the step removes, with their concept
  ahead       optional: {name: key} for a name that a section uses before the section `key`
              introduces it (one line, say, that serves both); the page says where it comes from
  flags_added the new command-line flags
  flags_removed optional: {flag: why} for a flag the step removes (a flag otherwise lives on)
  diff_size   (lines added, lines removed) of the whole diff, as `diff -u` counts them
  notes       optional: {key: [paragraph (Markdown), or (image file in docs/diffs, its alt text)]}:
              more why, under the concept's own, on the guided page
  mechanisms  the new functions and classes that carry a concept (the code a reader must see to
              write it): a guided page shows each whole, in its concept's section; a new definition
              not named here only serves bookkeeping, and shows its signature and docstring
The key "top" opens a guided page with the docstring and the imports (SHOWN_AT_TOP); the key
"flags" closes it with the new flags and their checks (SHOWN_AT_END): each shown once, whatever
concept it serves, so the concepts' sections between them hold the code the concepts are made of.
"""

# Regions that declare what a step needs. A guided page shows their changes once, whatever concept
# each serves: the docstring and the imports in the top section, the flags with their bounds and
# checks in the closing one (bookkeeping: a reader meets each flag first where a section reads it).
SHOWN_AT_TOP = ("docstring", "imports")
SHOWN_AT_END = ("parse_args", "AT_LEAST", "POSITIVE", "check_args")

TOP = ("top", "The top of the file: docstring and imports",
       "How to launch the step, and what it newly imports, each put to use in a section below.")
FLAGS = ("flags", "Flags and their checks: what changed",
         "The flags the sections above read (args.name for --name), new or changed, with their defaults "
         "and help, and the checks that stop a bad value in one line.")
# The sections that frame a guided page rather than teach a concept of their own.
FRAME = (TOP[0], FLAGS[0])

MANIFEST = {
    "dataparallel.py": {
        "concepts": [
            ("dataparallel", "nn.DataParallel, and why not",
             "One line wraps the model and splits each batch across all visible GPUs, in one "
             "process. The docstring says why that does not scale; the loader drops a short last "
             "batch, since a chunk of one sample fails in BatchNorm."),
        ],
        "regions": {"docstring": "dataparallel", "build_loaders": "dataparallel", "train": "dataparallel"},
        "removed": {},
        "flags_added": set(),
        "diff_size": (36, 10),
    },
    "ddp_basic.py": {
        "concepts": [
            TOP,
            ("group", "Processes and the process group",
             "torchrun starts one process per device. Each reads its rank from the environment, "
             "drives one GPU (set_device) and joins the process group with a timeout; each leaves "
             "it cleanly, the DDP model released first."),
            ("shard", "Every process reads its own shard",
             "DistributedSampler gives each process every world_size-th sample of one shared "
             "shuffle, so together they read what one process would, padded with a few repeated "
             "samples where the set does not divide evenly. set_epoch makes every epoch shuffle "
             "anew. The processes of a node share its CPUs: each gets its share of loader workers. "
             "DataParallel's drop_last goes: each process trains on its short last batch, so no "
             "sample is left out (a BatchNorm model that pools to 1x1 fails on a last batch of one "
             "sample: ddp_full.py checks for it first)."),
            ("ddp", "DDP averages the gradients",
             "Wrapped in DDP, every copy of the model starts from rank 0's weights and gets the "
             "average gradient in backward, so all copies take the same step: the loop itself "
             "(forward, loss.backward(), optimizer.step()) is unchanged. The global batch is the "
             "per-process batch times the world size."),
            ("rank0", "Rank 0 speaks, writes and validates",
             "Every process runs every line; only rank 0 prints, writes files and validates, "
             "through model.module. rank0_only calls a function on rank 0 alone; rank0_first calls "
             "it on rank 0, then on each other node's first process, then on the rest, so a "
             "download writes each directory once. A barrier ends each turn: the others wait."),
            ("errors", "An error is one line, from the process that met it",
             "A ConfigError is one line and a non-zero exit: rank 0's for bad input, which every "
             "process meets, or, for an error one process meets alone (a GPU it cannot see), that "
             "process's, naming its rank. When one process exits, torchrun stops the others, which "
             "may wait at a barrier until then; the error exchange (the hardening page) stops them "
             "at once instead, and reports data one node lacks from the process that met it."),
            ("diverged", "A divergence stops every process at once",
             "A loss that is not finite on one process is the run's: each progress line all-reduces "
             "the processes' sums (its loss is all processes' now), and where any is not finite every "
             "process stops at that line, one line from rank 0, exit status 3. Before model.pt is "
             "written its values not finite are counted on every process and all-reduced: what one "
             "update broke after the last progress line is not written either."),
            ("compile", "torch.compile under DDP",
             "--compile compiles the model in place before DDP wraps it. Dynamo skips torch.nn's "
             "own code, DDP's forward among it: a compiled wrapper compiles only what DDP calls, "
             "and nothing of a model whose forward is torch.nn's. Inside DDP's forward the "
             "compiled graph is still cut at the gradient buckets."),
            ("profile", "Where a step's time goes: --profile",
             "An optional part: torch.profiler over optimizer steps 4-6, each process's trace in "
             "--out-dir, and a line per process of its step time, its time in collectives and how "
             "much of that no computation hid."),
            FLAGS,
        ],
        "regions": {
            "docstring": "top",
            "imports": "top",
            "parse_args": "group",
            "POSITIVE": "group",
            "ConfigError": "errors",
            "log": "rank0",
            "setup_distributed": "group",
            "rank0_only": "rank0",
            "rank0_first": "rank0",
            "returning_errors": "errors",
            "stop_if_any_failed": "errors",
            "cleanup_distributed": "group",
            "build_loaders": "shard",
            "train_one_epoch": [("dist.all_reduce", "ddp"), ("all processes", "ddp")],
            "stop_if_diverged": "diverged",
            "stop_if_not_finite": "diverged",
            "start_profiler": "profile",
            "summarize_trace": "profile",
            "train": [("start_profiler", "profile"), ("setup_distributed", "group"), ("process group", "group"),
                      ("rank0_first", "rank0"),
                      ("build_loaders(args, train_set, val_set, device, rank", "shard"),
                      ("set_epoch", "shard"), ("DDP(model", "ddp"),
                      ("global batch", "ddp"),
                      ("DDP wraps it", "compile"), ("device {device} |", "ddp"),
                      ("model.module", "rank0"), ("Rank 0", "rank0"), ("history", "rank0"),
                      ("Save the unwrapped model", "rank0")],
            "main": [("cleanup_distributed", "group"), ("", "errors")],
        },
        "ahead": {"returning_errors": "errors", "stop_if_any_failed": "errors"},
        "removed": {},
        "flags_added": {"--backend", "--local-rank", "--timeout-min", "--find-unused-parameters", "--profile"},
        "mechanisms": {"setup_distributed", "cleanup_distributed", "rank0_only", "rank0_first", "returning_errors",
                       "stop_if_any_failed"},
        "notes": {"ddp": [
            "**Why DDP, not DataParallel.** DataParallel drives every GPU from threads of one process, "
            "which take turns holding the GIL: each forward copies the model from GPU 0 to the others "
            "and scatters the batch, the outputs are gathered on GPU 0 for the loss, and backward "
            "reduces the gradients onto GPU 0, each phase waiting for the one before. DDP runs a "
            "process per GPU, each with its own shard of the data and its own copy of the model: only "
            "the gradients move, all-reduced in buckets while backward still runs, so communication "
            "hides behind computation, GPU 0 does no more than the others, and the processes may be "
            "on several machines. One DataParallel \u2192 DDP migration guide measured ResNet-50 on "
            "4 V100s at 128 samples/s with DataParallel and 382 with DDP (that guide's figure; this "
            "project has not measured it). On one device, or a CPU, DataParallel has nothing to split.",
            ("dp-vs-ddp.png", "Left, DataParallel: one process whose threads drive GPUs 1-3 from GPU 0, "
             "the model copied and the batch scattered every forward, outputs and gradients gathered "
             "back on GPU 0, one phase after another. Right, DDP: a process per GPU, an all-reduce "
             "of gradient buckets overlapping backward."),
            "**Measured.** The same overlap in one step of `ddp_basic.py --model resnet18 --batch-size 32 "
            "--profile` on 2 CPU processes over gloo, drawn from the two traces by "
            "`tools/draw_timeline.py`: each bucket's all-reduce (red) starts while backward (orange) still "
            "runs; the last one ends just after it, and the process whose backward finished first waits "
            "there for the other's last bucket. (The default CNN's gradients fit one bucket: nothing "
            "would overlap.) A GPU's: the [GPU check](../benchmarks.md#the-gpu-check) draws one from nccl's "
            "kernels (no GPU has run it yet). Your run's picture: `--profile`, then the tool "
            "([troubleshooting](../troubleshooting.md#a-run-that-scales-badly)).",
            ("ddp-timeline.png", "Measured: one training step of each of 2 CPU processes (ddp_basic.py, "
             "resnet18, gloo): batch, forward, backward and optimizer step, and under them the buffers' "
             "broadcast and each bucket's all-reduce, overlapping backward."),
            "**The learning rate.** The same command on N GPUs averages each step over N times the "
            "samples (the global batch, printed at start), and `--lr` is not scaled for you. Either keep "
            "the global batch (divide `--batch-size` by N) and keep `--lr`: the same training, which "
            "the tests prove for a model without batch statistics or random draws (one process with "
            "batch N\u00b7B trains the weights N processes with batch B train; BatchNorm's statistics "
            "and dropout's draws are per process); or keep `--batch-size` and multiply `--lr` by N, "
            "the linear scaling rule (Goyal et al., 2017: with a warm-up, which `--warmup-epochs` "
            "gives the scripts' schedule, "
            "it held up to a global batch of 8,192 on ImageNet, not beyond).",
        ]},
        "diff_size": (269, 74),
    },
    "ddp_amp_accum.py": {
        "concepts": [
            TOP,
            ("amp", "Mixed precision, in the layout tensor cores want",
             "torch.autocast runs matmuls and convolutions in bf16 or fp16 and keeps the weights in "
             "float32. fp16's small range needs a GradScaler, which scales the loss up before "
             "backward and the gradients down before the step; bf16 needs none. A step the scaler "
             "skips after an overflow still counts in the schedule, so that it ends when the run does. "
             "torch.amp.GradScaler(device), for any device, is torch 2.3's (torch.cuda.amp's is "
             "deprecated). On GPUs the model and the 4-D inputs are channels-last, the layout of "
             "tensor cores' convolutions (--channels-last)."),
            ("accum", "Gradient accumulation with no_sync",
             "K micro-batches make one optimizer step, their gradients averaged over the global "
             "batch's count: each micro-batch's mean weighs by its count (samples, or tokens: what "
             "batch_loss counts), and divide_by_count divides the step's gradients by all processes' "
             "count, one small all-reduce a step, so a short last batch or a process holding fewer "
             "tokens weighs for what it holds, and the unit of the count does not matter. DDP "
             "decides in the forward whether the backward all-reduces, so no_sync covers the forward "
             "and backward of all but the last micro-batch of a group: one all-reduce per step, not K."),
            ("clip", "Clipping the true gradients",
             "Clipping limits the global gradient norm. With fp16 the gradients are still scaled "
             "after backward: unscale_ divides the scale out first, once per step, so the clip "
             "sees the gradients the step will use."),
            ("diverged", "Divergence, with a loss scale and a gradient norm",
             "A step fp16's scaler skips is normal: its gradients overflowed under the scale, which "
             "halves. Below 1 even the unscaled gradients overflow fp16, and the run stops; so it does "
             "where the gradient norm clipping computes is not finite without the scaler (with it, a "
             "skipped step). The line says what to try: clipping, bf16 rather than fp16."),
            FLAGS,
        ],
        "regions": {
            "docstring": "top",
            "imports": [("contextlib", "accum"), ("warnings", "amp")],
            "AMP_DTYPES": "amp",
            "autocast": "amp",
            "build_scheduler": "amp",
            "configure_cuda": "amp",
            "to_device": "amp",
            "parse_args": [("--amp", "amp"), ("--channels-last", "amp"), ("--accum-steps", "accum"),
                           ("accumulation steps", "accum"), ("--clip-grad-norm", "clip"),
                           ("set_defaults", "accum")],
            "accum_steps_for": "accum",
            "AT_LEAST": "accum",
            "divide_by_count": "accum",
            "stop_if_diverged": "diverged",
            "diverged": "diverged",
            "train_one_epoch": [("grad_norm = None", "clip"), ("{norm}", "clip"), ("grad norm", "clip"),
                                ("stop_if_diverged(args, totals, grad_norm, scaler", "diverged"),
                                ("one schedule step per optimizer step", "accum"), ("totals", "accum"),
                                ("clip_grad_norm", "clip"), ("accum_steps", "accum"),
                                ("num_steps", "accum"), ("group", "accum"),
                                ("sync_context", "accum"), ("scaler", "amp"),
                                ("channels_last", "amp")],
            "evaluate": "amp",
            "train": [("GradScaler", "amp"), ("global batch", "accum"), ("configure_cuda", "amp"),
                      ("memory_format", "amp"), ("channels_last", "amp"),
                      ("math.ceil(len(train_loader)", "accum"), ("scheduler, scaler", "amp"),
                      ("accum_steps < 1", "accum")],
        },
        "removed": {},
        "flags_added": {"--amp", "--accum-steps", "--clip-grad-norm", "--channels-last", "--global-batch-size"},
        "mechanisms": {"autocast"},
        "diff_size": (144, 44),
    },
    "ddp_full.py": {
        "concepts": [
            TOP,
            ("validation", "Exact validation on every process",
             "Each process scores its unpadded shard with rank 0's BatchNorm statistics; one "
             "all-reduce of sums and counts gives the exact metrics."),
            ("state", "Where the run stands: TrainState",
             "A TrainState follows every optimizer step: what processes share and what each "
             "holds alone (its random states, its sums so far)."),
            ("checkpoint", "Writing checkpoints",
             "Rank 0 gathers every process's state and saves it with the rest (save_file, into "
             "checkpoints/, which it makes); the others wait for its verdict: a write that fails "
             "stops all."),
            ("resume", "Finding a checkpoint",
             "Every process loads the newest readable checkpoint, passing over torn or foreign "
             "files; a resumed run must keep the settings that decide what it computes."),
            ("restore", "Restoring what a checkpoint holds",
             "Model, optimizer, schedule, scaler and random states, all put back: a resume at an "
             "epoch's end goes on bitwise as a run never stopped (when exactly: the change in brief, "
             "above). On another number of processes the schedule goes on from the same fraction of "
             "the run; --global-batch-size keeps the global batch."),
            ("midepoch", "Stopping and resuming mid-epoch",
             "--max-steps and --ckpt-steps stop and checkpoint within an epoch; a resume deals the "
             "rest of the epoch (ResumableSampler), on any number of processes."),
            ("preempt", "Preemption: SIGTERM",
             "Every process checks a shared flag before each batch, so all stop at the same one; "
             "the run checkpoints and exits 75 (requeue me)."),
            ("agreement", "Every process resumes from the same checkpoint",
             "One all-gather after the search: processes that found different checkpoints (nodes "
             "that do not share a disk) stop with one line instead of training apart."),
            ("samples", "Augmentation the same in every run",
             "Each sample's random crop and flip is drawn from a seed of (seed, epoch, index): the "
             "same whichever process or loader worker loads it, with any world size, after any "
             "resume."),
            ("unreadable", "A file that cannot be read costs a warning, not the run",
             "In training the next readable sample takes its place (chosen from the index alone, "
             "so every exactness promise holds); in validation it is left out. A set none of whose "
             "first samples can be read is one line before any work."),
            ("reported", "Unreadable files, reported and counted",
             "Each item comes with the files that could not be read for it: the process that met "
             "one warns, naming it and its rank, and metrics.jsonl and the epoch's line count "
             "them."),
            ("failures", "A write that fails: one line, nothing lost",
             "A write that fails (a full disk) is one line naming the file, the space left and the "
             "newest complete checkpoint, exit status 74; the old file stays whole and no temporary "
             "file is left."),
            ("checks", "Checked before any work: the section and the model",
             "A section \"your data and model\" without a name the script uses, and a model that "
             "cannot take the data (tried on the meta device: shapes only), are one line before any "
             "work, not a traceback midway."),
            ("initfrom", "Fine-tuning: --init-from",
             "Rank 0 reads the starting weights (a model.pt, a checkpoint, or the task's pretrained "
             "ones); DDP hands them to every process. Their score is epoch 0 of metrics.jsonl. A "
             "checkpoint wins over them: a resume goes on."),
            ("syncbn", "SyncBatchNorm",
             "--sync-bn: the global batch's statistics, for small per-GPU batches."),
            ("buckets", "DDP's bucket settings",
             "Gradients are all-reduced in buckets as backward fills them; the settings change how "
             "they travel, not what is averaged."),
            ("compression", "Gradients in 16 bits: --grad-compression",
             "An optional part: torch's communication hook sends each bucket in bf16 or fp16, half "
             "the bytes, for a network slower than the GPUs; still one all-reduce per step."),
            ("divergence", "A restart after a divergence",
             "diverged.json notes a divergence: torchrun's restart (the same checkpoint, the same "
             "settings) stops at once, and a resume from that checkpoint may change TAMING's "
             "settings, the rates recomputed from the new --lr."),
            ("flightrec", "A hung collective: nccl's flight recorder",
             "On GPUs each process keeps its last collectives and, when one times out, writes them "
             "to --out-dir: which rank stopped where (docs/troubleshooting.md)."),
            FLAGS,
        ],
        "ahead": {
            "state": "restore",
            "agreed_checkpoint": "agreement",
            "EXIT_REQUEUE": "preempt",
            "PREEMPTION": "preempt",
            "report_unreadable": "reported",
            "check_args": "flags",
            "TAMING": "divergence",
            "divergence_note": "divergence",
            "stop_if_repeating": "divergence",
        },
        "regions": {
            "docstring": "top",
            "imports": [("dataclasses", "state"),
                        ("import re", "checkpoint"), ("shutil", "failures"), ("signal", "preempt"),
                        ("Dataset", "samples"), ("zipfile", "initfrom"), ("default_hooks", "compression")],
            "RESUME_MAY_CHANGE": "resume",
            "TAMING": "divergence",
            "CHECKPOINT_NAME": "checkpoint",
            "EXIT_WRITE_FAILED": "failures",
            "EXIT_REQUEUE": "preempt",
            "UNREADABLE": "unreadable",
            "MAX_UNREADABLE_IN_A_ROW": "unreadable",
            "RESUME_MAY_CHANGE_TASK": "resume",
            "pretrained_weights": "initfrom",
            "TASK_HOOKS": "checks",
            "check_task": "checks",
            "parse_args": [("--grad-compression", "compression"), ("--resume", "resume"), ("--ckpt-epochs", "checkpoint"), ("--keep-last", "checkpoint"),
                           ("--ckpt-steps", "midepoch"), ("--max-steps", "midepoch"),
                           ("--sync-bn", "syncbn"), ("bucket", "buckets"), ("--init-from", "initfrom"),
                           ("--tf32", "restore"), ("--cudnn-benchmark", "restore"), ("--deterministic", "restore"),
                           ("change --epochs", "resume")],
            "AT_LEAST": "checkpoint",
            "POSITIVE": "buckets",
            "configure_cuda": "restore",
            "cleanup_distributed": "preempt",
            "Preemption": "preempt",
            "PREEMPTION": "preempt",
            "ResumableSampler": "midepoch",
            "ShardSampler": "validation",
            "build_loaders": [("ShardSampler", "validation"), ("val_sampler", "validation"),
                              ("Resumable", "midepoch"), ("collate_readable", "reported"),
                              ("readable", "unreadable"), ("Seeded", "samples")],
            "train_one_epoch": [("def train_one_epoch", "state"), ("first_step", "midepoch"),
                                ("PREEMPTION", "preempt"), ("unreadable", "reported"),
                                ("max_steps", "midepoch"), ("ckpt_steps", "midepoch"), ("state", "state")],
            "evaluate": [("PREEMPTION", "preempt"), ("report_unreadable", "reported"), ("", "validation")],
            "broadcast_buffers": "validation",
            "val_record": "reported",
            "epoch_record": "reported",
            "TrainState": "state",
            "SHARED_STATE": "state",
            "PER_PROCESS_STATE": "state",
            "rng_state": "state",
            "set_rng_state": "restore",
            "save_checkpoint": "checkpoint",
            "tensors_in": "checkpoint",
            "note_divergence": "divergence",
            "divergence_note": "divergence",
            "stop_if_repeating": "divergence",
            "set_base_rate": "divergence",
            "atomic": "failures",
            "save_file": "checkpoint",
            "list_checkpoints": "checkpoint",
            "load_checkpoint": "resume",
            "agreed_checkpoint": "agreement",
            "find_checkpoint": "resume",
            "restore": "restore",
            "process_failure": "restore",
            "flight_recorder": "flightrec",
            "setup_distributed": "flightrec",
            "first_line": "restore",
            "start_or_resume": "restore",
            "stop_run": "midepoch",
            "EpochKeys": "samples",
            "SeededSamples": "samples",
            "ReadableSamples": "unreadable",
            "readable_sets": "unreadable",
            "describe_unreadable": "unreadable",
            "collate_readable": "reported",
            "report_unreadable": "reported",
            "warn": "reported",
            "check_model_fits": "checks",
            "read_state_dict": "initfrom",
            "init_weights_from": "initfrom",
            "free_space": "failures",
            "what_is_intact": "failures",
            "log_resume": "resume",
            "log_epoch": [("record[\"epoch\"] == 0", "initfrom"), ("", "reported")],
            "compress_gradients": "compression",
            "sync_batchnorm": "syncbn",
            "train": [("compress_gradients", "compression"), ("sync_b", "syncbn"), ("bucket", "buckets"), ("init_from", "initfrom"),
                      ("check_model_fits", "checks"), ("PREEMPTION", "preempt"),
                      ("stop_run", "midepoch"), ("set_start", "midepoch"), ("max_steps", "midepoch"),
                      ("del checkpoint", "restore"), ("start_or_resume(", "restore"),
                      ("agreed_checkpoint", "resume"), ("log_resume", "resume"),
                      ("A resumed run rewrites", "resume"), ("out_dir = Path", "resume"),
                      ("save_checkpoint", "checkpoint"), ("state", "state"), ("return 0", "state"),
                      ("Every process evaluates its shard", "validation")],
            "main": [("check_task", "checks"), ("note_divergence", "divergence"), ("what_is_intact", "failures"),
                     ("message", "failures"), ("return", "midepoch")],
        },
        "removed": {},
        "flags_added": {"--resume", "--ckpt-steps", "--ckpt-epochs", "--keep-last", "--max-steps",
                        "--sync-bn", "--bucket-cap-mb", "--gradient-as-bucket-view", "--init-from",
                        "--tf32", "--cudnn-benchmark", "--deterministic", "--grad-compression"},
        "mechanisms": {"ShardSampler", "TrainState", "rng_state", "save_checkpoint", "load_checkpoint",
                       "find_checkpoint", "agreed_checkpoint", "restore", "set_rng_state", "start_or_resume",
                       "ResumableSampler", "stop_run", "Preemption", "EpochKeys", "SeededSamples",
                       "ReadableSamples", "readable_sets", "report_unreadable", "check_task",
                       "check_model_fits", "flight_recorder",
                       "init_weights_from"},
        "diff_size": (1082, 56),
    },
    "fsdp.py": {
        "concepts": [
            TOP,
            ("shard", "Sharding the model: fully_shard",
             "fully_shard (FSDP2) shards a module in place, no wrapper (no .module): each "
             "parameter becomes a DTensor, of which each process holds a slice along dim 0 "
             "(to_local()); init_device_mesh names the processes. Before a unit computes, an "
             "all-gather gives every process its full parameters, freed after its forward and after "
             "its backward, where a reduce-scatter leaves each its slice of the averaged gradients. "
             "Block by block: the model as one unit would be held whole, as in DDP, with no gather "
             "to overlap. The root, sharded last, takes the rest (the stem, the classifier)."),
            ("units", "Units: named in the section \"your data and model\"",
             "shard_units(model), in the section you edit, returns the units: modules, or lists of "
             "modules gathered as one; a transformer of your own returns list(model.blocks)."),
            ("hostcopy", "One copy of the model in host memory",
             "Every process builds the model on the meta device: shapes, no memory, no values. "
             "Rank 0 alone holds its values, in host memory: a copy per process would not fit a "
             "node. to_empty gives each slice memory; set_model_state_dict(..., "
             "broadcast_from_rank0=True), on every process (the others pass {}), fills it from rank "
             "0's tensors, one at a time; buffers, not sharded, go whole."),
            ("precision", "Mixed precision: FSDP's policy",
             "MixedPrecisionPolicy instead of autocast: the slices stay float32, a unit's "
             "parameters are gathered in bf16 (or fp16), so, unlike autocast, every operation of "
             "the unit runs in bf16, softmax and norms included. fp16 keeps the GradScaler."),
            ("accum", "Accumulation: a reduce-scatter per micro-batch",
             "no_sync goes: K reduce-scatters a step instead of one, to keep the gradients sharded: "
             "FSDP2's no_sync (set_requires_gradient_sync(False)) held 44.7 MB of gradients against "
             "22.4 (resnet18, 2 processes)."),
            ("recompute", "Activation checkpointing: recompute instead of keep",
             "--activation-checkpointing: a block keeps only its inputs for backward and runs its "
             "forward again in its backward to remake the activations inside it "
             "(torch.utils.checkpoint), from the first run's random state, so dropout drops the same. "
             "The second forward would update BatchNorm's running statistics again: they get their "
             "values from before it back. Less memory for one more forward per block; the same "
             "weights, bit for bit on CPU."),
            ("hsdp", "Hybrid sharding across nodes (HSDP)",
             "--replicas R makes the mesh 2-D: R groups of world size / R processes (one per node, "
             "when R is the number of nodes), each unit sharded within a group and replicated across "
             "groups. All-gathers stay within a group; gradients are reduce-scattered within it, "
             "then each slice all-reduced with the same slice of the other groups: a step's one "
             "collective across nodes, once a step with accumulation (set_requires_all_reduce at the "
             "group's last micro-batch; FSDP adds up the slices until then). A process holds R / "
             "world size of the model. Checkpoints hold whole tensors' slices either way: a run "
             "resumes in another layout or on another number of processes."),
            ("clip", "Clipping by the global norm",
             "clip_grad_norm_ over the sharded (DTensor) gradients computes the norm of all slices "
             "together, the same on every process, a DTensor (full_tensor() gives its value): a "
             "norm of each process's slices would scale the slices of one gradient unequally."),
            ("validation", "The same number of forwards on every process",
             "In ddp_full.py each process evaluates its shard alone, with no collective. Every "
             "forward now all-gathers from all processes: every process runs as many."),
            ("checkpoint", "Sharded checkpoints: torch.distributed.checkpoint",
             "Every process writes its own slices (dcp.save, a file each) into the checkpoint's "
             "directory, rank 0 the metadata and train_state.pt."),
            ("reshard", "Loading a sharded checkpoint, on any number of processes",
             "get_state_dict, dcp.load and set_state_dict reshard the model and the optimizer's "
             "state as they load, on any number of processes; the rest as in ddp_full.py."),
            ("modelpt", "model.pt: the whole model on rank 0",
             "get_model_state_dict, on every process (it gathers), gives rank 0 a state dict that "
             "loads without FSDP; a model too big for rank 0's host memory keeps the checkpoint."),
            FLAGS,
        ],
        "ahead": {"precision_policies": "precision", "has_batchnorm": "precision", "values": "hostcopy",
                  "recompute_in_backward": "recompute", "own_initialisation": "hostcopy", "init_weights": "hostcopy",
                  "units_of": "units"},
        "regions": {
            "docstring": "top",
            "imports": [("collections", "units"), ("torch.utils.checkpoint", "recompute"),
                        ("checkpoint", "checkpoint"), ("", "shard")],
            "RESUME_MAY_CHANGE": "hsdp",
            "CHECKPOINT_NAME": "checkpoint",
            "parse_args": [("gather the parameters", "precision"), ("keep no activations", "recompute"),
                           ("hybrid sharding", "hsdp"), ("", "shard")],
            "AT_LEAST": "hsdp",
            "setup_distributed": "shard",
            "device_mesh": "shard",
            "POSITIVE": "shard",
            "precision_policies": "precision",
            "has_batchnorm": "precision",
            "autocast": "precision",
            "shard_model": "shard",
            "shard_units": "units",
            "find_blocks": "units",
            "shares_parameters": "units",
            "check_units": "units",
            "units_of": "units",
            "TASK_HOOKS": "units",
            "build_on_meta": "hostcopy",
            "init_weights": "hostcopy",
            "own_initialisation": "hostcopy",
            "initial_values": "hostcopy",
            "init_weights_from": "hostcopy",
            "recompute_in_backward": "recompute",
            "buffers_kept": "recompute",
            "check_torch": "top",
            "main": "shard",
            "shard_sizes": "shard",
            "release_device_meshes": "shard",
            "cleanup_distributed": "shard",
            "train_one_epoch": [("removed:sync_context", "accum"), ("autocast(args, device, model)", "precision"),
                                ("set_requires_all_reduce", "hsdp"), ("full_tensor", "clip"), ("global norm", "clip"),
                                ("", "accum")],
            "evaluate": [("spare", "validation"), ("", "validation")],
            "report_unreadable": "validation",
            "spare_batch": "validation",
            "save_checkpoint": "checkpoint",
            "shard_write_error": "checkpoint",
            "tensors_in": "checkpoint",
            "list_checkpoints": "checkpoint",
            "check_shards": "checkpoint",
            "load_checkpoint": "checkpoint",
            "restore": "reshard",
            "start_or_resume": "reshard",
            "compile_model": "units",
            "train": [("compile_model", "units"), ("get_model_state_dict", "modelpt"),
                      ("rank0_only(rank, save_file, full", "modelpt"),
                      ("evaluate", "validation"),
                      ("units = shard_model", "shard"),
                      ("build_on_meta", "hostcopy"), ("initial_values", "hostcopy"), ("del values", "hostcopy"),
                      ("", "shard")],
        },
        "removed": {"compress_gradients": "shard"},
        "flags_added": {"--activation-checkpointing", "--replicas"},
        "flags_removed": {"--bucket-cap-mb": "FSDP gathers and reduce-scatters per unit: no DDP buckets",
                          "--find-unused-parameters": "FSDP2 needs every parameter used in every step",
                          "--gradient-as-bucket-view": "no DDP buckets to view",
                          "--grad-compression": "no DDP hooks: FSDP's MixedPrecisionPolicy(reduce_dtype=...) "
                                                "sets the precision sharded gradients travel in"},
        "mechanisms": {"shard_model", "precision_policies", "spare_batch", "shard_write_error",
                       "recompute_in_backward", "buffers_kept", "device_mesh",
                       "shard_units", "units_of", "initial_values",
                       "own_initialisation"},
        "diff_size": (559, 161),
    },
}

# The change in brief that opens each guided page: the lines a reader would write to port the step
# into a script of their own, by concept (a key of the step's concepts), in teaching order. Each
# anchor is a text found on one line of the new script (or (function, text): within that top-level
# function or class), and picks the statement starting there: a simple one whole, a compound one by
# its header line, or whole where the text starts with "*" (tools/make_diffs.py, brief). Comment
# lines are left out: the sections below say why.
BRIEF = {
    "ddp_basic.py": [
        ("group", ["import datetime", "import os", "import torch.distributed as dist", "from torch.nn.parallel import",
                   ("setup_distributed", 'rank = int(os.environ.get("RANK", 0))'),
                   'local_rank = int(os.environ.get("LOCAL_RANK", 0))',
                   ("setup_distributed", '*if backend == "auto":'), ("setup_distributed", "if torch.cuda.is_available():"), 'device = torch.device("cuda", local_rank)',
                   "torch.cuda.set_device(device)", "timeout = datetime.timedelta(", "device_id = device if",
                   ("setup_distributed", '*if "RANK" in os.environ:'),
                   "dist.init_process_group(backend, timeout=timeout",
                   "return rank, local_rank, dist.get_world_size()", "dist.destroy_process_group()"]),
        ("shard", ["train_sampler = DistributedSampler(", "return (DataLoader(train_set",
                   "train_loader.sampler.set_epoch(epoch)"]),
        ("ddp", [("train", "set_seed(args.seed)  # again"), "model = build_model(args, num_outputs).to(device)", "model = DDP(model",
                 "optimizer = build_optimizer(args, model)", "set_seed(args.seed + rank)",
                 ("train_one_epoch", "totals = torch.zeros("), "dist.all_reduce(totals)"]),
        ("rank0", ["rank0_only(rank, prepare_out_dir, args)", ("train", "for epoch in range(args.epochs):"),
                   ("train", "if rank == 0:"),
                   "val_totals = evaluate(args, model.module", "model.module.state_dict(), out_dir"]),
        ("compile", ["if args.compile:", "model.compile()"]),
    ],
    "ddp_amp_accum.py": [
        ("amp", ["layout = torch.channels_last", "model = build_model(args, num_outputs).to(",
                 "scaler = torch.amp.GradScaler(", "return torch.autocast(",
                 "fmt = torch.channels_last if", "scaler.step(optimizer)", "scaler.update()"]),
        ("accum", ["scheduler = build_scheduler(",
                   "group_start = batch_index", "group_end = min(", "last_in_group = batch_index", "held = min(",
                   "sync_context = contextlib", "*with sync_context:", "*if not last_in_group:",
                   ("train_one_epoch", "scheduler.step()"), "optimizer.zero_grad(set_to_none=True)"]),
        ("clip", ["if args.clip_grad_norm > 0:", "scaler.unscale_(optimizer)", "grad_norm = torch.nn.utils"]),
    ],
    "ddp_full.py": [
        ("validation", ["val_sampler = ShardSampler(", "self.indices = range(rank", ("evaluate", "broadcast_buffers(model)"),
                        ("evaluate", "dist.all_reduce(totals)")]),
        ("checkpoint", ["dist.gather_object(per_process", "*checkpoint = {", "rank0_only(rank, save_file, checkpoint",
                        'with open(path, "wb") as f:']),
        ("resume", ["candidates = list_checkpoints(", "checkpoint = torch.load(path, map_location"]),
        ("restore", [("restore", "try:"), 'model.load_state_dict(checkpoint["model"])', 'optimizer.load_state_dict(checkpoint',
                     'scheduler.load_state_dict(checkpoint', "set_rng_state(state.rng)"]),
        ("midepoch", ["train_loader.sampler.set_start(", "rest = order[self.start:]"]),
        ("preempt", ["signal.signal(signal.SIGTERM, self.request)", "op=dist.ReduceOp.MAX",
                     "*if PREEMPTION.agreed:  # after the step"]),
    ],
    "fsdp.py": [
        ("shard", ["mesh = device_mesh(args, device, world_size)", ("shard_model", "units = units_of(model)  #"), ("shard_model", "for unit in units:"),
                   "fsdp.fully_shard(unit if", "fsdp.fully_shard(model, mesh",
                   "units = shard_model(", "optimizer = build_optimizer(args, model)",
                   "return init_device_mesh(device.type, (world_size,))"]),
        ("hostcopy", ["model = build_on_meta(", ("build_on_meta", '*with torch.device("meta")'),
                      "values = rank0_only(rank, initial_values", "model.to_empty(device=device)",
                      "set_model_state_dict(model, state, options"]),
        ("precision", [" policy = fsdp.MixedPrecisionPolicy(", "root_policy = fsdp.MixedPrecisionPolicy(",
                       "keep = fsdp.MixedPrecisionPolicy("]),
        ("hsdp", ["return init_device_mesh(device.type, (args.replicas", "model.set_requires_all_reduce("]),
        ("clip", ["grad_norm = torch.nn.utils"]),
        ("validation", ["evaluate_batch(model, spare)", "model.reshard()"]),
        ("checkpoint", [("save_checkpoint", "model_state, optimizer_state = get_state_dict"), "dcp.save({"]),
        ("reshard", [("restore", "model_state, optimizer_state = get_state_dict"), "sharded = {",
                     "dcp.load(sharded", "set_state_dict(model, optimizer"]),
        ("modelpt", ["full = get_model_state_dict(", "rank0_only(rank, save_file, full"]),
    ],
}

# When a resume of ddp_full.py ends bitwise equal to a run never stopped: the 4 -> 5 page says so under
# its brief. RESUME_MAY_CHANGE (ddp_full.py) lists the settings a resume may change; these are those
# of them that change the arithmetic's rounding (the order of a sum, the kernels chosen), so that a
# resume which changes one is exact to rounding only; the others change how the run goes on, not its
# numbers. tests/test_guided_pages.py checks that the two lists make up RESUME_MAY_CHANGE.
CHANGES_ROUNDING = ("compile", "channels_last", "tf32", "cudnn_benchmark", "backend", "bucket_cap_mb",
                    "gradient_as_bucket_view", "grad_compression")

# The hardening pages (docs/hardening/): for each optional part, the situation that needs it, which
# opens its section ("You need it ..."), before what deleting it gives up (the script's map).
NEEDED_WHEN = {
    "help formatter": "when others run your trainer and read `--help` for the defaults",
    "value checks": "when others run your trainer: a mistyped flag stops in one line before any work, not "
                    "midway or never",
    "cifar10": "to train on CIFAR-10 (`--data cifar10 --download`) rather than your own data",
    "constant lr": "to keep `--lr` throughout, with no warm-up or decay (a fine-tune's usual schedule)",
    "atomic writes": "on any run whose files you keep: a job killed while writing must not leave half a "
                     "checkpoint or `model.pt` in place of the last good one",
    "unused params": "when some steps leave parameters out of the loss (a branch some batches skip, a head "
                     "trained every other step): DDP then stops at the second step",
    "legacy launcher": "when your launch scripts still use `python -m torch.distributed.launch`",
    "error exchange": "on several nodes, or whenever an error may meet one process alone: the others would "
                      "wait in a barrier until `--timeout-min` and print nothing",
    "profile": "when several GPUs train barely faster than one: it shows where a step's time goes",
    "global batch": "to resume on another number of GPUs (a lost node, another queue) as the same training, "
                    "or to compare runs on different numbers of GPUs: without it fewer GPUs average fewer "
                    "samples a step at the same `--lr`, another training",
    "init-from": "to fine-tune: start from a `model.pt`, a state dict or torchvision's pretrained weights",
    "sync-bn": "with BatchNorm and few samples per GPU (detection, segmentation, large images): without it "
               "each GPU normalises by the statistics of its own few samples",
    "buckets": "to tune DDP's overlap of all-reduce with backward on a slow network or a large model",
    "grad compression": "on a slow network between nodes (Ethernet): half the bytes of each all-reduce",
    "model check": "when you change `--model` or the image size: a model that cannot take the data stops in "
                   "one line at start, not with a traceback midway",
    "section check": "when you edit the section \"your data and model\": a name it lacks is one line at "
                     "start, not a `NameError` in every process",
    "full disk": "on shared or quota-limited disks: a failed write ends in one line and exit 74, the last "
                 "good checkpoint kept",
    "unreadable files": "on image folders that may hold a broken or half-copied file",
    "seeded samples": "for random augmentation in data-loader workers: the same augmentation on any number "
                      "of processes or workers, and a resume that repeats it",
    "mid-epoch": "when an epoch is long, and for preemption: without it a stopped run goes back to its last "
                 "epoch's end and trains that part of the epoch again",
    "preemption": "on a preemptible or time-limited queue (SLURM's `--signal`, spot instances): without it "
                  "SIGTERM kills the run, losing what it trained since its last checkpoint, and no exit "
                  "status 75 asks for a requeue",
    "deterministic": "for runs and resumes that repeat bit for bit on GPUs (debugging, comparing changes): "
                     "without it cuDNN's autotuning and atomic adds round differently from run to run",
    "flight recorder": "to debug a hang on GPUs: the last collectives of each process, written on a timeout",
    "process failures": "when one process can fail alone (its own disk, its own copy of a file) under "
                        "`torchrun --max-restarts`",
    "primed buckets": "to resume bitwise on 3 or more GPUs: without it the resume's first step sums the "
                      "gradients in other buckets, and the run drifts from the one never stopped by rounding",
    "divergence note": "under `torchrun --max-restarts`: a run that diverged is not restarted into the same "
                       "divergence",
    "recompute": "when activations, not parameters, fill the GPU: one more forward for less memory",
    "hybrid": "with FSDP on several nodes: shards within a node, replicas across, gathers kept off the "
              "slower network",
    "torch check": "where torch may be older than 2.6 (before the public `fully_shard`)",
    "shard check": "where a checkpoint's shard may be missing or cut short (a node's disk, a copy in "
                   "progress)",
    "unit check": "when your section names its own FSDP units (`shard_units`)",
}

# docs/hardening/README.md opens on this table: a situation, the script to start from and the parts
# to keep (`tools/strip_optional.py SCRIPT --keep NAME ...`); the rest of the parts go.
KEEP_FOR = [
    ("run on a preemptible or time-limited queue (SLURM, spot instances)", "ddp_full.py",
     ["preemption", "mid-epoch", "atomic writes", "full disk"]),
    ("restart failed jobs with `torchrun --max-restarts`", "ddp_full.py",
     ["atomic writes", "divergence note", "process failures", "error exchange"]),
    ("resume bitwise on 3 or more GPUs (on GPUs, deterministic kernels too)", "ddp_full.py",
     ["primed buckets", "deterministic"]),
    ("resume on another number of GPUs as the same training", "ddp_full.py", ["global batch"]),
    ("augment at random in data-loader workers", "ddp_full.py", ["seeded samples"]),
    ("fine-tune from a `model.pt` or pretrained weights", "ddp_full.py", ["init-from", "constant lr"]),
    ("train on image folders that may hold broken files", "ddp_full.py", ["unreadable files"]),
    ("use BatchNorm with few samples per GPU", "ddp_full.py", ["sync-bn"]),
    ("train over a slow network between nodes", "ddp_full.py", ["grad compression", "buckets", "profile"]),
    ("see where a step's time goes", "ddp_basic.py", ["profile"]),
    ("need runs that repeat bit for bit on GPUs", "ddp_full.py", ["deterministic"]),
    ("debug hangs on GPUs", "ddp_full.py", ["flight recorder"]),
    ("train a model whose steps leave parameters out", "ddp_amp_accum.py", ["unused params"]),
    ("hand the trainer to others", "ddp_full.py",
     ["help formatter", "value checks", "model check", "section check", "error exchange"]),
    ("run a model too large for one GPU's memory, activations included", "fsdp.py", ["recompute"]),
    ("shard a model over several nodes", "fsdp.py", ["hybrid", "error exchange"]),
    ("name your own FSDP units", "fsdp.py", ["unit check"]),
]
