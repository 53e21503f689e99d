"""The benchmark runs and writes its table (a smoke test: behaviour only, never a timing assertion)."""
import subprocess
import sys

from conftest import ROOT


def test_benchmark_quick_run_writes_a_results_table(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--sections", "overhead",
                             "--scripts", "single_gpu.py", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "results.md").read_text()
    assert "| single_gpu.py |" in table
    ratio = float(table.split("| single_gpu.py |")[1].split("|")[1])
    assert ratio > 0  # a measured number, not a placeholder; its size is the benchmark's business
