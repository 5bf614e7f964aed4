# SPDX-License-Identifier: Apache-2.0
"""Build, load and run one real vLLM 0.11.0 ``FusedMoE`` NVFP4 layer on CPU.

Everything is vLLM's own: the quant config classes, ``FusedMoE``, its weight loader fed with
checkpoint-named tensors through ``make_expert_params_mapping`` (exactly as a model's
``load_weights`` does), ``process_weights_after_loading``, ``prepare_communication_buffer_for_
model`` (which builds the modular kernel when DP x TP > 1) and ``forward_native``. Only the
hardware is simulated (:mod:`.blackwell`), and routing is vLLM's ``custom_routing_function``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fp4_moe_lab.checkpoint.configs import COMPRESSED_TENSORS_NVFP4
from fp4_moe_lab.checkpoint.expert_tensors import expert_tensors
from fp4_moe_lab.nvfp4 import QuantizedExperts
from fp4_moe_lab.simulation.blackwell import cpu_topk_softmax_routing

MLP_PREFIX = "model.layers.{index}.mlp"


def experts_prefix(index: int) -> str:
    """The checkpoint prefix of layer ``index``'s routed experts (what overrides are named by)."""
    return f"{MLP_PREFIX.format(index=index)}.experts"

def make_quant_config(fmt: str):
    """vLLM's own quant config object for a tiny NVFP4 checkpoint of ``fmt``."""
    if fmt == "modelopt":
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

        return ModelOptNvFp4Config(is_checkpoint_nvfp4_serialized=True,
                                   kv_cache_quant_algo=None, exclude_modules=[], group_size=16)
    if fmt == "compressed-tensors":
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        return CompressedTensorsConfig.from_config(COMPRESSED_TENSORS_NVFP4)
    raise ValueError(f"unknown checkpoint format {fmt!r}")


@dataclass
class BuiltLayer:
    layer: torch.nn.Module
    prefix: str


