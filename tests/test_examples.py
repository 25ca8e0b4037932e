"""The examples run: the DDP example with one process (gloo on CPU), loss falling."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ddp_example_one_process(tmp_path):
    out = tmp_path / "ddp.json"
    r = subprocess.run([sys.executable, "examples/ddp_train.py", "--steps", "12", "--length", "16",
                        "--global-batch", "8", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 1 and len(res["losses"]) == 12
    assert res["losses"][-1] < res["losses"][0]
    assert len(res["ssmc_regions"]) == 2          # one region per layer: the loops were compiled
