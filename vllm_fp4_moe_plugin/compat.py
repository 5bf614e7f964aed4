# SPDX-License-Identifier: Apache-2.0
"""Feature probes of the installed vLLM: which MoE design is it, and what does its code do?

compat only observes: :func:`probe` names the design, says whether the code its patches are
written against is all there (``patchable``) and returns the findings, from which the ledger
(``patches/``) decides. Probes read what the code *is*, never ``vllm.__version__`` (a source
build or a backport would lie); docs/ROOT-CAUSE.md §10 explains them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm_fp4_moe_plugin import vllm_modules as vm
from vllm_fp4_moe_plugin.patching import original_attr
from vllm_fp4_moe_plugin.support import Design

# What each design's probe reports (a test checks the real probe against this, in each release
# world; another checks that every ledger predicate reads only these).
_COMMON = ("nvfp4_oracle",)
_PRE_ORACLE = _COMMON + ("init_prepare_finalize", "modular_method", "tp_fix_present",
                         "modelopt_dp_fix_present")
FINDINGS: dict[Optional[Design], tuple[str, ...]] = {
    # the entries for every design: probe_plugin_env, probe_world_group_rendezvous
    None: ("plugin_env_listed", "world_group_rendezvous"),
    Design.INIT_PREPARE_FINALIZE: _PRE_ORACLE + ("targets_present",),
    Design.MODULAR_METHOD: _PRE_ORACLE + ("compressed_tensors_class",
                                          "compressed_tensors_dp_scale_shared",
                                          "all2allv_tp_prequantizes",
                                          "modelopt_nvfp4_moe_method",
                                          "modelopt_method_cls_attr"),
    Design.NVFP4_ORACLE: _COMMON + ("oracle_helpers", "oracle_helpers_take_layer_and_a13_scale",
                                    "global_sf_backend_probe", "moe_parallel_config_all2all",
                                    "eplb_scale_allreduce", "upstream_agrees_gemm1_scale",
                                    "upstream_repairs_uncalibrated"),
}

# The symbols the INIT_PREPARE_FINALIZE patches replace or subclass, and the methods its
# subclasses override; if any is gone the design has changed under us.
_TARGETS_INIT_PREPARE_FINALIZE = (
    (vm.MODELOPT, "ModelOptNvFp4FusedMoE"),
    (vm.COMPRESSED_TENSORS_MOE, "CompressedTensorsW4A4MoeMethod"),
    (vm.FLASHINFER_CUTLASS_MOE, "flashinfer_cutlass_moe_fp4"),
    (vm.FLASHINFER_CUTLASS_MOE, "FlashInferExperts"),
    (vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllGatherMoEPrepareAndFinalize"),
    (vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllToAllMoEPrepareAndFinalize"),
)
_OVERRIDDEN_INIT_PREPARE_FINALIZE = (
    "create_weights", "process_weights_after_loading", "get_fused_moe_quant_config",
    "maybe_make_prepare_finalize", "select_gemm_impl", "init_prepare_finalize")
_OVERRIDDEN_MODULAR_METHOD = ("process_weights_after_loading", "get_fused_moe_quant_config",
                              "maybe_make_prepare_finalize", "select_gemm_impl")


@dataclass(frozen=True)
class Observation:
    """What the probes saw. ``patchable``: the design is known and has every symbol its
    patches are written against; ``reason``: one line saying what was seen."""

    design: Optional[Design]
    patchable: bool
    reason: str
    findings: dict[str, object] = field(default_factory=dict)


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
    return (_has(vm.FLASHINFER_CUTLASS_MOE, "FlashInferExperts") and "use_dp" in
            inspect.signature(_attr(vm.FLASHINFER_CUTLASS_MOE,
                                    "FlashInferExperts").__init__).parameters)


def builds_modular_kernel() -> bool:
    """Both pre-oracle designs build a modular kernel only for an EP group of several ranks, in
    its device communicator's prepare_communication_buffer_for_model (v0110 parallel_state.py:252,
    base_device_communicator.py:274; v0120 :360, :276); one rank runs FlashInfer's direct call."""
    from vllm.distributed import get_ep_group

    return get_ep_group().world_size > 1


def probe_plugin_env() -> dict[str, object]:
    """Does vLLM's registry of environment variables (``vllm.envs.environment_variables``, what
    its Ray env copy and its unknown-variable check read) list every variable of the plugin?
    Reads the registry as it is, through our own patch if applied."""
    from vllm_fp4_moe_plugin import envs

    registry = original_attr(vm.VLLM_ENVS, "environment_variables")
    return {"plugin_env_listed": all(n in registry for n in envs.environment_variables)}


