# SPDX-License-Identifier: Apache-2.0
"""Load-time check: does each NVFP4 MoE layer's quant config match what its prepare step does?

The original failure was silent. Once per layer at load, this verifies ``g1_alphas[e] * g ==
ws2_e`` for every local expert ``e``, ``g`` being the scale the input is really quantized with
(``a1_gscale[0]`` when prepare pre-quantizes, ``a1_gscale[e]`` when the kernel quantizes bf16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vllm_fp4_moe_plugin.base import envs
from vllm_fp4_moe_plugin.base.log import get_logger, layer_label

logger = get_logger("check")
RTOL = 1e-5


class InconsistentMoELayerError(RuntimeError):
    """strict mode: a layer would compute GEMM1 with mismatched activation scales."""


@dataclass(frozen=True)
class LayerCheck:
    layer: str
    path: str  # "direct" or the prepare/finalize class name
    ok: bool
    reason: str


def _prepare_behaviour(prepare_finalize, experts) -> tuple[bool, bool]:
    """(does prepare quantize before the kernel?, is the experts' output shape right for it?), from
    the attributes the plugin's classes set (no patch module needed here)."""
    passthrough = getattr(prepare_finalize, "fp4_moe_bf16_passthrough", False)
    if experts is not None and hasattr(experts, "use_dp"):  # MODULAR_METHOD design
        passthrough = passthrough or (type(prepare_finalize).__name__
                                      == "FlashInferAllGatherMoEPrepareAndFinalize")
        pre = bool(prepare_finalize.use_dp) or not passthrough
        return pre, bool(experts.use_dp) == pre
    # INIT_PREPARE_FINALIZE: ours passes bf16 through without DP; every stock prepare quantizes
    pre = bool(prepare_finalize.use_dp) if passthrough else True
    return pre, pre or getattr(experts, "fp4_moe_output_for_bf16", False)


def check_layer(layer, quant_config, prepare_finalize=None,
                experts=None) -> Optional[LayerCheck]:
    """None when the layer is not on the FlashInfer NVFP4 path; else the verdict."""
    if quant_config is None or quant_config.quant_dtype != "nvfp4":
        return None
    name = layer_label(layer)
    if prepare_finalize is None:
        import vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe as fx

        from vllm_fp4_moe_plugin.patches.compat import experts_take_use_dp

        path = "direct"
        # 0.11.0 stock direct call: packed input; ours, and 0.11.1's (use_dp=False): bf16.
        pre_quantizes = not (getattr(fx.flashinfer_cutlass_moe_fp4, "fp4_moe_bf16_passthrough",
                                     False) or experts_take_use_dp())
        output_ok = True
    else:
        path = type(prepare_finalize).__name__
        pre_quantizes, output_ok = _prepare_behaviour(prepare_finalize, experts)
    a1 = quant_config.a1_gscale.detach().float().reshape(-1)
    alphas = quant_config.g1_alphas.detach().float().reshape(-1)
    ws2 = layer.w13_weight_scale_2.detach().float().reshape(-1)
    if pre_quantizes:
        used, how = a1[:1].expand_as(alphas), "pre-quantized with a1_gscale[0]"
    else:
        if a1.numel() != alphas.numel():
            return LayerCheck(name, path, False, f"the kernel quantizes per expert but a1_gscale "
                              f"has {a1.numel()} entries for {alphas.numel()} local experts")
        used, how = a1, "quantized per expert in the kernel"
    ratio = alphas * used / ws2
    worst = int((ratio - 1).abs().argmax())
    if abs(float(ratio[worst]) - 1) > RTOL:
        return LayerCheck(name, path, False, f"{how}, but g1_alphas[{worst}] * scale = "
                          f"{float(ratio[worst]):.4g} x w13_weight_scale_2[{worst}]: expert "
                          f"{worst}'s GEMM1 output is off by that factor")
    if not output_ok:
        return LayerCheck(name, path, False, "the experts size the output for the other kind "
                          "of input (FlashInferExperts.workspace_shapes): the layer cannot run")
    return LayerCheck(name, path, True, how)


class _Tally:
    """Counts layers for one summary line per process: vLLM builds every module (create_weights:
    :func:`expect_layer`) before loading weights, so the count is final by the first check."""

    def __init__(self) -> None:
        self.results: list[LayerCheck] = []
        self.expected = 0
        self.reported = False

    def add(self, result: LayerCheck) -> None:
        self.results.append(result)
        if len(self.results) >= self.expected and not self.reported:
            self.reported = True
            bad = [r for r in self.results if not r.ok]
            paths = sorted({r.path for r in self.results})
            if bad:
                logger.warning("vllm-fp4-moe-plugin check: %d of %d NVFP4 MoE layers are "
                               "inconsistent (first: %s: %s).", len(bad), len(self.results),
                               bad[0].layer, bad[0].reason)
            else:
                logger.info("vllm-fp4-moe-plugin check: %d NVFP4 MoE layers consistent (%s).",
                            len(self.results), ", ".join(paths))


_tally = _Tally()


def expect_layer() -> None:
    """A layer that will be checked was built (called from the quant method's create_weights)."""
    _tally.expected += 1


def run_check(layer, quant_config, prepare_finalize=None, experts=None,
              *, mode: Optional[str] = None) -> Optional[LayerCheck]:
    """Check one layer per ``VLLM_FP4_MOE_PLUGIN_CHECK``; raises in strict mode."""
    if mode is None:
        mode = envs.VLLM_FP4_MOE_PLUGIN_CHECK
    if mode == "off":
        return None
    result = check_layer(layer, quant_config, prepare_finalize, experts)
    if result is None:
        return None
    if not result.ok:
        if mode == "strict":
            raise InconsistentMoELayerError(
                f"{result.layer}: NVFP4 MoE quant config does not match its prepare step "
                f"({result.path}): {result.reason}. Set VLLM_FP4_MOE_PLUGIN_CHECK=warn to serve "
                "anyway (answers will be wrong).")
        logger.debug("check failed for %s: %s", result.layer, result.reason)
    _tally.add(result)
    return result


def last_result() -> Optional[LayerCheck]:
    return _tally.results[-1] if _tally.results else None


def reset_for_tests() -> None:
    global _tally
    _tally = _Tally()
