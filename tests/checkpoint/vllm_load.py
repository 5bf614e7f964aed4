# SPDX-License-Identifier: Apache-2.0
"""Load a checkpoint directory with vLLM 0.11.0's own model class, loader and quant config, on CPU.

Why: the loaders skip or silently leave ``torch.empty`` garbage for some misnamed tensors
(quantized models get no strict "all weights loaded" check, default_loader.py:271-277), so the
only proof that a written checkpoint is right is to load it the way an engine does and compare
every parameter slot with the checkpoint tensor that should have filled it.

Must run inside a simulated rank (``simulation.layouts.spawn``): distributed groups initialized
and :func:`~fp4_moe_lab.simulation.blackwell.simulated_blackwell` active, so the NVFP4
MoE methods can be constructed. This mirrors ``BaseModelLoader.load_model``
(vllm/model_executor/model_loader/base_loader.py:36-52) step by step, so that names seen and
parameters loaded can be recorded in between.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

# Backend classes the real platforms pick (vllm/platforms/cpu.py:93-107 for plain attention;
# TRITON_MLA is the generic MLA fallback, vllm/platforms/cuda.py:243-300). Only the classes are
# constructed; no attention is run.
ATTENTION_BACKENDS = {
    False: "vllm.v1.attention.backends.cpu_attn.TorchSDPABackend",
    True: "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend",
}
# MLA's impl sizes a workspace from cache_config.block_size at construction
# (mla/common.py:451); platforms set it in check_and_update_config, UnspecifiedPlatform does not.
BLOCK_SIZE = 64

# (vLLM fused param, checkpoint shard) in the models' stacked_params_mapping order
# (deepseek_v2.py:1300-1306, qwen3_moe.py:442-449); shards are concatenated along dim 0.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
           "gate_up_proj": ("gate_proj", "up_proj"),
           "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.(?P<kind>\w+)$")


@contextlib.contextmanager
def attention_backend_names() -> Iterator[None]:
    """Name an attention backend class where vLLM 0.11.0's UnspecifiedPlatform names none.

    With the CUDA wheel on a machine without a GPU, ``current_platform`` is UnspecifiedPlatform,
    whose ``get_attn_backend_cls`` returns "" (platforms/interface.py:194-199), so every
    ``Attention`` layer raises ``ValueError: Invalid attention backend for None``
    (attention/selector.py:207-211) while the model class is being constructed.
    """
    from vllm.platforms import current_platform

    def backend(selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1,
                use_mla, has_sink, use_sparse=False):
        return ATTENTION_BACKENDS[bool(use_mla)]

    saved = current_platform.__dict__.get("get_attn_backend_cls")
    current_platform.get_attn_backend_cls = backend
    try:
        yield
    finally:
        if saved is None:
            del current_platform.get_attn_backend_cls
        else:
            current_platform.get_attn_backend_cls = saved


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: Any
    vllm_config: Any
    checkpoint_names: list[str]  # in the order vLLM's safetensors iterator yielded them
    loaded_params: set[str]  # what model.load_weights reported
    raw_params: dict[str, torch.Tensor] = field(default_factory=dict)  # before processing


def load_model(path: str, parallel_config, *, process: bool = True) -> LoadedModel:
    """Build ``config.json``'s architecture with vLLM's ModelConfig/VllmConfig and load
    ``path`` through ``DefaultModelLoader``'s safetensors iterator and ``model.load_weights``;
    then (``process``) ``process_weights_after_loading``, as an engine's worker does."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
        set_default_torch_dtype,
    )

    model_config = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16",
                               enforce_eager=True, max_model_len=256)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                             parallel_config=parallel_config,
                             cache_config=CacheConfig(block_size=BLOCK_SIZE),
                             load_config=LoadConfig())
    device = torch.device("cpu")
    names: list[str] = []

    def recorded(weights):
        for name, tensor in weights:
            names.append(name)
            yield name, tensor

    with set_current_vllm_config(vllm_config), attention_backend_names():
        with set_default_torch_dtype(model_config.dtype):
            with device:
                model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            loader = DefaultModelLoader(vllm_config.load_config)
            loaded = model.load_weights(recorded(loader.get_all_weights(model_config, model)))
            raw = {k: v.detach().clone() for k, v in model.named_parameters()}
            if process:
                process_weights_after_loading(model, model_config, device)
    return LoadedModel(model=model, model_config=model_config, vllm_config=vllm_config,
                       checkpoint_names=names, loaded_params=set(loaded or ()), raw_params=raw)


