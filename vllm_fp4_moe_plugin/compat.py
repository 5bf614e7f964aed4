"""Feature probes of the installed vLLM: which MoE design is it, and which holes does it still have?

Decisions are made from what the code *is*, not from ``vllm.__version__`` (a source build or a
backport would lie). docs/ROOT-CAUSE.md §10 lists the probes; ``docs/SUPPORT.md`` lists which
release has which design (read from each release's wheel).

Two designs are patched, each with its own part of the ledger (``patches.LEDGER``):

- ``0.11.0``: quant methods build their modular kernel in ``init_prepare_finalize``; every
  FlashInfer CUTLASS layout pre-quantizes with expert 0's scale. All three 0.11.0 patches.
- ``0.11.1``: ``FusedMoE.maybe_init_modular_kernel`` swaps the quant method for a
  ``FusedMoEModularMethod``, and there is no NVFP4 backend oracle yet (0.11.1 to 0.13.0).
  Upstream fixed TP (#27223) and ModelOpt DP (#26135); compressed-tensors DP is still
  inconsistent, and TP with ``flashinfer_all2allv`` still pre-quantizes. Only those two
  patches, and only while the probes see the holes.

- ``0.14.0``: the NVFP4 backend oracle (``fused_moe/oracle/nvfp4.py``, 0.14.0 to at least
  0.34.0; from 0.28.0 with an EPLB-only all-reduce of the collapsed scale). Compressed-tensors
  under DP+EP with sender-side quantization is inconsistent across ranks; one patch, the
  EP-agreed GEMM1 scale, wraps the oracle's scale-collapsing helpers.

Anything else (a mix such as 0.11.0 with part of the fix backported, or an oracle whose helpers
no longer take the layer and ``a13_scale``) is left alone, with the reason in the one log line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Optional

_MO = "vllm.model_executor.layers.quantization.modelopt"
_CT = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
_FX = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe"
_PF = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize"
_FU = "vllm.model_executor.layers.quantization.utils.flashinfer_utils"
_MM = "vllm.model_executor.layers.fused_moe.fused_moe_modular_method"
_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"
_FFM = "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"
_MOE_CONFIG = "vllm.model_executor.layers.fused_moe.config"
# The 0.14.0 design's scale-collapsing helpers, as the oracle imports them (the first is in
# every release of the design, the CuteDSL one from 0.20.0), and the parameters the wrapper reads.
ORACLE_HELPERS = ("prepare_nvfp4_moe_layer_for_fi_or_cutlass",
                  "prepare_nvfp4_moe_layer_for_flashinfer_cutedsl")
_ORACLE_HELPER_PARAMS = ("layer", "a13_scale")

DESIGN_0_11_0 = "0.11.0"
DESIGN_0_11_1 = "0.11.1"
DESIGN_0_14_0 = "0.14.0"

# The compressed-tensors NVFP4 MoE method: its 0.11.x name, then 0.12.0's rename (CT:195 there).
CT_NVFP4_CLASS_NAMES = ("CompressedTensorsW4A4MoeMethod", "CompressedTensorsW4A4Nvfp4MoEMethod")

_TARGETS_0_11_0 = (
    (_MO, "ModelOptNvFp4FusedMoE"),
    (_CT, "CompressedTensorsW4A4MoeMethod"),
    (_FX, "flashinfer_cutlass_moe_fp4"),
    (_FX, "FlashInferExperts"),
    (_PF, "FlashInferAllGatherMoEPrepareAndFinalize"),
    (_PF, "FlashInferAllToAllMoEPrepareAndFinalize"),
)
# Methods our 0.11.0 subclasses override; if any is gone the design has changed under us.
_OVERRIDDEN_0_11_0 = ("create_weights", "process_weights_after_loading",
                      "get_fused_moe_quant_config", "maybe_make_prepare_finalize",
                      "select_gemm_impl", "init_prepare_finalize")
# Methods the 0.11.1-era compressed-tensors subclass relies on.
_OVERRIDDEN_0_11_1 = ("process_weights_after_loading", "get_fused_moe_quant_config",
                      "maybe_make_prepare_finalize", "select_gemm_impl")


@dataclass(frozen=True)
class ProbeResult:
    """What the installed vLLM needs from us. register() acts on ``install`` and ``patches``."""

    install: bool
    reason: str
    findings: dict[str, object] = field(default_factory=dict)
    design: Optional[str] = None
    patches: tuple[str, ...] = ()  # ledger targets ("module.attr") to apply


def _attr(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _has(module: str, name: str) -> bool:
    try:
        _attr(module, name)
    except (ImportError, AttributeError):
        return False
    return True


def experts_take_use_dp() -> bool:
    """P1: 0.11.1's TP fix (#27223) added ``FlashInferExperts(use_dp=...)``, which sizes the
    output for what prepare hands over (v0111 flashinfer_cutlass_moe.py:59)."""
    return (_has(_FX, "FlashInferExperts") and "use_dp" in
            inspect.signature(_attr(_FX, "FlashInferExperts").__init__).parameters)


def builds_modular_kernel() -> bool:
    """Both designs build a prepare/finalize + experts kernel only when the EP group has more
    than one rank: only then does the group get a device communicator (v0110
    parallel_state.py:252, v0120 :360), whose prepare_communication_buffer_for_model builds it
    (v0110 base_device_communicator.py:274, v0120 :276). With one rank the quant method's apply
    runs FlashInfer's direct call."""
    from vllm.distributed import get_ep_group

    return get_ep_group().world_size > 1


