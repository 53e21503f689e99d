"""Run a ladder script's main() under torchrun, then record which threads this process still runs.

    THREADS_SCRIPT=ddp_basic.py THREADS_DIR=DIR torchrun ... tests/threads_after_main.py ARGS

After main() returns the process group is destroyed; its gloo threads (pt_gloo_runloop,
gloo_tcp_loop) must be gone too. Threads still running then are torn down with the interpreter at
exit, where they can abort a finished run. Nothing is imported before the script's own imports.
Each process writes {"exit": main's return value, "threads": [names]} to $THREADS_DIR/rank<R>.json.
"""
import json
import os
import runpy
import sys
from pathlib import Path

script = os.environ["THREADS_SCRIPT"]
namespace = runpy.run_path(script, run_name="ladder_script")  # defines main(); runs nothing
status = namespace["main"](sys.argv[1:])
threads = sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip()
                 for task in os.listdir("/proc/self/task"))
out = Path(os.environ["THREADS_DIR"]) / f"rank{os.environ.get('RANK', 0)}.json"
out.write_text(json.dumps({"exit": status, "threads": threads}))
sys.exit(status)
