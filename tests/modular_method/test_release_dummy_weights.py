# SPDX-License-Identifier: Apache-2.0
"""``--load-format dummy`` on real layers of vLLM 0.12.0 (tests/dummy_weights_checks.py)."""

import pytest

from tests.dummy_weights_checks import world_tests

pytestmark = [pytest.mark.multiproc]

dummy_ranks, test_dummy_weights_serve_with_the_plugin_on = world_tests()
