# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's TRT-LLM NVFP4 MoE path (``--moe-backend flashinfer_trtllm``) as vLLM's oracle
design calls it, on CPU: the kernels (the 0.7 emulator), the weight-shuffle index helpers and
the device probe, as a stand-in ``flashinfer`` module tree (FlashInfer 0.7.3 is not
installable here). Part of the seam :mod:`.blackwell_oracle` installs (``backend="latency"``;
its docstring lists every symbol replaced and why)."""

from __future__ import annotations

import functools
import importlib.util

import torch

from fp4_moe_lab import nvfp4
from fp4_moe_lab.simulation.oracle_flashinfer import ActivationType, flashinfer_module_tree

TRT_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.trtllm_nvfp4_moe"


def simulates_trtllm() -> bool:
    """Does this vLLM have the TRT-LLM NVFP4 experts module the ``backend="latency"`` seam
    patches (``fused_moe/experts/trtllm_nvfp4_moe.py``, read on v0.34.0)? v0.20.0 has it (only
    its CUTLASS ``FlashInferExperts`` stays under ``fused_moe/``, see
    :func:`.blackwell_oracle.experts_module`), calling the kernels with FlashInfer 0.6.8.post1's
    keywords (its pin; v0.20.0 FM/experts/trtllm_nvfp4_moe.py:209-241, 340-370), a subset of the
    0.7 contract the emulator implements, and importing the same weight-preparation helpers
    (v0.20.0 Q/utils/flashinfer_fp4_moe.py:170-174). Not on v0.14.0, which has no TRT-LLM
    experts class: its quant methods
    call module functions (model_executor/layers/quantization/utils/flashinfer_fp4_moe.py:
    253-424, from compressed_tensors/compressed_tensors_moe.py:495-535 and modelopt.py:
    1603-1647) that run FlashInfer 0.5.3's ``trtllm_fp4_block_scale_moe`` (the pin in its
    wheel's metadata), a contract the emulator does not implement (it has 0.3.1's and 0.7's),
    behind FusedMoE's naive DP dispatch (no P/F for that backend, compressed_tensors_moe.py:
    442-444; fused_moe/layer.py:1921-1970)."""
    try:
        return importlib.util.find_spec(TRT_EXPERTS) is not None
    except ImportError:
        return False


def w3_w1_permute_indices(cache, dst_w3_w1_weight: torch.Tensor, epilogue_tile_m: int,
                           num_elts_per_sf=None, is_gated_act_gemm: bool = True) -> torch.Tensor:
    """Stand-in for FlashInfer's ``_maybe_get_cached_w3_w1_permute_indices`` (fi 0.6.18
    flashinfer/fused_moe/core.py:417-453): row ``i`` of the kernel's GEMM1 matrix is row
    ``src[i]`` of ``[w3; w1]`` -- the gated-activation interleave chained with the 32-row
    ``shuffle_matrix_a`` block permutation, the same for weights and linear block scales
    (``get_shuffle_matrix_sf_a_row_indices`` permutes whole rows too). FlashInfer computes it
    with device kernels; :mod:`nvfp4.trtllm_layout` computes the same indices on CPU (checked
    byte for byte against FlashInfer 0.3.1's shuffles in tests/nvfp4, and against FlashInfer
    0.7.2.post1's and 0.7.4's own helpers in tests/nvfp4_oracle/test_trtllm_layout.py)."""
    from fp4_moe_lab.nvfp4 import trtllm_layout as tl

    rows = dst_w3_w1_weight.shape[0]
    key = ("w3_w1", tuple(dst_w3_w1_weight.shape), epilogue_tile_m, num_elts_per_sf,
           is_gated_act_gemm)
    if key not in cache:
        cache[key] = (tl.gemm1_row_sources(rows, epilogue_tile_m) if is_gated_act_gemm
                      else tl.shuffle_row_sources(rows, epilogue_tile_m))
    return cache[key]


def w2_permute_indices(cache, dst_w2_weight: torch.Tensor, epilogue_tile_m: int,
                        num_elts_per_sf=None) -> torch.Tensor:
    """Stand-in for ``get_w2_permute_indices_with_cache`` (fi 0.6.18 flashinfer/fused_moe/
    core.py:456-483): the ``shuffle_matrix_a`` row permutation alone."""
    from fp4_moe_lab.nvfp4 import trtllm_layout as tl

    key = ("w2", tuple(dst_w2_weight.shape), epilogue_tile_m, num_elts_per_sf)
    if key not in cache:
        cache[key] = tl.shuffle_row_sources(dst_w2_weight.shape[0], epilogue_tile_m)
    return cache[key]


def flashinfer_trtllm_stub():
    """The FlashInfer names vLLM 0.34.0's TRT-LLM NVFP4 path imports at call time, as a module
    tree installed for the seam's duration (FlashInfer 0.7.3 is not installable here):
    ``flashinfer.nvfp4_block_scale_interleave`` and the two permute-index helpers
    (Q/utils/flashinfer_fp4_moe.py:338-342, weight preparation), ``flashinfer.fused_moe.
    trtllm_fp4_block_scale_moe`` / ``trtllm_fp4_block_scale_routed_moe`` (FM/experts/
    trtllm_nvfp4_moe.py:388, 601: the kernels, -> the 0.7 emulator) and ``flashinfer.fused_moe.
    core.ActivationType`` (Q/utils/flashinfer_utils.py:39-40)."""
    from fp4_moe_lab.nvfp4 import trtllm_emulator as te

    mods = flashinfer_module_tree()
    fi, fm, core = (mods["flashinfer"], mods["flashinfer.fused_moe"],
                    mods["flashinfer.fused_moe.core"])
    fi.nvfp4_block_scale_interleave = nvfp4.block_scale_interleave
    fm.trtllm_fp4_block_scale_moe = te.trtllm_fp4_block_scale_moe_0_7
    fm.trtllm_fp4_block_scale_routed_moe = te.trtllm_fp4_block_scale_routed_moe_0_7
    core.ActivationType = ActivationType
    core._maybe_get_cached_w3_w1_permute_indices = w3_w1_permute_indices
    core.get_w2_permute_indices_with_cache = w2_permute_indices
    return mods


def trtllm_supports_current_device() -> bool:
    """v0.34.0 FM/experts/trtllm_nvfp4_moe.py:226-234 without ``is_cuda()`` and the FlashInfer
    probe (its kernels are the emulator's): the 10.x family only, so on a simulated 12.x GPU
    vLLM refuses ``--moe-backend flashinfer_trtllm`` as it would there."""
    from vllm.platforms import current_platform as p

    return p.is_device_capability_family(100)


@functools.cache  # vLLM's source does not change under a run: read it once
def accepted_hidden(hidden: int) -> int:
    """``hidden``, or the next multiple of 512 where this vLLM's TRT-LLM experts accept only those
    (v0.17.0 FM/experts/trtllm_nvfp4_moe.py:91-94, ``_supports_shape``, asked by
    ``is_supported_config`` FM/modular_kernel.py:561-564): the TRT-LLM rows then measure the
    kernel on a layer it takes, not vLLM refusing the simulation's width. vLLM's own predicate,
    read from the module's source: importing it needs FlashInfer, which only the ranks stub."""
    import ast

    spec = importlib.util.find_spec(TRT_EXPERTS)
    tree = ast.parse(open(spec.origin, encoding="utf-8").read()) if spec and spec.origin else None
    found = [f for c in (tree.body if tree else ()) if isinstance(c, ast.ClassDef)
             and c.name == "TrtLlmNvFp4ExpertsBase" for f in c.body
             if isinstance(f, ast.FunctionDef) and f.name == "_supports_shape"]
    if not found:
        return hidden
    found[0].decorator_list = []  # the staticmethod, as a plain function
    space: dict = {}
    exec(compile(ast.Module(body=found, type_ignores=[]), spec.origin, "exec"), space)
    try:
        return next(h for h in range(hidden, 16 * 1024 + 1) if space["_supports_shape"](h))
    except Exception:  # a predicate that needs its module's names: ask nothing of it
        return hidden


def pack_topk_ids_weights(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          block_size: int = 1024) -> torch.Tensor:
    """What v0.28.0's ``_pack_topk_ids_weights_kernel`` computes (FM/utils.py:391-417), in torch:
    ``expert_id << 16 | bits(bf16(weight))``, one int32 per (token, k), as TRT-LLM's routed
    kernel reads it."""
    ids = topk_ids.to(torch.int32) << 16
    weights = topk_weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return ids | weights

