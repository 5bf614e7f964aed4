# SPDX-License-Identifier: Apache-2.0
"""Run one NVFP4 MoE layer in every parallel layout, in real multi-process gloo groups.

Each layout spawns ``world`` fresh processes that initialize vLLM's own distributed groups
(``init_distributed_environment`` + ``initialize_model_parallel``; DP through
``ParallelConfig(data_parallel_size=...)`` exactly as an engine core does), build the layer
with the stock quant methods and again with the plugin's, and send their outputs back.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fp4_moe_lab.simulation.gpus import DEFAULT_CAPABILITY
from vllm_fp4_moe_plugin.base.support import LAYOUTS, Design, Layout

# One vocabulary of layouts, in the vLLM-free support model (support.LAYOUTS).
LAYOUT_NAMES = tuple(n for n, spec in LAYOUTS.items()
                     if spec.first_design is Design.INIT_PREPARE_FINALIZE)
# Layouts that exist only in the NVFP4-oracle design's all-to-all choices.
ORACLE_ONLY_LAYOUTS = tuple(n for n in LAYOUTS if n not in LAYOUT_NAMES)


def default_layouts() -> tuple[str, ...]:
    """The matrix's layouts for the installed vLLM: the eight of every design, plus the
    one-sided NVLink dispatch where vLLM has it in the form the seam simulates (0.34.0; v0.14.0
    has no such dispatcher, see :func:`~.blackwell_oracle.simulates_one_sided`)."""
    from fp4_moe_lab.simulation import blackwell_oracle

    one_sided = blackwell_oracle.applies() and blackwell_oracle.simulates_one_sided()
    return LAYOUT_NAMES + (ORACLE_ONLY_LAYOUTS if one_sided else ())


@dataclass(frozen=True)
class Scenario:
    """One synthetic MoE layer and its inputs; every process regenerates it from the seeds."""

    num_experts: int = 8
    hidden: int = 256
    # 512 so that TP=2 leaves 256 per rank: vLLM 0.11.0 asserts I_per_partition/16 % 16 == 0
    # on the CUTLASS path (modelopt.py:1384), i.e. the SM100 kernels' 256 alignment.
    intermediate: int = 512
    top_k: int = 2
    tokens: int = 32
    seed: int = 0
    input_scale_spread: float = 4.0
    # (gemm, case) of :mod:`.planted_scales`: one expert with an uncalibrated (or legitimately
    # large) activation scale; experts() is then the layer a correct loader computes with.
    planted: Optional[tuple] = None  # or (gemm, case, count): count experts planted
    # A real checkpoint's MoE layer instead of random experts (:mod:`.checkpoint_layer`); its
    # sizes must match num_experts/hidden/intermediate.
    checkpoint: Optional[str] = None
    layer: int = 0
    # >= 1: gate and up quantized each with its own weight global scale, up up to this factor
    # larger (``random_experts``); 0: one joint scale.
    gate_up_split: float = 0.0
    # "dummy": built as ``--load-format dummy`` builds it, vLLM's random values and no checkpoint
    # (only stock vs plugin can be compared: there is no reference layer)
    load_format: str = "auto"
    # False: non-gated relu2 experts (Nemotron-H), built as its model file builds them
    gated: bool = True
    # Llama-4's MoE: top-1, its own routing (top-k, then sigmoid), the router weight applied to
    # the input before GEMM1 instead of to the expert's output (models/llama4.py:73-84, 132-146)
    router_weight_on_input: bool = False
    # A shared expert beside the routed ones, handed to the MoE layer as the family's model
    # file does (Llama-4: ``SharedFusedMoE(shared_experts=...)``, v0110 models/llama4.py:82-100;
    # ``FusedMoEFactory(shared_experts=...)`` on 0.34.0): the layer returns (shared, routed)
    # and the harness adds them, as ``Llama4MoE.forward`` does.
    shared_expert: bool = False

    def layer_kwargs(self) -> dict:
        """``FusedMoE`` arguments beyond the defaults, as the family's model file passes them."""
        kwargs: dict = {}
        if self.shared_expert:
            kwargs["shared_experts"] = self.shared_expert_module(tp_split=True)
        if not self.router_weight_on_input:
            return kwargs
        if self.top_k != 1:
            raise ValueError("the router weight on the input is top-1 in vLLM (its prepare "
                             "asserts it)")
        return {**kwargs, "apply_router_weight_on_input": True,
                "custom_routing_function": llama4_routing()}

    def shared_expert_module(self, tp_split: bool = False):
        """The shared expert (:class:`SharedExpert`) every rank and the references build from
        the seed; ``tp_split``: each TP rank returns its share, which vLLM then all-reduces."""
        return SharedExpert(self.hidden, self.intermediate // 2, seed=self.seed + 101,
                            tp_split=tp_split)

    def with_shared(self, x: torch.Tensor, ideal: torch.Tensor, fp32: torch.Tensor):
        """A reference pair with the shared expert (if any) added: on the layer's input as it
        came (never the router-weighted one), in bf16 to the ideal output as the model and
        0.34.0's runner add them, in fp32 to the fp32 one."""
        if not self.shared_expert:
            return ideal, fp32
        shared = self.shared_expert_module()(x)
        return (ideal.to(torch.bfloat16) + shared).float(), fp32 + shared.float()

    def _random_experts(self):
        from fp4_moe_lab.nvfp4 import random_experts

        return random_experts(self.num_experts, self.hidden, self.intermediate, seed=self.seed,
                              input_scale_spread=self.input_scale_spread,
                              gate_up_split=self.gate_up_split, gated=self.gated)

    def gate_up_worst_ratio(self) -> float:
        """The largest ratio, either way, of an expert's gate and up weight global scales as
        quantized (each half from its own amax: the masters' own amaxes differ too)."""
        e = self._random_experts()
        if e.w3_weight_gs is None:
            return 1.0
        q = e.w13_weight_gs / e.w3_weight_gs
        return float(torch.maximum(q, 1 / q).max())

    def experts(self, ep_size: int = 1):
        """The layer the references compute with; ``ep_size``: the EP ranks a real checkpoint's
        uncalibrated experts are repaired within (each rank sees only its own experts)."""
        if self.checkpoint is not None:
            from fp4_moe_lab.simulation import checkpoint_layer

            return checkpoint_layer.reference_experts(self.checkpoint, self.layer, ep_size)
        experts = self._random_experts()
        if self.planted is None:
            return experts
        from fp4_moe_lab.simulation import planted_scales

        return planted_scales.reference_experts(experts, *self.planted)

    def checkpoint_overrides(self, fmt: str, prefix: str, mode: str = "stock") -> dict:
        """Checkpoint tensors replaced when the layer is loaded (the stored values; ``None``: a
        tensor the checkpoint lacks, in ``mode``)."""
        if self.checkpoint is not None:
            from fp4_moe_lab.simulation import checkpoint_layer

            return checkpoint_layer.overrides(self.checkpoint, self.layer, fmt, prefix)
        if self.planted is None:
            return {}
        from fp4_moe_lab.simulation import planted_scales

        return planted_scales.overrides(self._random_experts(), fmt, prefix, *self.planted,
                                        mode=mode)

    def inputs(self, dp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states (with a few outlier rows) and router logits for one DP rank."""
        g = torch.Generator().manual_seed(self.seed * 1000 + 17 + dp_rank)
        x = torch.randn(self.tokens, self.hidden, generator=g)
        x[:: max(1, self.tokens // 4)] *= 8.0
        if self.checkpoint is not None:  # within the calibrated range, as the model's tokens
            amax = 2688.0 / self.experts().w13_input_gs.float().max()  # smallest calibrated
            x = x * (amax / x.abs().max())
        logits = torch.randn(self.tokens, self.num_experts, generator=g)
        return x.to(torch.bfloat16), logits.to(torch.bfloat16)


class SharedExpert(torch.nn.Module):
    """A gated SiLU MLP in bf16, whole on every rank (Llama-4's ``shared_expert`` is a
    ``LlamaMLP``; a bf16 stand-in here: what matters is which input the layer hands it, not its
    quantization). With ``tp_split`` it returns ``1 / tp_size`` of its output (exact in bf16),
    so vLLM's all-reduce of the shared output over TP gives it whole, as a TP-sharded MLP's."""

    def __init__(self, hidden: int, intermediate: int, seed: int, tp_split: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        scale = hidden ** -0.5
        self.gate = torch.nn.Parameter((torch.randn(intermediate, hidden, generator=g) * scale)
                                       .to(torch.bfloat16), requires_grad=False)
        self.up = torch.nn.Parameter((torch.randn(intermediate, hidden, generator=g) * scale)
                                     .to(torch.bfloat16), requires_grad=False)
        self.down = torch.nn.Parameter((torch.randn(hidden, intermediate, generator=g)
                                        * intermediate ** -0.5).to(torch.bfloat16),
                                       requires_grad=False)
        self.tp_split = tp_split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        x = x.to(torch.bfloat16)
        out = f.linear(f.silu(f.linear(x, self.gate)) * f.linear(x, self.up), self.down)
        if self.tp_split:
            from vllm.distributed import get_tensor_model_parallel_world_size

            out = out / get_tensor_model_parallel_world_size()
        return out


def llama4_routing():
    """vLLM's own Llama-4 routing (``Llama4MoE.custom_routing_function``: top-k of the logits,
    then sigmoid), the function its model hands the MoE layer."""
    from vllm.model_executor.models.llama4 import Llama4MoE

    return Llama4MoE.custom_routing_function


@dataclass
class RankOutput:
    rank: int
    dp_rank: int
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # "fmt/mode" -> [T, H]
    info: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # "fmt/mode" -> why forward failed

    def merged(self, other: Optional[RankOutput]) -> RankOutput:
        """This rank's outputs with ``other``'s (another format's layers) added; None: self."""
        if other is not None:
            self.outputs.update(other.outputs)
            self.info.update(other.info)
            self.errors.update(other.errors)
        return self


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankContext:
    """What a job running inside one simulated rank gets: vLLM groups are initialized."""

    rank: int
    dp_rank: int
    layout: Layout
    vllm_config: Any


def _worker(rank: int, layout: Layout, job: str, args: tuple, ports: list[int], queue,
            log_path: Optional[str], backend: str = "throughput",
            capability: str = DEFAULT_CAPABILITY) -> None:
    if log_path:  # vLLM and gloo print a lot per rank; keep it out of the caller's output
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        # Bytes, not tensors: torch would share storage by fd, which dies with this process.
        buf = io.BytesIO()
        torch.save(_run_job(rank, layout, job, args, ports, backend, capability), buf)
        queue.put((rank, buf.getvalue()))
    except BaseException:  # report, never hang the parent
        queue.put(RuntimeError(f"rank {rank} of layout {layout.name} failed in {job}:\n"
                               f"{traceback.format_exc()}"))


def _run_job(rank: int, layout: Layout, job: str, args: tuple, ports: list[int],
             backend: str = "throughput", capability: str = DEFAULT_CAPABILITY):
    os.environ["VLLM_ALL2ALL_BACKEND"] = layout.all2all
    torch.set_num_threads(1)
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from fp4_moe_lab.simulation import blackwell_oracle

    oracle = blackwell_oracle.applies()
    if oracle:
        simulated_blackwell = blackwell_oracle.simulated_blackwell
    else:
        from fp4_moe_lab.simulation.blackwell import simulated_blackwell

    module, _, func = job.partition(":")
    fn = getattr(importlib.import_module(module), func)
    dp_rank = rank if layout.dp > 1 else 0
    rank_in_dp = 0 if layout.dp > 1 else rank
    parallel = ParallelConfig(
        tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp,
        data_parallel_size=layout.dp, data_parallel_rank=dp_rank,
        enable_expert_parallel=layout.ep, data_parallel_master_ip="127.0.0.1",
        expert_placement_strategy=layout.placement)
    if "all2all_backend" in getattr(ParallelConfig, "__dataclass_fields__", {}):
        parallel.all2all_backend = layout.all2all  # 0.11.1+: a config field, not only an env
    parallel._data_parallel_master_port_list = list(ports[1:])
    extra, seam = {}, {}
    if oracle:  # the user's choice of FlashInfer backend, as this release takes it
        import vllm.config

        if blackwell_oracle.takes_moe_backend():
            extra["kernel_config"] = vllm.config.KernelConfig(  # --moe-backend (0.20.0+)
                moe_backend=blackwell_oracle.MOE_BACKENDS[backend])
        elif backend == "auto":
            raise NotImplementedError("--moe-backend auto: this vLLM has no "
                                      "KernelConfig.moe_backend (0.20.0+)")
        else:  # 0.14.x: the FlashInfer variables (v0.14.0 FM/oracle/nvfp4.py:80-101)
            os.environ["VLLM_USE_FLASHINFER_MOE_FP4"] = "1"
            os.environ["VLLM_FLASHINFER_MOE_BACKEND"] = backend
        seam.update(backend=backend, capability=capability)
    elif backend != "throughput":
        raise NotImplementedError("spawn(backend=...) selects the oracle design's backend")
    elif capability != DEFAULT_CAPABILITY:  # the 0.11.x seam (blackwell.py) reports SM100 only
        raise NotImplementedError("spawn(capability=...) is simulated on the oracle design")
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel, **extra)
    if oracle and getattr(cfg.compilation_config, "max_cudagraph_capture_size", 0) is None:
        # A GPU engine always has one; v0.20.0's FlashInferExperts passes it to FlashInfer as
        # tune_max_num_tokens (FM/flashinfer_cutlass_moe.py:393), a tuning hint only.
        cfg.compilation_config.max_cudagraph_capture_size = 512
    with set_current_vllm_config(cfg), simulated_blackwell(**seam):
        try:
            init_distributed_environment(world_size=layout.tp * layout.pp, rank=rank_in_dp,
                                         distributed_init_method=f"tcp://127.0.0.1:{ports[0]}",
                                         local_rank=rank_in_dp, backend="gloo")
            initialize_model_parallel(layout.tp, layout.pp)
            init_workspace = _workspace_init()
            if init_workspace is not None:  # what the GPU worker does before the model is built
                init_workspace(torch.device("cpu"))  # (v0.34.0 v1/worker/gpu_worker.py:566)
            return fn(RankContext(rank=rank, dp_rank=dp_rank, layout=layout, vllm_config=cfg),
                      *args)
        finally:
            _release_groups()


