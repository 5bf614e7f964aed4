# SPDX-License-Identifier: Apache-2.0
"""Layer 1: the NVFP4 activation-scale arithmetic the patches apply: the scale rule and its
constants, the EP group's agreement on one scale, a loaded layer's scales checked and repaired,
the scales the checkpoint never provided, split gate/up weight scales."""