def probe_world_group_rendezvous() -> dict[str, object]:
    """Does ``init_distributed_environment`` build vLLM's world group by calling the
    module-global ``init_world_group`` (where the fleet check meets every rank)? Reads the
    function's code for the name, as the call site looks it up (v0110 parallel_state.py:1081,
    v0.34.0 :2019)."""
    init = getattr(importlib.import_module(vm.PARALLEL_STATE), "init_distributed_environment",
                   None)
    names = getattr(getattr(init, "__code__", None), "co_names", ())
    return {"world_group_rendezvous": "init_world_group" in names
            and _has(vm.PARALLEL_STATE, "init_world_group")}


def _nvfp4_oracle_present() -> bool:
    """0.14.0+ (PR #31692): ``fused_moe/oracle/nvfp4.py``. Checked without importing it."""
    parent = vm.NVFP4_ORACLE.rsplit(".", 1)[0]
    return (importlib.util.find_spec(parent) is not None
            and importlib.util.find_spec(vm.NVFP4_ORACLE) is not None)


def probe() -> Observation:
    """Never raises: any surprise becomes ``patchable=False`` with the reason."""
    try:
        return _probe()
    except Exception as exc:  # a vLLM we cannot even inspect is not one we patch
        return Observation(None, False, f"could not inspect vLLM's MoE internals ({exc!r})")


def _probe() -> Observation:
    findings: dict[str, object] = {}
    # From 0.28.0 fused_moe/layer.py no longer defines FusedMoE: look for the oracle first.
    findings["nvfp4_oracle"] = _nvfp4_oracle_present()
    if findings["nvfp4_oracle"]:
        return _probe_nvfp4_oracle(findings)
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase

    # P3: 0.11.0 builds modular kernels through FusedMoEMethodBase.init_prepare_finalize;
    # 0.11.1 moved that to FusedMoE.maybe_init_modular_kernel (v0111 layer.py:622).
    has_init_pf = hasattr(FusedMoEMethodBase, "init_prepare_finalize")
    has_maybe_init = hasattr(FusedMoE, "maybe_init_modular_kernel")
    findings["init_prepare_finalize"] = has_init_pf and not has_maybe_init
    findings["modular_method"] = (has_maybe_init and not has_init_pf
                                  and _has(vm.FUSED_MOE_MODULAR_METHOD, "FusedMoEModularMethod"))
    findings["tp_fix_present"] = experts_take_use_dp()
    # P2: 0.11.1's ModelOpt DP fix (v0111 flashinfer_utils.py:292).
    findings["modelopt_dp_fix_present"] = _has(vm.FLASHINFER_UTILS,
                                               "is_flashinfer_supporting_global_sf")
    if findings["init_prepare_finalize"]:
        return _probe_init_prepare_finalize(findings)
    if findings["modular_method"]:
        return _probe_modular_method(findings)
    return Observation(None, False, "vLLM's MoE internals are none of the designs this plugin "
                       "knows (" + ", ".join(d.label for d in Design) + "; see "
                       "docs/SUPPORT.md)", findings)


def _missing_overrides(module: str, cls_name: str, methods) -> list[str]:
    cls = _attr(module, cls_name)
    return [m for m in methods if not callable(getattr(cls, m, None))]


def _probe_init_prepare_finalize(findings: dict) -> Observation:
    d = Design.INIT_PREPARE_FINALIZE
    missing = [f"{m}.{a}" for m, a in _TARGETS_INIT_PREPARE_FINALIZE if not _has(m, a)]
    findings["targets_present"] = not missing
    if missing:
        return Observation(d, False, "vLLM lacks symbols this plugin replaces: "
                           + ", ".join(missing), findings)
    for mod, cls_name in _TARGETS_INIT_PREPARE_FINALIZE[:2]:
        gone = _missing_overrides(mod, cls_name, _OVERRIDDEN_INIT_PREPARE_FINALIZE)
        if gone:
            return Observation(d, False, f"{cls_name} lacks {', '.join(gone)}", findings)
    return Observation(d, True, "vLLM 0.11.0 MoE design: every FlashInfer prepare quantizes "
                       "with expert 0's GEMM1 scale", findings)


def compressed_tensors_nvfp4_class_name() -> Optional[str]:
    """The name under which this vLLM's compressed-tensors module defines the NVFP4 MoE method."""
    return next((n for n in vm.CT_NVFP4_CLASS_NAMES if _has(vm.COMPRESSED_TENSORS_MOE, n)), None)