def _workspace_init():
    """``init_workspace_manager`` of vLLM's workspace, which its MoE layers allocate from where it
    exists (0.13.0, the last modular_method release, and every oracle release); else None."""
    try:
        return importlib.import_module("vllm.v1.worker.workspace").init_workspace_manager
    except (ImportError, AttributeError):
        return None


def _release_groups() -> None:
    """Tear down vLLM's groups, also after a failure: the TP group's shared-memory broadcast
    ring is unlinked only when its last reference goes, and a rank that just exits leaves it
    to the parent's resource tracker ("leaked shared_memory objects" at the parent's exit)."""
    import gc

    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    try:
        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # best effort: never turn a finished job into a failure
        pass
    gc.collect()


def spawn(layout: Layout, job: str, *args, timeout_s: float = 600.0,
          quiet: bool = True, backend: str = "throughput",
          capability: str = DEFAULT_CAPABILITY) -> list:
    """Run ``job`` ("module:function", called as ``f(RankContext, *args)``) in every rank of
    ``layout``, each a fresh spawned process in real gloo groups; results ordered by rank.

    With ``quiet`` each rank's output goes to a log file, whose tail is attached to the error
    if a rank fails. ``backend`` (oracle design only): the seam backend every rank runs,
    ``"throughput"`` (FlashInfer CUTLASS), ``"latency"`` (TRT-LLM) or ``"auto"`` (vLLM's own
    pick), as ``--moe-backend``;
    ``capability``: the GPU the oracle seam reports (``gpus.CAPABILITIES``)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [_free_port() for _ in range(4)]
    log_dir = tempfile.mkdtemp(prefix=f"fp4moe-{layout.name}-") if quiet else None
    logs = [os.path.join(log_dir, f"rank{r}.log") if log_dir else None
            for r in range(layout.world)]
    procs = [ctx.Process(target=_worker,
                         args=(r, layout, job, args, ports, queue, logs[r], backend,
                               capability))
             for r in range(layout.world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            item = queue.get(timeout=timeout_s)
            if isinstance(item, BaseException):
                raise RuntimeError(f"{item}\n{_log_tails(logs)}") from None
            rank, payload = item
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        queue.close()
        if log_dir:  # the tails are already in the error, if any
            shutil.rmtree(log_dir, ignore_errors=True)
    return [results[r] for r in sorted(results)]


def _log_tails(logs: list, lines: int = 30) -> str:
    out = []
    for path in logs:
        if path and os.path.exists(path):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
            out.append(f"--- last {len(tail)} lines of {path} ---\n" + "".join(tail))
    return "\n".join(out)


def stock_and_plugin_outputs(ctx: RankContext, scenario: Scenario, formats: tuple[str, ...],
                             modes: tuple[str, ...],
                             layer_kwargs: Optional[dict] = None,
                             first_index: int = 0) -> RankOutput:
    """Job: build the layer once per format x mode (stock / plugin) and run the same tokens
    (``layer_kwargs``: extra ``FusedMoE`` arguments, e.g. DeepSeek-style routing;
    ``first_index``: the first layer index, so that several calls in one process never reuse a
    layer name)."""
    from fp4_moe_lab.simulation import moe_layer
    from vllm_fp4_moe_plugin.patches import consistency, ledger
    from vllm_fp4_moe_plugin.scales import unloaded

    result = RankOutput(rank=ctx.rank, dp_rank=ctx.dp_rank)
    experts = scenario.experts()
    x, logits = scenario.inputs(ctx.dp_rank)
    dp = ctx.layout.dp
    across_dp = torch.tensor([scenario.tokens] * dp) if dp > 1 else None
    index = first_index
    dummy = scenario.load_format == "dummy"
    if dummy:  # what vLLM's config holds while its dummy loader builds the model
        ctx.vllm_config.load_config.load_format = "dummy"
    try:
        for fmt in formats:
            for mode in modes:
                if mode == "plugin":  # what register() installs when the plugin is active
                    ledger.apply_all()
                    unloaded.watch(unloaded.any_layer if ledger.plan().design is
                                   Design.NVFP4_ORACLE else unloaded.repaired_by_plugin_class)
                else:
                    ledger.revert_all()
                    unloaded.remove()
                overrides = scenario.checkpoint_overrides(fmt, moe_layer.experts_prefix(index),
                                                          mode)
                key = f"{fmt}/{mode}"
                try:
                    built = moe_layer.build_layer(experts, fmt, top_k=scenario.top_k,
                                                  index=index, overrides=overrides or None,
                                                  dummy=dummy, **{**scenario.layer_kwargs(),
                                                                  **dict(layer_kwargs or {})})
                except Exception as exc:  # vLLM refusing the backend here is a row; else a bug
                    result.errors[key] = refusal(exc)
                    result.info[key] = {"prepare_finalize": None, "a1_gscale_shape": None}
                    index += 1
                    continue
                index += 1
                moe_layer.prepare_modular_kernel(built.layer)
                try:
                    out = moe_layer.forward(built.layer, x, logits, vllm_config=ctx.vllm_config,
                                            num_tokens_across_dp=across_dp)
                except Exception as exc:  # a layout stock cannot run at all is a row too
                    result.errors[key] = f"{type(exc).__name__}: {exc}"
                    out = None
                # After the forward: the direct path builds its quant config lazily.
                result.info[key] = describe_layer(built.layer)
                if out is None:
                    continue
                result.outputs[key] = out.float()
                if mode == "plugin":  # the load-time check's verdict on this very layer
                    last = consistency.last_result()
                    result.info[key]["check"] = (last.ok, last.path) if last else None
    finally:
        ledger.revert_all()
        unloaded.remove()
    return result


def refusal(exc: Exception) -> str:
    """The row's error when vLLM's own NVFP4 backend selection refused the requested backend in
    this layout (e.g. 0.15.0's FlashInfer CUTLASS without EP at DP=2, ``is_supported_config``:
    a real deployment is refused the same way, or auto-selects another kernel), or when vLLM
    refused the checkpoint's activation scales (upstream/0002); anything else raised while
    building the layer is re-raised (a harness gap must stay loud)."""
    from vllm_fp4_moe_plugin.base import vllm_modules as vm

    frames = {f.name for f in traceback.extract_tb(exc.__traceback__)}
    if isinstance(exc, ValueError) and frames & {"select_nvfp4_moe_backend",
                                                  vm.ORACLE_INPUT_SCALE_CHECK}:
        from fp4_moe_lab.simulation.judge import REFUSED

        return REFUSED + str(exc)
    raise exc


def describe_layer(layer) -> dict[str, Any]:
    """Which classes run this layer and what GEMM1 scale they were given (for rows and tests)."""
    if hasattr(layer, "routed_experts") or hasattr(layer.quant_method, "moe_kernel"):
        return _describe_runner(layer)  # oracle design (MoERunner -> RoutedExperts from 0.28)
    qm = layer.quant_method
    fe = getattr(qm, "fused_experts", None)
    if fe is None and hasattr(getattr(qm, "kernel", None), "fused_experts"):
        # v0.14.0: the oracle's modular kernel, built in process_weights_after_loading
        # (Q/compressed_tensors/compressed_tensors_moe.py:429-436, FM/oracle/nvfp4.py:229-260)
        fe = qm.kernel
    cfg = getattr(qm, "moe_quant_config", None)
    a1 = getattr(cfg, "a1_gscale", None)
    backend = getattr(qm, "flashinfer_moe_backend", None)  # 0.11.x: CUTLASS/TRT-LLM
    if backend is None:  # v0.14.0: the oracle's choice (FM/oracle/nvfp4.py:48-53), also
        # behind the modular method that replaces it under DP (FM/fused_moe_modular_method.py:40)
        chooser = getattr(qm, "old_quant_method", qm)
        backend = getattr(getattr(chooser, "nvfp4_backend", None), "value", None)
    return {
        "quant_method": f"{type(qm).__module__}.{type(qm).__name__}",
        "prepare_finalize": type(fe.prepare_finalize).__name__ if fe is not None else "direct",
        "experts": type(fe.fused_experts).__name__ if fe is not None else "direct",
        "a1_gscale_shape": list(a1.shape) if a1 is not None else None,
        "a1_gscale": a1.detach().float().reshape(-1).tolist() if a1 is not None else None,
        "backend": str(backend),
        "ep_rank": layer.ep_rank, "ep_size": layer.ep_size,
        "tp_rank": layer.tp_rank, "tp_size": layer.tp_size,
    }


def _describe_runner(runner) -> dict[str, Any]:
    routed = getattr(runner, "routed_experts", runner)
    qm = routed.quant_method
    mk = getattr(qm, "moe_kernel", None)
    cfg = getattr(qm, "moe_quant_config", None)
    a1 = getattr(cfg, "a1_gscale", None)
    a2 = getattr(cfg, "a2_gscale", None)
    par = routed.moe_config.moe_parallel_config
    return {
        "quant_method": f"{type(qm).__module__}.{type(qm).__name__}",
        "backend": getattr(getattr(qm, "nvfp4_backend", None), "value", None),
        "prepare_finalize": type(mk.prepare_finalize).__name__ if mk is not None else "direct",
        "experts": type(mk.fused_experts).__name__ if mk is not None else "direct",
        "a1_gscale_shape": list(a1.shape) if a1 is not None else None,
        "a1_gscale": a1.detach().float().reshape(-1).tolist() if a1 is not None else None,
        "a2_gscale": a2.detach().float().reshape(-1).tolist() if a2 is not None else None,
        "ep_rank": par.ep_rank, "ep_size": par.ep_size,
        "tp_rank": par.tp_rank, "tp_size": par.tp_size,
        "use_all2all_kernels": bool(par.use_all2all_kernels),
    }


def run_layout(layout: Layout, scenario: Scenario, formats=("modelopt", "compressed-tensors"),
               modes=("stock", "plugin"), backend: str = "throughput",
               layer_kwargs: Optional[dict] = None,
               capability: str = DEFAULT_CAPABILITY) -> list[RankOutput]:
    """Stock and plugin outputs of every rank of ``layout`` on the scenario's tokens
    (``backend``, ``capability``: see :func:`spawn`; ``layer_kwargs``: see
    :func:`stock_and_plugin_outputs`)."""
    return spawn(layout, f"{__name__}:stock_and_plugin_outputs", scenario, tuple(formats),
                 tuple(modes), layer_kwargs, backend=backend, capability=capability)
