"""A third-party ssmc plugin: one pass, one target (used by tests/test_plugins.py)."""
from ssmc.targets.reference import ReferenceKernel

CALLS = {"kernels": 0}


class CountLoops:
    """Expects: candidates from reroll. Leaves: a note with how many loops are still live."""
    name = "count_loops"
    after = "detect_recurrence"
    required = False

    def run(self, ctx) -> bool:
        ctx.note(f"count_loops saw {len(ctx.live())} live loop(s)")
        return False


class LtiOnly:
    """Runs regions whose decay is constant in time; declines the rest with the reason."""
    name = "lti_only"
    version = "0.0.1"

    def supports(self, region, strategy, arch, device_type):
        return True if region.decay_kind == "lti" else f"decay is {region.decay_kind}, lti_only needs lti"

    def compile(self, region, strategy, options):
        CALLS["kernels"] += 1
        return ReferenceKernel(region)

    def source(self, kernel):
        return "# lti_only: the torch reference, run by a plugin"
