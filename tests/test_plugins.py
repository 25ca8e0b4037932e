"""A plugin package installed with pip adds a pass and a target; a broken one is skipped."""
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CHECK = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, %(tests)r)
    import torch, ssmc
    import programs as P
    from conftest import ssmc_run
    pl = ssmc.plugins()
    ok = {(p.group, p.name): p for p in pl}
    assert ok[("ssmc.passes", "count_loops")].error is None
    assert ok[("ssmc.passes", "count_loops")].package == "ssmc-demo-plugin"
    assert ok[("ssmc.targets", "lti_only")].version == "0.0.1"
    assert "ModuleNotFoundError" in ok[("ssmc.passes", "broken_pass")].error      # reported, skipped
    torch_targets = [p for p in pl if (p.group, p.name) == ("ssmc.targets", "torch")]
    assert [p.package for p in torch_targets if p.error is None] == ["ssmc"]      # ssmc's own stays
    assert any("taken by the plugin from ssmc" in (p.error or "") for p in torch_targets)

    # the pass runs in its declared place
    _, rep = ssmc_run(P.s4d(), P.s4d_inputs())
    names = [p.name for p in rep.passes]
    assert names.index("count_loops") == names.index("detect_recurrence") + 1, names
    assert any("count_loops saw 1 live loop" in m for g in rep.graphs for m in g.log)
    # ... and can be disabled by name
    _, rep = ssmc_run(P.s4d(), P.s4d_inputs(), disable_passes=["count_loops"])
    assert not any("count_loops" in m for g in rep.graphs for m in g.log)
    assert {p.name: p.skipped for p in rep.passes}["count_loops"] == "disabled"

    # the target is chosen when asked for and supports the region ...
    out, rep = ssmc_run(P.s4d(), P.s4d_inputs(), target="lti_only")
    r = rep.regions[0]
    assert r.target == "lti_only" and r.plugin.startswith("ssmc-demo-plugin"), r
    assert "lti_only" in r.kernel_source
    ref = P.s4d()(*P.s4d_inputs())
    assert torch.allclose(out, ref, atol=1e-5)
    # ... and declines with its reason when it does not
    _, rep = ssmc_run(P.mamba1("stack"), P.mamba1_inputs(), target="lti_only")
    r = rep.regions[0]
    assert r.target == "torch"
    assert r.target_reasons["lti_only"] == "decay is per-element, lti_only needs lti"
    assert "lti_only declined: decay is per-element" in str(rep)
    print("PLUGIN CHECKS OK")
""")


@pytest.fixture(scope="module")
def installed_plugin():
    pkg = os.path.join(HERE, "plugin_demo")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    r = subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", "-e", pkg],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"could not install the demo plugin: {r.stderr}")
    yield
    subprocess.run(pip + ["uninstall", "-y", "ssmc-demo-plugin"], capture_output=True, timeout=600)


def test_plugin_pass_and_target(installed_plugin):
    r = subprocess.run([sys.executable, "-c", CHECK % {"tests": HERE}], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "PLUGIN CHECKS OK" in r.stdout, r.stdout + r.stderr