def _expert_slot(params: dict, name: str):
    """The parameter slice a FusedMoE weight loader writes expert tensor ``name`` into, at
    TP=EP=1 (layer.py:1235-1330, 1482-1497): gate rows [0, I), up rows [I, 2I)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    e, proj, kind = int(m["e"]), m["proj"], m["kind"]
    gemm = "w2" if proj == "down_proj" else "w13"
    param = params.get(f"{m['moe']}.{gemm}_{kind}")
    if param is None:
        return None
    row = param[e]
    if gemm == "w2" or kind == "input_scale":
        return row  # ModelOpt's GEMM1 input_scale fills the whole [e] row; the last write wins
    if row.dim() == 1:  # per-tensor [E, 2]: [e][0] gate, [e][1] up
        return row[0 if proj == "gate_proj" else 1]
    half = row.shape[0] // 2
    return row[:half] if proj == "gate_proj" else row[half:]


def _stacked_slot(params: dict, name: str, sizes: dict):
    """Rows of a fused Linear (``qkv_proj`` ...) that hold checkpoint shard ``name``."""
    base, _, leaf = name.rpartition(".")
    owner, _, shard = base.rpartition(".")
    for fused, shards in STACKED.items():
        if shard in shards and f"{owner}.{fused}.{leaf}" in params:
            start = sum(sizes.get(f"{owner}.{s}.{leaf}", 0) for s in shards[:shards.index(shard)])
            return params[f"{owner}.{fused}.{leaf}"][start:start + sizes[name]]
    return None


def unreached_tensors(loaded: LoadedModel,
                      checkpoint: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{checkpoint name: why}`` for every tensor whose values did not land, bit for bit, in
    the parameter slot vLLM's loaders should have put it in (empty = all reached)."""
    params = loaded.raw_params
    sizes = {k: t.shape[0] for k, t in checkpoint.items() if t.dim()}
    problems: dict[str, str] = {}
    seen = set(loaded.checkpoint_names)
    for name, tensor in checkpoint.items():
        if name not in seen:
            problems[name] = "never yielded by vLLM's safetensors iterator"
            continue
        slot = params.get(name)
        if slot is None:
            slot = _expert_slot(params, name)
        if slot is None:
            slot = _stacked_slot(params, name, sizes)
        if slot is None:
            problems[name] = "no parameter holds it"
            continue
        if tensor.numel() == slot.numel():
            want = tensor.to(slot.dtype).reshape(slot.shape)
        elif tensor.numel() == 1:  # a per-tensor scalar broadcast into a row (ModelOpt input_scale)
            want = tensor.to(slot.dtype).reshape(()).expand(slot.shape)
        else:
            want = None
        if want is None:
            problems[name] = f"shape {tuple(tensor.shape)} vs parameter slot {tuple(slot.shape)}"
        elif not torch.equal(want.view(torch.uint8) if want.element_size() == 1 else want,
                             slot.view(torch.uint8) if slot.element_size() == 1 else slot):
            problems[name] = "parameter slot holds different values"
    return problems


def unfilled_expert_slots(loaded: LoadedModel, checkpoint: dict[str, torch.Tensor]) -> list[str]:
    """Checkpoint names a ``FusedMoE`` parameter slot expects but the checkpoint lacks.

    The other direction of :func:`unreached_tensors`: vLLM allocates every expert parameter with
    ``torch.empty`` and reports a parameter as loaded once *any* expert filled it, so a missing
    expert tensor is silent. Each ``w13_<leaf>`` row needs ``gate_proj.<leaf>`` and
    ``up_proj.<leaf>``, each ``w2_<leaf>`` row ``down_proj.<leaf>``."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    missing = []
    for prefix, module in loaded.model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        for pname in sorted(n for n, _ in module.named_parameters(recurse=False)):
            full = f"{prefix}.{pname}"
            if full not in loaded.raw_params or not pname.startswith(("w13_", "w2_")):
                continue
            gemm, _, leaf = pname.partition("_")
            projs = ("gate_proj", "up_proj") if gemm == "w13" else ("down_proj",)
            for e in range(module.global_num_experts):
                missing += [f"{prefix}.{e}.{proj}.{leaf}" for proj in projs
                            if f"{prefix}.{e}.{proj}.{leaf}" not in checkpoint]
    return missing