def all2allv_tp_prequantizes() -> bool:
    """P6, behavioural: does the all-to-all prepare still quantize when there is no DP (v0111
    PF:104-113)? ``prepare`` on two CPU tokens: the fixed code returns the input tensor itself,
    the unfixed one tries to quantize (FlashInfer refuses CPU tensors) or returns another."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

    pf_cls = original_attr(vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE,
                           "FlashInferAllToAllMoEPrepareAndFinalize")
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


def compressed_tensors_dp_scale_shared(cls_name: str) -> bool:
    """P4, behavioural: does compressed-tensors give every expert one GEMM1 activation scale
    under DP dispatch (the hole: v0111 CT:358-368, v0120 CT:378-393)? Runs the method's own
    ``process_weights_after_loading`` (FlashInfer CUTLASS, DP=2, ``swizzle_blockscale`` the
    identity) on a two-expert CPU layer whose input global scales differ; anything that hides
    the vector counts as not shared (the patch is a no-op where the scales agree)."""
    import types

    import torch
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import FlashinferMoeBackend

    cls = original_attr(vm.COMPRESSED_TENSORS_MOE, cls_name)
    method = object.__new__(cls)
    parallel = types.SimpleNamespace(dp_size=2, tp_size=1, ep_size=2, use_ep=True,
                                     use_dp=True)
    method.__dict__.update(allow_flashinfer=True, use_marlin=False,
                           flashinfer_moe_backend=FlashinferMoeBackend.CUTLASS,
                           moe=types.SimpleNamespace(moe_parallel_config=parallel))
    e, n, k = 2, 128, 128
    layer: Any = torch.nn.Module()
    tensors = {"w13_weight_packed": torch.zeros(e, 2 * n, k // 2, dtype=torch.uint8),
               "w2_weight_packed": torch.zeros(e, k, n // 2, dtype=torch.uint8),
               "w13_weight_scale": torch.ones(e, 2 * n, k // 16).to(torch.float8_e4m3fn),
               "w2_weight_scale": torch.ones(e, k, n // 16).to(torch.float8_e4m3fn),
               "w13_weight_global_scale": torch.ones(e, 2), "w2_weight_global_scale": torch.ones(e),
               "w13_input_global_scale": torch.tensor([[1.0, 1.0], [4.0, 4.0]]),
               "w2_input_global_scale": torch.ones(e)}
    for name, t in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    layer.num_experts = layer.local_num_experts = layer.global_num_experts = e
    try:
        _on_cpu(cls.process_weights_after_loading, swizzle_blockscale=_same)(method, layer)
    except Exception:
        pass  # read what was set before the failure
    vec = getattr(layer, "w13_input_scale_quant", None)
    if not isinstance(vec, torch.Tensor) or vec.numel() < e:
        return False
    vec = vec.detach().float().reshape(-1)
    return bool((vec == vec[0]).all())


def _same(tensor):
    return tensor


def _probe_modular_method(findings: dict) -> Observation:
    d = Design.MODULAR_METHOD
    ct_name = compressed_tensors_nvfp4_class_name()
    findings["compressed_tensors_class"] = ct_name
    findings["compressed_tensors_dp_scale_shared"] = (
        ct_name is not None and compressed_tensors_dp_scale_shared(ct_name))
    findings["all2allv_tp_prequantizes"] = (
        _has(vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllToAllMoEPrepareAndFinalize")
        and all2allv_tp_prequantizes())
    # the ModelOpt method whose dead expert scales the plugin repairs before upstream's code
    findings["modelopt_nvfp4_moe_method"] = _has(vm.MODELOPT, "ModelOptNvFp4FusedMoE") and \
        not _missing_overrides(vm.MODELOPT, "ModelOptNvFp4FusedMoE",
                               ("process_weights_after_loading",))
    # ... which the config may create from a class attribute bound at import (v0120 :1636)
    findings["modelopt_method_cls_attr"] = (
        _has(vm.MODELOPT, "ModelOptNvFp4Config")
        and "FusedMoEMethodCls" in vars(original_attr(vm.MODELOPT, "ModelOptNvFp4Config"))
        and original_attr(vm.MODELOPT, "ModelOptNvFp4Config.FusedMoEMethodCls")
        is original_attr(vm.MODELOPT, "ModelOptNvFp4FusedMoE"))
    if not (findings["tp_fix_present"] and findings["modelopt_dp_fix_present"]):
        return Observation(d, False, "vLLM has the 0.11.1 MoE design without the upstream TP/DP "
                           "fixes (#27223/#26135) this plugin builds on", findings)
    if ct_name is not None:
        gone = _missing_overrides(vm.COMPRESSED_TENSORS_MOE, ct_name, _OVERRIDDEN_MODULAR_METHOD)
        if gone:
            return Observation(d, False, f"{ct_name} lacks {', '.join(gone)}", findings)
    return Observation(d, True, "vLLM modular_method MoE design (0.11.1+): upstream fixed "
                       "ModelOpt and TP", findings)


def eplb_scale_allreduce() -> bool:
    """0.28.0+ (#48355): ``amax_for_moe_activation_quant`` all-reduces the collapsed activation
    scale over the EP group when EPLB is on (v0.34.0 Q/utils/quant_utils.py:77-97, v0.28.0
    :65-84); 0.14.0-0.27.x have no such helper."""
    return _has(vm.FLASHINFER_FP4_MOE, "amax_for_moe_activation_quant")


def _on_cpu(fn, **replaced):
    """vLLM's function ``fn`` over a private copy of its globals with ``replaced`` in it: a probe
    runs vLLM's own code with stand-ins for what it calls (GPU moves, kernels, recorders)."""
    import types

    return types.FunctionType(fn.__code__, {**fn.__globals__, **replaced}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _probe_layer(a13_scale, a2_scale) -> dict:
    """The arguments of an oracle helper for a two-expert gated CPU layer at DP=2 x EP=2 (the
    all-to-all kernels in use), EPLB off."""
    import types

    import torch

    ns, (e, n, k) = types.SimpleNamespace, (2, 64, 128)
    parallel = ns(dp_size=2, ep_size=2, use_ep=True, enable_eplb=False, use_all2all_kernels=True,
                  all2all_backend="allgather_reducescatter")
    fp8 = torch.float8_e4m3fn
    return dict(layer=ns(layer_name="fp4_moe_probe", activation=ns(is_gated=True),
                         moe_config=ns(moe_parallel_config=parallel)), is_act_and_mul=True,
                w13=torch.zeros(e, 2 * n, k // 2, dtype=torch.uint8),
                w13_scale=torch.ones(e, 2 * n, k // 16).to(fp8), w13_scale_2=torch.ones(e),
                w2=torch.zeros(e, k, n // 2, dtype=torch.uint8),
                w2_scale=torch.ones(e, k, n // 16).to(fp8), w2_scale_2=torch.ones(e),
                a13_scale=a13_scale, a2_scale=a2_scale)


@functools.cache  # asked by the probe and by each oracle entry's builder; vLLM does not change
def probe_upstream_fixes() -> dict[str, bool]:
    """The oracle design's two holes, each fixed in vLLM or not (upstream/0001, 0002). A probe
    that cannot run says not fixed: the plugin's duty is a no-op where vLLM computes right."""
    out = {}
    for fn in (upstream_agrees_gemm1_scale, upstream_repairs_uncalibrated):
        try:
            out[fn.__name__] = bool(fn())
        except Exception:
            out[fn.__name__] = False
    return out


def upstream_agrees_gemm1_scale() -> bool:
    """Behavioural: at DP+EP without EPLB, does the oracle's FlashInfer helper ask
    ``amax_for_moe_activation_quant`` to reduce GEMM1's collapsed scale (3.0 here; GEMM2's is
    5.0) over the EP group? False before 0.28.0 (no such helper) and on stock 0.28.0-0.34.0."""
    import torch

    oracle, asked = importlib.import_module(vm.NVFP4_ORACLE), {}

    def amax(a_scale, reduce_over_ep, *args, **kwargs):
        asked[float(a_scale.max())] = bool(reduce_over_ep)
        return a_scale.max().to(torch.float32)

    helper = _on_cpu(original_attr(vm.FLASHINFER_FP4_MOE, vm.ORACLE_HELPERS[0]),
                     amax_for_moe_activation_quant=amax, swizzle_blockscale=_same)
    try:
        helper(backend=oracle.NvFp4MoeBackend.FLASHINFER_CUTLASS,
               **_probe_layer(torch.full((2, 2), 3.0), torch.full((2,), 5.0)))
    except Exception:
        pass  # read what was asked before the failure
    return asked.get(3.0, False)


def upstream_repairs_uncalibrated() -> bool:
    """Behavioural for the values: does ``convert_to_nvfp4_moe_kernel_format`` hand FlashInfer
    CUTLASS's helper (a recorder) finite scales for an expert whose are NaN? Read for missing
    ones: do both formats' ``create_weights`` initialise the input scales with NaN?"""
    import torch

    oracle, seen, nan = importlib.import_module(vm.NVFP4_ORACLE), {}, float("nan")
    convert = _on_cpu(original_attr(vm.NVFP4_ORACLE, "convert_to_nvfp4_moe_kernel_format"),
                      **{vm.ORACLE_HELPERS[0]: lambda **kw: seen.update(kw) or 1 / 0})
    quiet = logging.getLogger(vm.NVFP4_ORACLE)  # the probe layer's repair is no news
    was, quiet.disabled = quiet.disabled, True
    try:
        convert(nvfp4_backend=oracle.NvFp4MoeBackend.FLASHINFER_CUTLASS, **_probe_layer(
            torch.tensor([[1.0, 1.0], [nan, nan]]), torch.tensor([1.0, nan])))
    except Exception:
        pass  # the recorder's ZeroDivisionError, or vLLM refusing: read what reached it
    finally:
        quiet.disabled = was
    return (all(isinstance(seen.get(k), torch.Tensor) and bool(torch.isfinite(seen[k]).all())
                for k in ("a13_scale", "a2_scale"))
            and _initialises_nan("modelopt.py", ("ModelOptNvFp4FusedMoE",))
            and _initialises_nan(vm.CT_NVFP4_MOE_FILE, vm.CT_NVFP4_CLASS_NAMES))


def _initialises_nan(path: str, cls_names) -> bool:
    """Does ``create_weights`` of one of ``cls_names``, in the quantization package's file
    ``path``, name NaN? Read from the source: vLLM may still be importing that module."""
    import ast
    import os

    root = importlib.import_module(vm.QUANTIZATION).__path__[0]
    with open(os.path.join(root, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return any(isinstance(fn, ast.FunctionDef) and fn.name == "create_weights"
               and any("nan" in (getattr(n, "attr", None), getattr(n, "id", None),
                                 getattr(n, "value", None)) for n in ast.walk(fn))
               for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in cls_names
               for fn in c.body)


def _probe_nvfp4_oracle(findings: dict) -> Observation:
    """Patchable when the oracle still calls the scale-collapsing helpers by module-global name
    with the layer and ``a13_scale``, has ``is_global_sf_supported_for_nvfp4_backend``, and the
    MoE parallel config tells whether the all-to-all kernels are in use (v0.34.0
    FM/oracle/nvfp4.py:60-83, :312-420, FM/config.py:1066-1069; same in 0.14.0, 0.20.0, 0.28.0)."""
    d = Design.NVFP4_ORACLE
    try:
        oracle = importlib.import_module(vm.NVFP4_ORACLE)
    except ImportError as exc:
        return Observation(d, False, f"vLLM has the NVFP4 backend oracle ({vm.NVFP4_ORACLE}) but "
                           f"it does not import ({exc!r}); see docs/SUPPORT.md", findings)
    helpers = [n for n in vm.ORACLE_HELPERS if callable(getattr(oracle, n, None))]
    findings["oracle_helpers"] = tuple(helpers)
    findings["oracle_helpers_take_layer_and_a13_scale"] = bool(helpers) and all(
        all(p in inspect.signature(original_attr(vm.NVFP4_ORACLE, n)).parameters
            for p in vm.ORACLE_HELPER_PARAMS) for n in helpers)
    findings["global_sf_backend_probe"] = callable(
        getattr(oracle, "is_global_sf_supported_for_nvfp4_backend", None))
    parallel_config = getattr(importlib.import_module(vm.FUSED_MOE_CONFIG),
                              "FusedMoEParallelConfig", None)
    fields = getattr(parallel_config, "__dataclass_fields__", {})  # all2all_backend is a field
    findings["moe_parallel_config_all2all"] = (hasattr(parallel_config, "use_all2all_kernels")
                                               and "all2all_backend" in fields)
    findings["eplb_scale_allreduce"] = eplb_scale_allreduce()
    findings.update(probe_upstream_fixes())  # a copy: the cache's dict stays as computed
    required = ("oracle_helpers_take_layer_and_a13_scale", "global_sf_backend_probe",
                "moe_parallel_config_all2all")
    missing = [k for k in required if not findings[k]]
    if vm.ORACLE_HELPERS[0] not in helpers or missing:
        return Observation(d, False, "vLLM has the NVFP4 backend oracle but not the code this "
                           "plugin patches there (" + ", ".join(missing or [vm.ORACLE_HELPERS[0]])
                           + " missing); see docs/SUPPORT.md for the workaround", findings)
    return Observation(d, True, "vLLM NVFP4 backend-oracle MoE design (0.14.0+)", findings)
