# SPDX-License-Identifier: Apache-2.0
"""The NVFP4_ORACLE design's probe (vLLM 0.14.0+): is the code the wrapper is written against
there, and has upstream fixed either hole itself? vLLM-free at import."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.patching import original_attr
from vllm_fp4_moe_plugin.patches.probing import Observation, has, on_cpu, same

FINDINGS = ("oracle_helpers", "oracle_helpers_take_layer_and_a13_scale",
            "global_sf_backend_probe", "moe_parallel_config_all2all", "eplb_scale_allreduce",
            "upstream_agrees_gemm1_scale", "upstream_repairs_uncalibrated",
            "upstream_refuses_uncalibrated",
            "cutlass_fp4_takes_expert_map", "upstream_zeroes_non_local_routes",
            "upstream_carries_gate_up", "marlin_helper_takes_layer_and_scales")


def eplb_scale_allreduce() -> bool:
    """0.28.0+ (#48355): ``amax_for_moe_activation_quant`` all-reduces the collapsed scale over
    the EP group under EPLB (v0.34.0 Q/utils/quant_utils.py:77-97); 0.14.0-0.27.x lack it."""
    return has(vm.FLASHINFER_FP4_MOE, "amax_for_moe_activation_quant")


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


@functools.cache  # asked by the probe and by the entries' builder; vLLM does not change
def probe_upstream_fixes() -> dict[str, bool]:
    """The oracle design's three holes, each fixed in vLLM or not (upstream/0001-0003). A probe
    that cannot run says not fixed: the plugin's duty is a no-op where vLLM computes right."""
    out = {}
    for fn in (upstream_agrees_gemm1_scale, upstream_repairs_uncalibrated,
               upstream_zeroes_non_local_routes, upstream_carries_gate_up):
        try:
            out[fn.__name__] = bool(fn())
        except Exception:
            out[fn.__name__] = False
    return out


# GEMM1's weight global scale of one half taken for both: the gate's column (every release
# 0.11.0-0.34.0, both formats; v0.34.0 Q/modelopt.py:1090-1098, CT w4a4_nvfp4.py:232-240).
GATE_COLUMN_ONLY = re.compile(r"w13_weight_(?:global_)?scale(?:_2)?\[\s*:\s*,\s*0\s*\]")


def upstream_carries_gate_up() -> bool:
    """From the code: do both NVFP4 MoE quant methods stop reading GEMM1's weight global scale
    from the gate's column alone? False while either's ``process_weights_after_loading`` takes
    ``[:, 0]`` for both halves (stock 0.14.0-0.34.0); the wrapper also checks each layer's
    ``w13_scale_2`` against the gate's column before carrying anything."""
    sources = []
    for module, names in ((vm.MODELOPT, (vm.MODELOPT_NVFP4_CLASS_NAME,)),
                          (vm.COMPRESSED_TENSORS_MOE, vm.CT_NVFP4_CLASS_NAMES)):
        mod = importlib.import_module(module)
        for name in names:
            method = getattr(getattr(mod, name, None), "process_weights_after_loading", None)
            if method is not None:
                sources.append(inspect.getsource(method))
    if not sources:
        raise RuntimeError("neither NVFP4 MoE quant method found")
    return not any(GATE_COLUMN_ONLY.search(src) for src in sources)


def upstream_agrees_gemm1_scale() -> bool:
    """Do all EP ranks collapse compressed-tensors' GEMM1 scale to the same value at DP+EP
    without EPLB? Either way upstream/0001 has been written: every expert's input scales loaded
    on every rank (:func:`ct_loads_every_experts_input_scales`, its current form), or the
    oracle's FlashInfer helper asking ``amax_for_moe_activation_quant`` to reduce over the EP
    group (:func:`helper_reduces_gemm1_scale`, its first). False on stock 0.14.0-0.34.0."""
    return ct_loads_every_experts_input_scales() or helper_reduces_gemm1_scale()


def ct_loads_every_experts_input_scales() -> bool:
    """Read from the source (vLLM may still be importing these modules): does
    compressed-tensors' NVFP4 MoE size its input global scales by ``global_num_experts`` (as
    ModelOpt's since #26135), and does RoutedExperts' loader route ``input_global_scale`` by the
    global expert id? Stock 0.14.0-0.34.0: neither (CT w4a4_nvfp4.py:189-208,
    FM/routed_experts.py:764-771)."""
    return (_function_names(vm.QUANTIZATION, vm.CT_NVFP4_MOE_FILE, "create_weights",
                            "global_num_experts", vm.CT_NVFP4_CLASS_NAMES)
            and _function_names(vm.FUSED_MOE, vm.ROUTED_EXPERTS_FILE, "weight_loader",
                                "input_global_scale"))


def helper_reduces_gemm1_scale() -> bool:
    """Behavioural: at DP+EP without EPLB, does the oracle's FlashInfer helper ask
    ``amax_for_moe_activation_quant`` to reduce GEMM1's collapsed scale (3.0 here; GEMM2's is
    5.0) over the EP group? False before 0.28.0 (no such helper) and on stock 0.28.0-0.34.0."""
    import torch

    oracle, asked = importlib.import_module(vm.NVFP4_ORACLE), {}

    def amax(a_scale, reduce_over_ep, *args, **kwargs):
        asked[float(a_scale.max())] = bool(reduce_over_ep)
        return a_scale.max().to(torch.float32)

    helper = on_cpu(original_attr(vm.FLASHINFER_FP4_MOE, vm.ORACLE_HELPERS[0]),
                     amax_for_moe_activation_quant=amax, swizzle_blockscale=same)
    try:
        helper(backend=oracle.NvFp4MoeBackend.FLASHINFER_CUTLASS,
               **_probe_layer(torch.full((2, 2), 3.0), torch.full((2,), 5.0)))
    except Exception:
        pass  # read what was asked before the failure
    return asked.get(3.0, False)


def upstream_repairs_uncalibrated() -> bool:
    """Behavioural for the values: does ``convert_to_nvfp4_moe_kernel_format`` hand FlashInfer
    CUTLASS's helper (a recorder) finite scales for an expert whose are NaN? Read for missing
    ones: do both formats' ``create_weights`` initialise the input scales with NaN? (upstream/0002
    with 0005 and ``VLLM_NVFP4_MOE_REPAIR_INPUT_SCALES=1``; stock 0.14.0-0.34.0: no.)"""
    return (uncalibrated_conversion() == "repairs"
            and _function_names(vm.QUANTIZATION, "modelopt.py", "create_weights", "nan",
                                ("ModelOptNvFp4FusedMoE",))
            and _function_names(vm.QUANTIZATION, vm.CT_NVFP4_MOE_FILE, "create_weights", "nan",
                                vm.CT_NVFP4_CLASS_NAMES))


def upstream_refuses_uncalibrated() -> bool:
    """Does ``convert_to_nvfp4_moe_kernel_format`` refuse an expert whose activation scales are
    NaN before any helper runs? (upstream/0002, the default; stock 0.14.0-0.34.0: no.) The
    plugin's repair must then run in front of that refusal."""
    return uncalibrated_conversion() == "refuses"


@functools.cache  # asked by two findings; vLLM and its environment do not change
def uncalibrated_conversion() -> str:
    """What the oracle's conversion does with a two-expert layer whose second expert's
    activation scales are NaN: ``"repairs"`` (finite scales reach the helper, a recorder),
    ``"refuses"`` (a ValueError before the helper), or ``"passes"`` (NaN reaches it: stock)."""
    import torch

    oracle, seen, nan = importlib.import_module(vm.NVFP4_ORACLE), {}, float("nan")
    convert = on_cpu(original_attr(vm.NVFP4_ORACLE, "convert_to_nvfp4_moe_kernel_format"),
                      **{vm.ORACLE_HELPERS[0]: lambda **kw: seen.update(kw) or 1 / 0})
    quiet = logging.getLogger(vm.NVFP4_ORACLE)  # the probe layer's repair is no news
    was, quiet.disabled, refused = quiet.disabled, True, False
    try:
        convert(nvfp4_backend=oracle.NvFp4MoeBackend.FLASHINFER_CUTLASS, **_probe_layer(
            torch.tensor([[1.0, 1.0], [nan, nan]]), torch.tensor([1.0, nan])))
    except ValueError:
        refused = not seen  # vLLM's refusal, before the helper
    except Exception:
        pass  # the recorder's ZeroDivisionError: read what reached it
    finally:
        quiet.disabled = was
    if refused:
        return "refuses"
    finite = all(isinstance(seen.get(k), torch.Tensor) and bool(torch.isfinite(seen[k]).all())
                 for k in ("a13_scale", "a2_scale"))
    return "repairs" if finite else "passes"


def _reset_for_tests() -> None:
    """Forget the cached probes (a test that changes vLLM's environment)."""
    probe_upstream_fixes.cache_clear()
    uncalibrated_conversion.cache_clear()


def _function_names(package: str, path: str, function: str, word: str, cls_names=None) -> bool:
    """Does ``function`` (a method of one of ``cls_names``, or of any class) in
    ``package``'s file ``path`` name ``word`` (an attribute, a name or a string)? Read from the
    source: vLLM may still be importing that module."""
    import ast
    import os

    root = importlib.import_module(package).__path__[0]
    with open(os.path.join(root, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    owners = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
              and (cls_names is None or c.name in cls_names)]
    return any(isinstance(fn, ast.FunctionDef) and fn.name == function
               and any(word in (getattr(n, "attr", None), getattr(n, "id", None),
                                getattr(n, "value", None)) for n in ast.walk(fn))
               for c in owners for fn in c.body)


def cutlass_fp4_takes_expert_map() -> bool:
    """0.32.0+: vLLM's own CUTLASS NVFP4 MoE runs under EP, ``run_cutlass_moe_fp4`` taking the
    expert map (v0.34.0 FM/experts/cutlass_moe.py:511-535, :751-762); up to 0.31.0 its experts
    refuse EP (``ep_size == 1``, v0.31.0 :736)."""
    try:
        fn = original_attr(vm.CUTLASS_MOE, vm.CUTLASS_MOE_FP4)
    except Exception:  # absent, or a build whose CUDA-only module does not import: nothing to do
        return False
    return "expert_map" in inspect.signature(fn).parameters


class _RouteSortOps:
    """Stand-ins for the CUDA ops ``run_cutlass_moe_fp4`` calls, enough to see where a route
    goes: the route sort's contract (csrc moe_data.cu ``compute_arg_sorts``: local routes by
    expert, every other route at row ``expert_offsets[E]``), GEMMs that write 1.0 into the rows
    of the local routes only, quantizers that pass their input through."""

    def __init__(self) -> None:
        self.routed = 0

    def get_cutlass_moe_mm_data(self, topk_ids, expert_offsets, problem_sizes1, problem_sizes2,
                                a_map, c_map, e, n, k, blockscale_offsets, **_):
        flat, topk = topk_ids.flatten().tolist(), topk_ids.size(1)
        order = [i for x in range(e) for i, y in enumerate(flat) if y == x]
        self.routed = len(order)
        a_map.zero_()
        c_map.fill_(len(order))
        for row, i in enumerate(order):
            a_map[row], c_map[i] = i // topk, row
        for t in (problem_sizes1, problem_sizes2, blockscale_offsets):
            t.zero_()
        expert_offsets.fill_(len(order))

    def shuffle_rows(self, x, index):
        return x[index.long()]

    def scaled_fp4_experts_quant(self, x, *args, **kwargs):
        return x, None

    silu_and_mul_scaled_fp4_experts_quant = scaled_fp4_experts_quant

    def cutlass_fp4_moe_mm(self, out, *args, **kwargs):
        out[:self.routed] = 1.0


def upstream_zeroes_non_local_routes() -> bool:
    """Behavioural: does ``run_cutlass_moe_fp4`` give a token routed only to another rank's
    expert a zero output when its workspaces hold NaN (memory nobody initialised)? One local
    expert of two, top-1; the token routed locally must get 1.0 (the probe read the function
    right). False on stock 0.32.0-0.34.0: row ``expert_offsets[E]`` of GEMM2's output is read
    from the unzeroed workspace (v0.34.0 FM/experts/cutlass_moe.py:643-645, 688)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    def remap(topk_ids, expert_map, **_):
        return torch.where(topk_ids >= 0, expert_map[topk_ids.clamp(min=0).long()], -1).to(
            torch.int32)

    run = on_cpu(original_attr(vm.CUTLASS_MOE, vm.CUTLASS_MOE_FP4), ops=_RouteSortOps(),
                 _prepare_topk_ids_for_cutlass_fp4_moe=remap, remap_topk_to_local=remap)
    m, n, k, nan = 2, 16, 64, float("nan")
    u8, bf16, fp8 = torch.uint8, torch.bfloat16, torch.float8_e4m3fn
    out = torch.full((m, k), nan, dtype=bf16)
    run(output=out, a=torch.ones(m, k, dtype=bf16), a1_gscale=torch.ones(1),
        w1_fp4=torch.zeros(1, 2 * n, k // 2, dtype=u8),
        w1_blockscale=torch.ones(1, 2 * n, k // 16).to(fp8), w1_alphas=torch.ones(1),
        a2_gscale=torch.ones(1), w2_fp4=torch.zeros(1, k, n // 2, dtype=u8),
        w2_blockscale=torch.ones(1, k, n // 16).to(fp8), w2_alphas=torch.ones(1),
        topk_weights=torch.ones(m, 1), topk_ids=torch.tensor([[0], [1]], dtype=torch.int32),
        activation=MoEActivation.SILU, workspace13=torch.full((m, k), nan, dtype=bf16),
        workspace2=torch.full((m, n), nan, dtype=bf16), m=m, n=n, k=k, e=1,
        device=torch.device("cpu"), expert_map=torch.tensor([0, -1], dtype=torch.int32))
    if not bool((out[0] == 1).all()):
        raise RuntimeError("the probe's stand-ins did not reach the local route's output")
    return bool(torch.equal(out[1], torch.zeros(k, dtype=bf16)))


def observe(findings: dict) -> Observation:
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
    marlin = getattr(oracle, vm.ORACLE_MARLIN_HELPER, None)
    findings["marlin_helper_takes_layer_and_scales"] = callable(marlin) and all(
        p in inspect.signature(original_attr(vm.NVFP4_ORACLE, vm.ORACLE_MARLIN_HELPER)).parameters
        for p in vm.ORACLE_MARLIN_HELPER_PARAMS)
    findings["eplb_scale_allreduce"] = eplb_scale_allreduce()
    findings["cutlass_fp4_takes_expert_map"] = cutlass_fp4_takes_expert_map()
    findings.update(probe_upstream_fixes())  # a copy: the cache's dict stays as computed
    findings["upstream_refuses_uncalibrated"] = upstream_refuses_uncalibrated()
    if findings["upstream_refuses_uncalibrated"] and not callable(
            getattr(oracle, vm.ORACLE_INPUT_SCALE_CHECK, None)):
        return Observation(d, False, "vLLM refuses uncalibrated expert activation scales before "
                           f"its helpers, but not in {vm.ORACLE_INPUT_SCALE_CHECK}, where this "
                           "plugin repairs them; see docs/SUPPORT.md", findings)
    required = ("oracle_helpers_take_layer_and_a13_scale", "global_sf_backend_probe",
                "moe_parallel_config_all2all")
    missing = [k for k in required if not findings[k]]
    if vm.ORACLE_HELPERS[0] not in helpers or missing:
        return Observation(d, False, "vLLM has the NVFP4 backend oracle but not the code this "
                           "plugin patches there (" + ", ".join(missing or [vm.ORACLE_HELPERS[0]])
                           + " missing); see docs/SUPPORT.md for the workaround", findings)
    return Observation(d, True, "vLLM NVFP4 backend-oracle MoE design (0.14.0+)", findings)