def fill_dummy(module: torch.nn.Module) -> None:
    """What ``--load-format dummy`` loads instead of a checkpoint: vLLM's own dummy loader on
    the module (random values in [-1e-3, 1e-3] on 0.11.0; by dtype and name on 0.34.0)."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(module, None)


def build_layer(experts: QuantizedExperts, fmt: str, *, top_k: int, index: int,
                dtype: torch.dtype = torch.bfloat16, overrides: Optional[dict] = None,
                process: bool = True, dummy: bool = False, **layer_kwargs) -> BuiltLayer:
    """Construct a ``FusedMoE`` under the *current* vLLM config and load ``experts`` into it.

    Must be called inside ``set_current_vllm_config`` with distributed groups initialized; the
    layer shards itself (TP/EP) from those groups, as in a real worker. ``overrides`` replaces
    checkpoint tensors by name, or leaves one out (``None``; tests use it to plant bad or
    missing scales); ``layer_kwargs`` go to
    ``FusedMoE`` (e.g. grouped top-k); ``process=False`` stops before
    ``process_weights_after_loading``; ``dummy``: no checkpoint, :func:`fill_dummy` (the
    current config must name ``load_format="dummy"`` while the layer is built, as vLLM's does).
    """
    import inspect

    from vllm.model_executor.layers.fused_moe import layer as fused_moe_layer

    # The runner factory: ``FusedMoEFactory``, or on v0.25.x the function still named
    # ``FusedMoE`` (FM/layer.py:100) where earlier releases had the class
    factory = getattr(fused_moe_layer, "FusedMoEFactory", None)
    if factory is None and inspect.isfunction(fused_moe_layer.FusedMoE):
        factory = fused_moe_layer.FusedMoE
    if factory is not None:
        return _build_runner(factory, experts, fmt, top_k=top_k, index=index, dtype=dtype,
                             overrides=overrides, process=process, dummy=dummy,
                             **layer_kwargs)
    FusedMoE = fused_moe_layer.FusedMoE
    mlp = MLP_PREFIX.format(index=index)
    layer_class = FusedMoE
    if "shared_experts" in layer_kwargs:  # the shared expert's FusedMoE, up to 0.2x
        layer_class = _shared_fused_moe_class()

    if "reduce_results" in inspect.signature(FusedMoE.__init__).parameters:
        layer_kwargs.setdefault("reduce_results", True)  # v0.20.0's FusedMoE always reduces
    # custom_routing_function=None, as in _build_runner: vLLM's own router (the TRT-LLM rows'
    # grouped top-k, which its monolithic kernel computes itself)
    layer_kwargs.setdefault("custom_routing_function", cpu_topk_softmax_routing)
    layer = layer_class(
        num_experts=experts.num_experts, top_k=top_k, hidden_size=experts.hidden,
        intermediate_size=experts.intermediate, params_dtype=dtype,
        renormalize=True, quant_config=make_quant_config(fmt), prefix=f"{mlp}.experts",
        **layer_kwargs)
    params = dict(layer.named_parameters())
    names = ("gate_proj", "down_proj", "up_proj", experts.num_experts)
    if "model" in inspect.signature(FusedMoE.make_expert_params_mapping).parameters:
        names = (layer,) + names  # v0.20.0: scans the model for LoRA's base_layer prefix
    mapping = FusedMoE.make_expert_params_mapping(*names)
    tensors = {} if dummy else expert_tensors(experts, fmt, f"{mlp}.experts")
    _override(tensors, overrides)
    if dummy:
        fill_dummy(layer)
    for name, tensor in tensors.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            vllm_name = name.replace(weight_name, param_name)
            param = params[vllm_name[len(mlp) + len(".experts."):]]
            param.weight_loader(param, tensor, vllm_name, shard_id=shard_id,
                                expert_id=expert_id)
            break
        else:
            raise KeyError(f"checkpoint tensor {name} matched no FusedMoE parameter")
    if process:
        layer.quant_method.process_weights_after_loading(layer)
    return BuiltLayer(layer=layer, prefix=f"{mlp}.experts")


def _shared_fused_moe_class():
    """``SharedFusedMoE``: under layers/shared_fused_moe/ in vLLM 0.11.0, fused_moe/ from
    0.11.1 (v0120 models/llama4.py:37)."""
    try:
        from vllm.model_executor.layers.fused_moe import SharedFusedMoE
    except ImportError:
        from vllm.model_executor.layers.shared_fused_moe import SharedFusedMoE
    return SharedFusedMoE


def _build_runner(factory, experts: QuantizedExperts, fmt: str, *, top_k: int, index: int,
                  dtype: torch.dtype, overrides: Optional[dict], process: bool,
                  dummy: bool = False, **layer_kwargs) -> BuiltLayer:
    """The NVFP4-oracle design (0.14.0+; read on 0.34.0): ``FusedMoEFactory`` returns a
    ``MoERunner`` holding a ``RoutedExperts`` (v0.34.0 FM/layer.py:93-475), as a model's MoE
    block builds it (models/qwen3_moe.py:203-217). Weights go through the runner's
    ``load_weights`` with names relative to it, as ``AutoWeightsLoader`` hands them
    (FM/runner/moe_runner.py:306-312 -> FM/routed_experts.py:1022-1127); the model loader then
    runs the quant method's ``process_weights_after_loading`` on the module that owns it
    (model_executor/model_loader/utils.py:164-199), which picks the backend and builds the
    modular kernel, and the runner's own."""
    import inspect

    prefix = experts_prefix(index)
    # custom_routing_function=None: vLLM's own router (e.g. grouped top-k), which the TRT-LLM
    # monolithic kernel replaces by its own routing
    layer_kwargs.setdefault("custom_routing_function", cpu_topk_softmax_routing)
    if "reduce_results" in inspect.signature(factory).parameters:  # v0.24.0's always reduces
        layer_kwargs.setdefault("reduce_results", True)  # (FM/runner/moe_runner.py:451)
    if not experts.gated:  # Nemotron-H's experts (v0.34.0 models/nemotron_h.py:229-254)
        if "ckpt_names" not in inspect.signature(factory).parameters:
            raise NotImplementedError("this vLLM's MoE factory takes no ckpt_names: non-gated "
                                      "experts are built on 0.34.0's only")
        layer_kwargs.setdefault("activation", "relu2_no_mul")
        layer_kwargs.setdefault("ckpt_names", ("up_proj", "down_proj", None))
    runner = factory(
        num_experts=experts.num_experts, top_k=top_k, hidden_size=experts.hidden,
        intermediate_size=experts.intermediate, params_dtype=dtype,
        renormalize=True, quant_config=make_quant_config(fmt), prefix=prefix,
        **layer_kwargs)
    tensors = {} if dummy else expert_tensors(experts, fmt, prefix)
    _override(tensors, overrides)
    if dummy:
        fill_dummy(runner)
    elif hasattr(runner, "load_weights"):
        list(runner.load_weights((name[len(prefix) + 1:], t) for name, t in tensors.items()))
    else:  # v0.24.0: the model's loader maps names itself (models/qwen3_moe.py:553-640)
        _load_through_mapping(runner, tensors, experts.num_experts, index)
    if process:
        routed = runner.routed_experts
        routed.quant_method.process_weights_after_loading(routed)
        if hasattr(runner, "process_weights_after_loading"):  # 0.34.0, not 0.28.0
            runner.process_weights_after_loading()
    return BuiltLayer(layer=runner, prefix=prefix)


def _load_through_mapping(runner, tensors: dict, num_experts: int, index: int) -> None:
    """v0.24.0's runner has no ``load_weights``: as its models do, map each checkpoint name
    through ``fused_moe_make_expert_params_mapping`` (FM/layer.py:394-412, names relative to
    the MoE block: ``experts.routed_experts.w13_...``) and call the parameter's loader."""
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping

    mlp = MLP_PREFIX.format(index=index)
    mapping = fused_moe_make_expert_params_mapping(runner, "gate_proj", "down_proj", "up_proj",
                                                   num_experts)
    params = dict(runner.named_parameters())
    for name, tensor in tensors.items():
        relative = name[len(mlp) + 1:]  # experts.<id>.gate_proj.weight
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in relative:
                continue
            mapped = relative.replace(weight_name, param_name)
            param = params[mapped[len("experts."):]]
            param.weight_loader(param, tensor, mapped, shard_id=shard_id, expert_id=expert_id)
            break
        else:
            raise KeyError(f"checkpoint tensor {name} matched no MoE parameter")


def _override(tensors: dict, overrides: Optional[dict]) -> None:
    """Replace checkpoint tensors by name; ``None`` removes one (a checkpoint without it)."""
    for name, tensor in (overrides or {}).items():
        if name not in tensors:
            raise KeyError(f"override {name} is not a checkpoint tensor of this layer")
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor


def prepare_modular_kernel(layer: torch.nn.Module) -> None:
    """What ``GPUModelRunner.load_model`` does after loading (gpu_model_runner.py:2656).
    The oracle design builds the kernel in ``process_weights_after_loading`` instead."""
    if hasattr(layer, "routed_experts"):
        return
    from vllm.distributed.parallel_state import prepare_communication_buffer_for_model

    prepare_communication_buffer_for_model(layer)


def moe_layers_by_name(ctx) -> None:
    """Make vLLM's ``moe_forward`` op find the layer it is called on by name in forward context
    ``ctx``. vLLM 0.15.0 (forward_context.py:277-280, ``remaining_moe_layers``) and 0.15.1-0.16.0
    with ``fast_moe_cold_start`` (``all_moe_layers`` + ``moe_layer_index``) resolve the i-th MoE
    call of a forward to the i-th FusedMoE built in the process, as a model's forward calls them;
    the harness calls its layers one at a time, so every layer after the first would run layer 0.
    None is what vLLM itself sets without that mode."""
    for attr in ("remaining_moe_layers", "all_moe_layers"):
        if getattr(ctx, attr, None) is not None:
            setattr(ctx, attr, None)


def forward(layer: torch.nn.Module, hidden_states: torch.Tensor, router_logits: torch.Tensor,
            *, vllm_config, num_tokens_across_dp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One MoE forward through ``FusedMoE.forward_native`` (a ``SharedFusedMoE``: its own
    ``forward``, which runs the shared expert itself where the kernel does not, e.g. 0.12.0's
    FlashInfer CUTLASS under DP, v0120 fused_moe/shared_fused_moe.py:30-41, 60-75, and then
    ``forward_native`` through the custom-op dispatch): vLLM's ``moe_forward`` custom op
    (which looks the layer up by name in the forward context and runs ``forward_impl``) and the
    TP/EP all-reduce, which 0.11.0 does inside ``forward_impl`` and 0.11.1+ after the op.
    The layer gets its own copy of ``hidden_states``: under the router-weight-on-input flag the
    prepares of vLLM 0.11.x-0.13.x scale it in place (``a1.mul_(topk_weights)``, v0120
    flashinfer_cutlass_prepare_finalize.py:65-70), and the caller runs stock and the plugin on
    the same tokens."""
    from vllm.forward_context import get_forward_context, set_forward_context

    hidden_states = hidden_states.clone()

    with set_forward_context({}, vllm_config, num_tokens=hidden_states.shape[0],
                             num_tokens_across_dp=num_tokens_across_dp):
        moe_layers_by_name(get_forward_context())
        if hasattr(layer, "forward_native") and not hasattr(layer, "_shared_experts"):
            out = layer.forward_native(hidden_states, router_logits)
        else:  # oracle design: MoERunner.forward (0.28.0+), FusedMoE.forward (0.20.0)
            out = layer.forward(hidden_states, router_logits)
    if isinstance(out, tuple):  # (shared, routed): added in the activation dtype, as the
        shared, routed = out  # model does (v0110 models/llama4.py:115-119; 0.34.0's runner)
        return (routed + shared).float()
    return out.clone()
