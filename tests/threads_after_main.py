"""Run a ladder script's main() under torchrun, then record which threads this process still runs.

    THREADS_SCRIPT=ddp_basic.py THREADS_DIR=DIR torchrun ... tests/threads_after_main.py ARGS

After main() returns the process group is destroyed; its gloo threads (pt_gloo_runloop,
gloo_tcp_loop) must be gone too. Threads still running then are torn down with the interpreter at
exit, where they can abort a finished run. As a control, the threads running just before the
script calls destroy_process_group() are recorded too: the names looked for must be there then.
Nothing is imported before the script's own imports but torch.distributed, which the script
imports first anyway. Each process writes {"exit": main's return value, "before_destroy": [names],
"after_main": [names]} to $THREADS_DIR/rank<R>.json.
"""
import json
import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist


def threads():
    return sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip()
                  for task in os.listdir("/proc/self/task"))


record = {}
destroy = dist.destroy_process_group


def recording_destroy(*args, **kwargs):
    if not args and not kwargs:  # the default group: the last one a script destroys
        record["before_destroy"] = threads()
    return destroy(*args, **kwargs)


dist.destroy_process_group = recording_destroy
script = os.environ["THREADS_SCRIPT"]
namespace = runpy.run_path(script, run_name="ladder_script")  # defines main(); runs nothing
record["exit"] = namespace["main"](sys.argv[1:])
record["after_main"] = threads()
out = Path(os.environ["THREADS_DIR"]) / f"rank{os.environ.get('RANK', 0)}.json"
out.write_text(json.dumps(record))
sys.exit(record["exit"])
