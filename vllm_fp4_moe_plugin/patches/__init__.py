# SPDX-License-Identifier: Apache-2.0
"""Layers 2-3: the patch ledger. Its mechanics in named modules: ``patching`` (one ledger entry:
rebind and remember one attribute; a folder's slice), ``probing`` (what every feature probe
shares), ``compat`` (which vLLM MoE design is installed), ``registry`` (the folders), ``ledger``
(plan, apply all or nothing, revert). A folder per vLLM design holds a whole patch (records,
probe, replacements); ``plugin_env`` and ``fleet_rendezvous`` are for every design. Nothing is
imported here: the fleet check's entry is applied without loading any design's folder."""
