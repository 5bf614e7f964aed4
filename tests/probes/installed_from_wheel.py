# SPDX-License-Identifier: Apache-2.0
"""Where an engine world imports the plugin and the lab from: prints the plugin's file, the lab's
file, and the plugin's direct_url.json (empty unless pip recorded one; "editable" if it is an
editable install). Run with the world's interpreter, outside the checkout, by
lab/fp4_moe_lab/engines/plugin_wheel.py."""

import importlib.metadata as md

import fp4_moe_lab as lab
import vllm_fp4_moe_plugin as plugin

print(plugin.__file__)
print(lab.__file__)
print(md.distribution("vllm-fp4-moe-plugin").read_text("direct_url.json") or "")
