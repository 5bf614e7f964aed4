# SPDX-License-Identifier: Apache-2.0
"""The operator's table of :func:`audit.audit_checkpoint`'s report (``audit`` without
``--json``)."""

from __future__ import annotations

from typing import Optional

from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.support import Design

from .audit import layouts_judged


def format_audit(report: dict, *, max_layers: Optional[int] = None) -> str:
    """A human-readable table of :func:`audit_checkpoint`'s report."""
    design = support.design(report.get("design", Design.INIT_PREPARE_FINALIZE))
    ep_layouts = "tp_ep" if design is Design.INIT_PREPARE_FINALIZE else "EP layouts"
    head = [f"NVFP4 MoE activation-scale audit (stock vLLM {support.design(design).releases} "
            f"semantics, MoE design {design.value})",
            f"  checkpoint : {report['path']}",
            f"  format     : {report['format']} (from {report['quant_config_source']})",
            f"  {ep_layouts:<11}: ep_size={report['ep_size']}, {report['expert_placement']} "
            "placement",
            ""]
    columns = layouts_judged(design)
    cols = "  ".join(f"{lay:>{max(5, len(lay))}}" for lay in columns)
    err_head = "dp_ep off by" if design is Design.NVFP4_ORACLE else "error vs expert 0"
    width = max([len(entry["layer"]) for entry in report["layers"]] + [5])
    lines = [f"{'layer':<{width}}  {'E':>4}  {'w13 spread':>10}  {'w2 spread':>9}  "
             f"{err_head:>17}  {cols}"]
    shown = report["layers"] if max_layers is None else report["layers"][:max_layers]
    for entry in shown:
        err = (f"{entry['dp_ep_off_by']:.3g}x" if design is Design.NVFP4_ORACLE else
               f"{entry['error_factor_min']:.3g}..{entry['error_factor_max']:.3g}x")
        flags = "  ".join(f"{('yes' if entry['affected'][lay] else 'no'):>{max(5, len(lay))}}"
                          for lay in columns)
        lines.append(f"{entry['layer']:<{width}}  {entry['num_experts']:>4}  "
                     f"{entry['w13_spread']:>9.4g}x  {entry['w2_spread']:>8.4g}x  {err:>17}  "
                     f"{flags}")
        stock = "uses them: wrong" if entry["stock_wrong_uncalibrated"] else "ignores them"
        for gemm in ("w13", "w2"):
            if entry[f"uncalibrated_{gemm}"]:
                gone = entry.get(f"missing_{gemm}")
                lines.append(f"  uncalibrated {gemm} input scale: expert(s) "
                             f"{entry[f'uncalibrated_{gemm}']}"
                             + (f", missing from the checkpoint: {gone}" if gone else "")
                             + f" (stock {stock}; the plugin loads the calibrated experts' max "
                             "amax)")
    if len(shown) < len(report["layers"]):
        lines.append(f"... {len(report['layers']) - len(shown)} more layer(s)")
    tail = ["", f"affected layers: {report['affected_layers']} of {len(report['layers'])}",
            report["calibration"], report["summary"]]
    tail += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(head + lines + tail)