def _nvfp4_oracle_present() -> bool:
    """0.14.0+ (PR #31692): ``fused_moe/oracle/nvfp4.py``. Checked without importing it."""
    parent = _ORACLE.rsplit(".", 1)[0]
    return (importlib.util.find_spec(parent) is not None
            and importlib.util.find_spec(_ORACLE) is not None)


def probe() -> ProbeResult:
    """Never raises: any surprise becomes ``install=False`` with the reason."""
    try:
        return _probe()
    except Exception as exc:  # a vLLM we cannot even inspect is not one we patch
        return ProbeResult(False, f"could not inspect vLLM's MoE internals ({exc!r})")


def _probe() -> ProbeResult:
    findings: dict[str, object] = {}
    # 0.14.0 added the NVFP4 backend oracle (fused_moe/oracle/nvfp4.py, PR #31692); from 0.28.0
    # fused_moe/layer.py no longer defines FusedMoE, so look for the oracle first.
    findings["nvfp4_oracle"] = _nvfp4_oracle_present()
    if findings["nvfp4_oracle"]:
        return _probe_0_14_0(findings)
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase

    # P3: 0.11.0 builds modular kernels through FusedMoEMethodBase.init_prepare_finalize;
    # 0.11.1 moved that to FusedMoE.maybe_init_modular_kernel (v0111 layer.py:622).
    has_init_pf = hasattr(FusedMoEMethodBase, "init_prepare_finalize")
    has_maybe_init = hasattr(FusedMoE, "maybe_init_modular_kernel")
    findings["design_0_11_0"] = has_init_pf and not has_maybe_init
    findings["design_0_11_1"] = (has_maybe_init and not has_init_pf
                                 and _has(_MM, "FusedMoEModularMethod"))
    findings["tp_fix_present"] = experts_take_use_dp()
    # P2: 0.11.1's ModelOpt DP fix (v0111 flashinfer_utils.py:292).
    findings["modelopt_dp_fix_present"] = _has(_FU, "is_flashinfer_supporting_global_sf")
    if findings["design_0_11_0"]:
        return _probe_0_11_0(findings)
    if findings["design_0_11_1"]:
        return _probe_0_11_1(findings)
    return ProbeResult(False, "vLLM's MoE internals are none of the designs this plugin knows "
                       "(0.11.0, 0.11.1, 0.14.0; see docs/SUPPORT.md); nothing to patch",
                       findings)


