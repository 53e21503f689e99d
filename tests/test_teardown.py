"""A finished run leaves no gloo thread behind for the interpreter's exit.

gloo aborts a worker now and then at exit ("terminate called without an active exception", exit
-6: torchrun then reports the whole finished run as failed) when a process group is torn down
with the interpreter rather than by destroy_process_group(). Measured here (torch 2.14.1): the
first forward on the meta device (check_model_fits) imports torch._dynamo, which imports
torch.distributed.nn.functional, whose functions take the default process group as a default
argument; imported after init_process_group, they keep the group, and its threads, alive after
destroy_process_group. The scripts import it before. tests/threads_after_main.py runs a script's
main() under torchrun and lists the threads its process runs just before destroy_process_group()
(the control: the gloo threads are there) and once main() has returned (they must be gone).
"""
import json

import pytest

from conftest import ROOT, TINY, check, launch

pytestmark = pytest.mark.slow  # second tier, as a whole

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def assert_no_gloo_thread_outlives_main(script, tmp_path, extra=()):
    counts = tmp_path / "threads"
    counts.mkdir()
    check(launch("tests/threads_after_main.py", [*TINY, *extra, "--out-dir", str(tmp_path / "run")], nproc=2,
                 env={"THREADS_SCRIPT": str(ROOT / script), "THREADS_DIR": str(counts)}))
    for rank in (0, 1):
        record = json.loads((counts / f"rank{rank}.json").read_text())
        assert record["exit"] == 0
        # The control: while the group lives, its threads run under these names (Linux's
        # /proc/self/task; torch 2.11 names only the first); without them the check below would pass
        # whatever happened.
        assert set(GLOO_THREADS) & set(record["before_destroy"]), record["before_destroy"]
        left = [name for name in record["after_main"] if name in GLOO_THREADS]
        assert left == [], f"rank {rank}: {left} still running after main() returned"


@pytest.mark.parametrize("script", ["ddp_basic.py", "ddp_amp_accum.py", "ddp_full.py", "fsdp.py"])
def test_no_gloo_thread_outlives_main_after_a_finished_run(script, tmp_path):
    assert_no_gloo_thread_outlives_main(script, tmp_path)


@pytest.mark.slow
def test_no_gloo_thread_outlives_main_after_a_compiled_run(tmp_path):
    # torch.compile imports torch._dynamo, and with it the same module, on its own path.
    assert_no_gloo_thread_outlives_main("ddp_amp_accum.py", tmp_path, ["--compile", "--epochs", "1"])
