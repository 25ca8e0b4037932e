"""The examples run: the DDP example with one process (gloo on CPU), loss falling."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ddp(tmp_path, *args):
    out = tmp_path / "ddp.json"
    r = subprocess.run([sys.executable, "examples/ddp_train.py", "--json", str(out), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def test_ddp_example_one_process(tmp_path):
    res = _ddp(tmp_path, "--steps", "12", "--length", "16", "--global-batch", "8")
    assert res["world_size"] == 1 and len(res["losses"]) == 12
    assert res["losses"][-1] < res["losses"][0]
    assert len(res["ssmc_regions"]) == 2          # one region per layer: the loops were compiled


def test_ddp_split_graphs_report_as_one_compile(tmp_path):
    """At d_model 512 DDP's graph splitter hands the backend the model in pieces (one per
    gradient bucket); the report of that compile holds every piece, so the regions stay visible."""
    res = _ddp(tmp_path, "--steps", "2", "--length", "8", "--global-batch", "2", "--d-model", "512")
    assert res["ssmc_graphs"] > 1
    assert len(res["ssmc_regions"]) == 2