def eplb_scale_allreduce() -> bool:
    """0.28.0+ (#48355): ``amax_for_moe_activation_quant`` all-reduces the collapsed activation
    scale over the EP group when EPLB is on (v0.34.0 Q/utils/quant_utils.py:77-97, v0.28.0
    :65-84); 0.14.0-0.27.x have no such helper."""
    return _has(_FFM, "amax_for_moe_activation_quant")


def _probe_0_14_0(findings: dict) -> ProbeResult:
    """The oracle design: patchable when the oracle still calls the scale-collapsing helpers
    by module-global name with the layer and ``a13_scale``, decides global-scale backends with
    ``is_global_sf_supported_for_nvfp4_backend``, and the MoE parallel config says whether the
    all-to-all kernels are in use (v0.34.0 FM/oracle/nvfp4.py:60-83, :312-420,
    FM/config.py:1066-1069; the same names in 0.14.0, 0.20.0 and 0.28.0)."""
    from vllm_fp4_moe_plugin.patches.patching import original_attr

    try:
        oracle = importlib.import_module(_ORACLE)
    except ImportError as exc:
        return ProbeResult(False, f"vLLM has the NVFP4 backend oracle ({_ORACLE}) but it does not "
                           f"import ({exc!r}); nothing to patch, see docs/SUPPORT.md", findings,
                           DESIGN_0_14_0)
    helpers = [n for n in ORACLE_HELPERS if callable(getattr(oracle, n, None))]
    findings["oracle_helpers"] = tuple(helpers)
    findings["oracle_helpers_take_layer_and_a13_scale"] = bool(helpers) and all(
        all(p in inspect.signature(original_attr(_ORACLE, n)).parameters
            for p in _ORACLE_HELPER_PARAMS) for n in helpers)
    findings["global_sf_backend_probe"] = callable(
        getattr(oracle, "is_global_sf_supported_for_nvfp4_backend", None))
    parallel_config = getattr(importlib.import_module(_MOE_CONFIG), "FusedMoEParallelConfig",
                              None)
    fields = getattr(parallel_config, "__dataclass_fields__", {})  # all2all_backend is a field
    findings["moe_parallel_config_all2all"] = (hasattr(parallel_config, "use_all2all_kernels")
                                               and "all2all_backend" in fields)
    # 0.28.0+: the collapse all-reduces over the EP group, but only with EPLB (#48355).
    findings["eplb_scale_allreduce"] = eplb_scale_allreduce()
    required = ("oracle_helpers_take_layer_and_a13_scale", "global_sf_backend_probe",
                "moe_parallel_config_all2all")
    missing = [k for k in required if not findings[k]]
    if ORACLE_HELPERS[0] not in helpers or missing:
        return ProbeResult(False, "vLLM has the NVFP4 backend oracle but not the code this "
                           "plugin patches there (" + ", ".join(missing or [ORACLE_HELPERS[0]])
                           + " missing); nothing to patch, see docs/SUPPORT.md for the "
                           "workaround", findings, DESIGN_0_14_0)
    from vllm_fp4_moe_plugin.patches import targets_for_design

    wanted = {f"{_ORACLE}.{n}" for n in helpers}
    targets = tuple(t for t in targets_for_design(DESIGN_0_14_0) if t in wanted)
    return ProbeResult(True, "vLLM NVFP4 backend-oracle MoE design (0.14.0+): compressed-tensors "
                       "collapses GEMM1 input scales to each EP rank's local max, which DP+EP "
                       "dispatch mixes across ranks", findings, DESIGN_0_14_0, targets)


def _probe_0_11_0(findings: dict) -> ProbeResult:
    missing = [f"{m}.{a}" for m, a in _TARGETS_0_11_0 if not _has(m, a)]
    findings["targets_present"] = not missing
    if missing:
        return ProbeResult(False, "vLLM lacks symbols this plugin replaces: " + ", ".join(missing),
                           findings, DESIGN_0_11_0)
    for mod, cls_name in _TARGETS_0_11_0[:2]:
        gone = [m for m in _OVERRIDDEN_0_11_0 if not callable(getattr(_attr(mod, cls_name), m,
                                                                      None))]
        if gone:
            return ProbeResult(False, f"{cls_name} lacks {', '.join(gone)}", findings,
                               DESIGN_0_11_0)
    if findings["tp_fix_present"] or findings["modelopt_dp_fix_present"]:
        return ProbeResult(False, "vLLM already carries part of the upstream fix "
                           "(#27223/#26135); the 0.11.0 patches would fight it", findings,
                           DESIGN_0_11_0)
    from vllm_fp4_moe_plugin.patches import targets_for_design
    return ProbeResult(True, "vLLM 0.11.0 MoE design with the per-expert GEMM1 scale bug",
                       findings, DESIGN_0_11_0, targets_for_design(DESIGN_0_11_0))


