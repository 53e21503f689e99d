"""A finished run leaves no gloo thread behind for the interpreter's exit.

gloo aborts a worker now and then at exit ("terminate called without an active exception", exit
-6: torchrun then reports the whole finished run as failed) when a process group is torn down
with the interpreter rather than by destroy_process_group(). Measured here (torch 2.14.1): the
first forward on the meta device (check_model_fits) imports torch._dynamo, which imports
torch.distributed.nn.functional, whose functions take the default process group as a default
argument; imported after init_process_group, they keep the group, and its threads, alive after
destroy_process_group. The scripts import it before. tests/threads_after_main.py runs a script's
main() under torchrun and lists the threads its process still runs once main() has returned.
"""
import json

import pytest

from conftest import ROOT, TINY, check, launch

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


@pytest.mark.parametrize("script", ["ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py"])
def test_no_gloo_thread_outlives_main_after_a_finished_run(script, tmp_path):
    counts = tmp_path / "threads"
    counts.mkdir()
    check(launch("tests/threads_after_main.py", [*TINY, "--out-dir", str(tmp_path / "run")], nproc=2,
                 env={"THREADS_SCRIPT": str(ROOT / script), "THREADS_DIR": str(counts)}))
    for rank in (0, 1):
        record = json.loads((counts / f"rank{rank}.json").read_text())
        assert record["exit"] == 0
        left = [name for name in record["threads"] if name in GLOO_THREADS]
        assert left == [], f"rank {rank}: {left} still running after main() returned"
