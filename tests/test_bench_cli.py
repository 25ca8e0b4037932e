"""The benchmark CLI runs on CPU on a tiny configuration and its JSON has every column."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_tiny_cpu(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "--preset", "cpu", "--workloads", "mamba1,decode",
                        "--lengths", "16", "--targets", "torch", "--out", str(tmp_path), "--name", "tiny"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "tiny.json").read_text())
    cols = data["env"]["columns"]
    assert {"workload", "variant", "L", "ms", "speedup_vs_eager", "GB_per_s", "frac_of_byte_floor",
            "rel_err", "compile_cold_s", "peak_mem_bytes"} <= set(cols)
    rows = data["rows"]
    assert rows and all(set(cols) <= set(row) for row in rows)
    variants = {row["variant"] for row in rows}
    assert {"eager loop", "ssmc[torch]", "ssmc[-fuse_prologue]", "ssmc[-fuse_epilogue]"} <= variants
    ssmc_rows = [row for row in rows if row["kind"] == "ssmc" and row["workload"] == "mamba1"]
    assert all(row["ms"] and row["ms"] > 0 and row["rel_err"] < 1e-4 for row in ssmc_rows)
    assert "variant" in r.stdout and "wrote" in r.stdout            # the table was printed


def test_zoo_benchmark_tiny_cpu(tmp_path):
    """benchmarks.bench_zoo on the CPU: a row a program, checked against float64 and timed; a
    declined program has no region and its reason."""
    out = tmp_path / "zoo.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_zoo", "--out", str(out), "--shape", "2,8,4,4",
                        "--only", "qrnn,elman"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["program"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"qrnn", "elman"} and not any("error" in row for row in rows.values()), rows
    assert all(row["rel_err_vs_float64"] < 1e-5 and row["ssmc_ms"] > 0 and row["eager_ms"] > 0 for row in rows.values())
    assert rows["qrnn"]["regions"] == ["chunked_scan/torch"] and not rows["qrnn"]["fallbacks"]
    assert not rows["elman"]["regions"] and "tanh" in rows["elman"]["fallbacks"][0]