def compressed_tensors_nvfp4_class_name() -> Optional[str]:
    """The name under which this vLLM's compressed-tensors module defines the NVFP4 MoE method."""
    return next((n for n in CT_NVFP4_CLASS_NAMES if _has(_CT, n)), None)


def all2allv_tp_prequantizes() -> bool:
    """P6, behavioural: does the all-to-all prepare still quantize when there is no DP?

    0.11.1 taught the all-gather prepare to pass bf16 through without DP (v0111 PF:184-185) but
    not the all-to-all one (v0111 PF:104-113), while ``FlashInferExperts(use_dp=False)`` sizes
    its output for bf16 input. Calls ``prepare`` on two CPU tokens: the fixed code returns the
    input tensor itself; the unfixed code tries to quantize (FlashInfer refuses CPU tensors, so
    no kernel ever runs here) or returns something else.
    """
    import torch
    from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

    from vllm_fp4_moe_plugin.patches.patching import original_attr

    pf_cls = original_attr(_PF, "FlashInferAllToAllMoEPrepareAndFinalize")
    one = torch.ones(1)
    cfg = nvfp4_moe_quant_config(g1_alphas=one, g2_alphas=one, a1_gscale=one, a2_gscale=one,
                                 w1_scale=one, w2_scale=one)
    a1 = torch.zeros(2, 32, dtype=torch.bfloat16)
    try:
        out = pf_cls(use_dp=False).prepare(a1, torch.ones(2, 1), torch.zeros(2, 1,
                                           dtype=torch.int32), 2, None, False, cfg)
    except Exception:
        return True
    return out[0] is not a1


def _probe_0_11_1(findings: dict) -> ProbeResult:
    from vllm_fp4_moe_plugin.patches import targets_for_design

    ct_name = compressed_tensors_nvfp4_class_name()
    findings["compressed_tensors_class"] = ct_name
    if not (findings["tp_fix_present"] and findings["modelopt_dp_fix_present"]):
        return ProbeResult(False, "vLLM has the 0.11.1 MoE design without the upstream TP/DP "
                           "fixes (#27223/#26135) this plugin builds on", findings,
                           DESIGN_0_11_1)
    wanted = []
    if ct_name is not None:
        gone = [m for m in _OVERRIDDEN_0_11_1
                if not callable(getattr(_attr(_CT, ct_name), m, None))]
        if gone:
            return ProbeResult(False, f"{ct_name} lacks {', '.join(gone)}", findings,
                               DESIGN_0_11_1)
        wanted.append(f"{_CT}.{ct_name}")
    findings["all2allv_tp_prequantizes"] = (_has(_PF, "FlashInferAllToAllMoEPrepareAndFinalize")
                                            and all2allv_tp_prequantizes())
    if findings["all2allv_tp_prequantizes"]:
        wanted.append(f"{_PF}.FlashInferAllToAllMoEPrepareAndFinalize")
    targets = tuple(t for t in targets_for_design(DESIGN_0_11_1) if t in wanted)
    if not targets:
        return ProbeResult(False, "vLLM 0.11.1-era MoE design with no hole left that this "
                           "plugin fixes", findings, DESIGN_0_11_1)
    return ProbeResult(True, "vLLM 0.11.1-era MoE design: upstream fixed ModelOpt and TP; "
                       "compressed-tensors DP dispatch (and TP with flashinfer_all2allv) still "
                       "quantize with expert 0's scale", findings, DESIGN_0_11_1, targets)
