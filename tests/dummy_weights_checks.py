# SPDX-License-Identifier: Apache-2.0
"""What every release world's suite asserts about ``--load-format dummy``, one copy: on real
layers filled by vLLM's own dummy loader (lab ``simulation/dummy_weights.py``), stock and the
plugin both build and run under DP=2+EP; the plugin checks and repairs nothing (its one INFO,
no WARNING). The same layer built for a real load format is refused by the plugin (its scales
are negative): that is what the dummy case must not do."""

import pytest

LAYOUTS = ("dp_ep_allgather",)  # each rank builds its experts' share: where dummy loads differ
FORMATS = ("modelopt", "compressed-tensors")


def world_tests():
    """(fixture, test) for one world's module, as ``uncalibrated_checks.world_tests``."""

    @pytest.fixture(scope="module")
    def dummy_ranks():
        from fp4_moe_lab.simulation import dummy_weights

        return dummy_weights.run(LAYOUTS, FORMATS)

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_dummy_weights_serve_with_the_plugin_on(dummy_ranks, fmt, layout):
        for r in dummy_ranks[layout]:
            where = (fmt, layout, r.rank)
            assert r.errors == {}, (where, r.errors)  # built and ran: stock and plugin
            assert f"{fmt}/stock" in r.outputs and f"{fmt}/plugin" in r.outputs, where
            log = r.info[f"{fmt}/log"]
            assert [m for level, m in log if level in ("WARNING", "ERROR")] == [], (where, log)
            assert [m for _, m in log if "--load-format dummy" in m], (where, log)

    return dummy_ranks, test_dummy_weights_serve_with_the_plugin_on
