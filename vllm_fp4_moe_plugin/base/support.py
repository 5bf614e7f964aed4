# SPDX-License-Identifier: Apache-2.0
"""Where stock vLLM computes NVFP4 MoE layers wrongly, by design, format and layout: vLLM-free.

Asked by the patches, ``doctor``, ``audit``, the off-switch warning and the matrix; checked against
docs/SUPPORT.md's table. Mechanisms: docs/ROOT-CAUSE.md §5 (0.11.0), §12 (oracle). Citation
prefixes (docs/CITATIONS.md): ``FM`` = ``vllm/model_executor/layers/fused_moe``, ``Q`` =
``vllm/model_executor/layers/quantization``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence


class Design(str, Enum):
    """vLLM's NVFP4 MoE designs, named for what each one *is*. The installed one is found by
    feature probes (``compat``); the release ranges serve ``audit --vllm`` and what users read."""

    # Quant methods build their modular kernel in FusedMoEMethodBase.init_prepare_finalize.
    INIT_PREPARE_FINALIZE = "init_prepare_finalize"
    # FusedMoE.maybe_init_modular_kernel wraps the method in FusedMoEModularMethod; no oracle.
    MODULAR_METHOD = "modular_method"
    # fused_moe/oracle/nvfp4.py picks the NVFP4 backend and collapses the activation scales.
    NVFP4_ORACLE = "nvfp4_oracle"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def first(self) -> tuple[int, int, int]:
        return _DESIGN_RELEASES[self][0]

    @property
    def last(self) -> tuple[int, int, int]:
        """The newest release read; later ones are assumed the same until read."""
        return _DESIGN_RELEASES[self][1]

    @property
    def releases(self) -> str:
        a, b = (".".join(map(str, v)) for v in (self.first, self.last))
        return a if a == b else f"{a} - {b}"

    @property
    def label(self) -> str:
        """What users read: ``nvfp4_oracle design (vLLM 0.14.0 - 0.34.0)``."""
        return f"{self.value} design (vLLM {self.releases})"


_DESIGN_RELEASES = {Design.INIT_PREPARE_FINALIZE: ((0, 11, 0), (0, 11, 0)),
                    Design.MODULAR_METHOD: ((0, 11, 1), (0, 13, 0)),
                    Design.NVFP4_ORACLE: ((0, 14, 0), (0, 34, 0))}
DESIGNS = tuple(Design)  # oldest first


def parse_release(version: str) -> tuple[int, int, int]:
    """``"0.12.0+cpu"`` -> ``(0, 12, 0)``; ValueError naming the value otherwise."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if not m:
        raise ValueError(f"not a vLLM release number: {version!r} (e.g. 0.34.0)")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def design_for_release(version: str) -> Optional[Design]:
    """The design a vLLM release has, by the table above; None before 0.11.0."""
    v = parse_release(version)
    found = None
    for d in DESIGNS:
        if v >= d.first:
            found = d
    return found


def design(key: str | Design) -> Design:
    """A design from its name; ValueError listing the names otherwise."""
    try:
        return Design(key)
    except ValueError:
        raise ValueError(f"unknown MoE design {key!r}: one of "
                         f"{[d.value for d in DESIGNS]}") from None

# --all2all-backend values quantizing on the *receiving* rank (own scale): consistent whatever
# the ranks' scales. In v0.34.0 FM/prepare_finalize/, DeepEP HT, v2 and NIXL-EP dispatch bf16
# (deepep_ht.py:315-334, deepep_v2.py:355-376, nixl_ep.py:178-180), MORI is ROCm-only, MoonEP
# refuses quantized dispatch (moonep.py:343), passthrough.py:30-41 quantizes in its kernel.
RECEIVER_QUANTIZING_ALL2ALL = frozenset({
    "deepep_high_throughput", "deepep_v2", "nixl_ep", "mori", "moonep", "passthrough"})
# DeepEP low-latency dispatches bf16 unless VLLM_DEEPEPLL_NVFP4_DISPATCH=1: then it quantizes on
# the sender with the sender's a1_gscale (deepep_ll.py:197-216, 268-319).
DEEPEP_LL = "deepep_low_latency"


def quantizes_on_sender(all2all_backend: str, *, deepep_ll_nvfp4_dispatch: bool = False) -> bool:
    """Does this all-to-all backend quantize GEMM1's input before the tokens leave their rank? The
    default (aliases ``naive``/``pplx``) and FlashInfer's NVLink one- and two-sided dispatchers
    (alias ``flashinfer_all2allv``) do (v0.34.0 FM/prepare_finalize/naive_dp_ep.py:26-54,
    flashinfer_nvlink_two_sided.py:101-110, flashinfer_nvlink_one_sided.py:127-137); so does an
    unknown backend: agreeing on one scale is consistent either way."""
    if all2all_backend == DEEPEP_LL:
        return deepep_ll_nvfp4_dispatch
    return all2all_backend not in RECEIVER_QUANTIZING_ALL2ALL


def ep_slices(num_experts: int, ep_size: int, placement: str = "linear") -> list[list[int]]:
    """The global expert ids each EP rank owns, as ``determine_expert_map`` places them (v0.34.0
    FM/expert_map_manager.py:22-100): ``linear``: contiguous blocks, one more expert on each of the
    first ``num_experts % ep_size`` ranks; ``round_robin``: rank r gets r, r + ep_size, ..."""
    if ep_size < 1 or num_experts < 1:
        raise ValueError(f"need >= 1 expert and EP size >= 1, not {num_experts} and {ep_size}")
    if placement == "round_robin":
        return [list(range(r, num_experts, ep_size)) for r in range(ep_size)]
    if placement != "linear":
        raise ValueError(f"unknown expert placement {placement!r}: linear or round_robin")
    base, extra = divmod(num_experts, ep_size)
    out, start = [], 0
    for r in range(ep_size):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_local_maxima(input_amax: Sequence[float], ep_size: int,
                      placement: str = "linear") -> list[float]:
    """Per EP rank, the max GEMM1 input amax over its local experts (0.0: none), the scale stock
    compressed-tensors collapses to there (``input_amax[e]``: 1 / input global scale, max w1/w3)."""
    return [max((input_amax[e] for e in s), default=0.0)
            for s in ep_slices(len(input_amax), ep_size, placement)]


def stock_dp_ep_off_by(input_amax: Sequence[float], ep_size: int,
                       placement: str = "linear") -> float:
    """How far stock compressed-tensors' GEMM1 can be off under DP+EP with sender-side
    quantization: the largest ratio between two EP ranks' local maxima (1.0 = consistent)."""
    maxima = [m for m in rank_local_maxima(input_amax, ep_size, placement) if m > 0]
    return max(maxima) / min(maxima)


def oracle_design_hole(fmt: str, *, dp: int, ep: bool, all2all_backend: str,
                       enable_eplb: bool = False, eplb_agrees: bool = False,
                       deepep_ll_nvfp4_dispatch: bool = False,
                       global_scale_backend: bool = True) -> bool:
    """Can stock vLLM (0.14.0+) compute this layer with mismatched GEMM1 scales (it does if the
    ranks' local maxima differ)? ``eplb_agrees``: the release all-reduces under EPLB (0.28.0+)."""
    if fmt != "compressed-tensors" or dp <= 1 or not ep or not global_scale_backend:
        return False
    if enable_eplb and eplb_agrees:
        return False
    return quantizes_on_sender(all2all_backend, deepep_ll_nvfp4_dispatch=deepep_ll_nvfp4_dispatch)


# --- the layouts the matrix, audit and doctor speak of ------------------------------------------

DEFAULT_ALL2ALL = "allgather_reducescatter"  # vLLM's --all2all-backend default
# Backends whose GEMM1 scale can disagree with the activations' quantization, per design:
# FlashInfer's (0.11.0: CUTLASS and TRT-LLM, v0110 modelopt.py:1445-1449; 0.11.1 fixed all but
# CUTLASS under DP; the oracle: every global-scale backend, v0.34.0 FM/oracle/nvfp4.py:69-83).
# Marlin never reads activation scales; vLLM's own CUTLASS kernel quantizes per expert.
_KERNELS_WITH_HOLES = {
    Design.INIT_PREPARE_FINALIZE: ("flashinfer_cutlass", "flashinfer_trtllm"),
    Design.MODULAR_METHOD: ("flashinfer_cutlass",),
    Design.NVFP4_ORACLE: ("flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cutedsl")}


@dataclass(frozen=True)
class Layout:
    """One parallel layout, as vLLM's flags set it. ``name``: its class in the matrix's vocabulary
    (:data:`LAYOUTS`); a deployment (:meth:`deployed`) keeps its own sizes."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False
    all2all: str = DEFAULT_ALL2ALL
    placement: str = "linear"  # vLLM's --expert-placement-strategy
    first_design: Design = Design.INIT_PREPARE_FINALIZE  # the all2all backend's first design

    @classmethod
    def deployed(cls, tp: int = 1, dp: int = 1, pp: int = 1, ep: bool = False,
                 all2all: Optional[str] = None, placement: str = "linear") -> Layout:
        """The layout of a real deployment, named by the matrix layout it behaves like."""
        all2all = all2all or DEFAULT_ALL2ALL
        two_sided = all2all in ("flashinfer_all2allv", "flashinfer_nvlink_two_sided")
        if dp > 1:
            name = ("dp" if not ep else "dp_ep_all2allv" if two_sided
                    else "dp_ep_one_sided" if all2all == "flashinfer_nvlink_one_sided"
                    else "dp_ep_allgather")
        elif tp > 1:
            name = "tp_all2allv" if all2all == "flashinfer_all2allv" else "tp_ep" if ep else "tp"
        else:
            name = "pp" if pp > 1 else "single"
        return cls(name, tp=tp, pp=pp, dp=dp, ep=ep, all2all=all2all, placement=placement,
                   first_design=LAYOUTS[name].first_design)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ep_size(self) -> int:
        """Ranks the experts are split over (vLLM: TP x DP when EP is on, else 1)."""
        return self.tp * self.dp if self.ep else 1

    @property
    def dispatches_quantized(self) -> bool:
        """DP layouts quantize on the sender, before the destination expert is known (0.11.x)."""
        return self.dp > 1


LAYOUTS: dict[str, Layout] = {s.name: s for s in (
    Layout("single"), Layout("pp", pp=2), Layout("tp", tp=2), Layout("tp_ep", tp=2, ep=True),
    # --all2all-backend flashinfer_all2allv without DP (docs/ROOT-CAUSE.md §7, item 2)
    Layout("tp_all2allv", tp=2, all2all="flashinfer_all2allv"),
    Layout("dp_ep_allgather", dp=2, ep=True),
    Layout("dp_ep_all2allv", dp=2, ep=True, all2all="flashinfer_all2allv"), Layout("dp", dp=2),
    # FlashInfer's NVLink one-sided dispatcher, 0.14.0+ (v0.34.0 FM/all2all_utils.py)
    Layout("dp_ep_one_sided", dp=2, ep=True, all2all="flashinfer_nvlink_one_sided",
           first_design=Design.NVFP4_ORACLE))}

WRONG, FAILS = "wrong", "fails"
# wrong for every checkpoint, whatever its scales: vLLM's own CUTLASS NVFP4 MoE under EP adds an
# unzeroed workspace row for each route to another rank's expert (patches/nvfp4_oracle)
WRONG_ROUTES = "wrong_routes"

# Where stock vLLM of each design computes wrongly, in words (the off-switch warning).
WHERE_WRONG = {
    Design.INIT_PREPARE_FINALIZE: "in every parallel layout",
    Design.MODULAR_METHOD: "with data-parallel dispatch",
    Design.NVFP4_ORACLE: "under DP+EP with a dispatcher that quantizes on the sending rank"}


def stock_hole(design_key: str | Design, fmt: str, layout: str | Layout,
               kernel: str = "flashinfer_cutlass", *, deepep_ll_nvfp4_dispatch: bool = False,
               enable_eplb: bool = False, eplb_agrees: bool = False,
               cutlass_reads_workspace: bool = False) -> Optional[str]:
    """Where stock vLLM of a design computes an NVFP4 MoE layer on ``kernel`` wrongly: ``WRONG``
    (when the scales that matter differ), ``WRONG_ROUTES`` (always), ``FAILS`` (cannot run) or
    None. ``layout``: a matrix layout name or a :class:`Layout` (ValueError for one the design
    lacks). ``cutlass_reads_workspace``: the installed vLLM's CUTLASS NVFP4 MoE takes the expert
    map and reads the unzeroed row for non-local routes (findings
    ``cutlass_fp4_takes_expert_map`` and not ``upstream_zeroes_non_local_routes``: 0.32.0-0.34.0);
    it runs EP only over the all-gather dispatch (v0.34.0 FM/experts/cutlass_moe.py:751-762)."""
    d = design(design_key)
    spec = LAYOUTS[layout] if isinstance(layout, str) else layout
    if DESIGNS.index(d) < DESIGNS.index(spec.first_design):
        raise ValueError(f"layout {spec.name} needs the {spec.first_design.label} or later")
    if (d is Design.NVFP4_ORACLE and kernel == "vllm_cutlass" and cutlass_reads_workspace
            and spec.ep and spec.tp * spec.dp > 1 and spec.all2all == DEFAULT_ALL2ALL):
        return WRONG_ROUTES
    if d is Design.NVFP4_ORACLE:
        return WRONG if oracle_design_hole(
            fmt, dp=spec.dp, ep=spec.ep, all2all_backend=spec.all2all, enable_eplb=enable_eplb,
            eplb_agrees=eplb_agrees, deepep_ll_nvfp4_dispatch=deepep_ll_nvfp4_dispatch,
            global_scale_backend=kernel in _KERNELS_WITH_HOLES[d]) else None
    if kernel not in _KERNELS_WITH_HOLES[d]:
        return None
    if d is Design.INIT_PREPARE_FINALIZE:
        return WRONG
    if spec.name == "tp_all2allv":  # MODULAR_METHOD
        return FAILS
    return WRONG if fmt == "compressed-tensors" and spec.dp > 1 else None


# --- where the scales of a checkpoint make a hole real ----------------------------------------

EP_LAYOUTS = ("tp_ep", "dp_ep_allgather", "dp_ep_all2allv")


def ep_layout_problem(num_experts: int, ep_size: int, placement: str) -> Optional[str]:
    """Why vLLM 0.11.0's FlashInfer NVFP4 MoE kernel computes the wrong experts in this EP layout
    whatever the scales (the plugin refuses it: UnsupportedLayoutError), or None."""
    if ep_size <= 1:
        return None
    if placement == "round_robin":
        return ("round_robin expert placement: FlashInfer's NVFP4 MoE kernel assumes each EP "
                "rank owns a contiguous block of experts and computes the wrong experts (use "
                "the default linear placement)")
    if num_experts % ep_size:
        return (f"{num_experts} experts are not divisible by EP size {ep_size}: FlashInfer's "
                "NVFP4 MoE kernel assumes equal contiguous blocks per EP rank and computes the "
                "wrong experts (choose DP x TP dividing the number of experts)")
    return None


def stock_wrong_with_scales(design_key: str | Design, fmt: str, stored: Sequence[float],
                            amax: Sequence[float], ep_size: int, placement: str,
                            layouts: Sequence[str]) -> dict[str, bool]:
    """Per layout, does stock vLLM of a design compute a layer with these scales wrongly?
    ``stored``: the per-expert GEMM1 value pre-oracle designs keep (quantizing with expert 0's or a
    rank's first expert's); ``amax``: what the oracle collapses per rank (max over gate/up)."""
    d = design(design_key)
    uneven = any(v != stored[0] for v in stored)
    differ: dict[str, bool] = {}
    if d is Design.INIT_PREPARE_FINALIZE:  # a rank's first expert's scale vs each expert's own
        differ["tp_ep"] = any(any(stored[e] != stored[s[0]] for e in s)
                              for s in ep_slices(len(stored), ep_size, placement) if s)
    elif d is Design.NVFP4_ORACLE:  # the sender's local max vs the owner's local max
        maxima = rank_local_maxima(amax, ep_size, placement)
        uneven = len({m for m in maxima if m > 0}) > 1
    out = {layout: stock_hole(d, fmt, layout) is not None and differ.get(layout, uneven)
           for layout in layouts}
    if d is Design.INIT_PREPARE_FINALIZE and ep_layout_problem(len(stored), ep_size, placement):
        out.update({layout: True for layout in EP_LAYOUTS if layout in out})
    return out


# --- uncalibrated experts (an activation scale no calibration produced) ------------------------

def stock_wrong_with_uncalibrated(design_key: str | Design, fmt: str, kinds: Sequence[str]) -> bool:
    """Does stock vLLM of a design compute a layer with uncalibrated experts wrongly, in every
    FlashInfer layout (measured: docs/ROOT-CAUSE.md §13)? 0.11.x keeps per-expert scales on every
    path, using each as is; ModelOpt from 0.11.1 (#26135) and every format from 0.14.0 collapse
    both GEMMs to the max over experts, which ignores a low value and is poisoned by a high one."""
    d = design(design_key)
    found = set(kinds)
    collapses = d is Design.NVFP4_ORACLE or (d is Design.MODULAR_METHOD and fmt == "modelopt")
    return "high" in found if collapses else bool(found)


def plugin_repairs_uncalibrated(design_key: str | Design, fmt: str) -> bool:
    """Does the plugin repair uncalibrated experts? Both formats, every design (ROOT-CAUSE §13)."""
    design(design_key)  # ValueError for an unknown design
    return fmt in ("modelopt", "compressed-tensors")


# --- gate and up with their own weight global scales ------------------------------------------
# vLLM keeps one GEMM1 weight global scale per expert, the gate's, and warns when the up half's
# differs by torch.allclose (rtol 1e-5; every release 0.11.0-0.34.0, both formats: v0110
# Q/modelopt.py:1299-1305, v0.34.0 Q/modelopt.py:1090-1098, CT w4a4_nvfp4.py:232-240). The up
# half is then dequantized with the gate's scale: the expert's output is off by their ratio.
GATE_UP_RTOL = 1e-5


def gate_up_split(gate: Sequence[float], up: Sequence[float]) -> dict[int, float]:
    """Per expert whose gate and up weight global scales differ as vLLM tests it, the factor its
    output is off by on stock vLLM (``gate / up`` of the global scales: the up half is read with
    the gate's; ModelOpt's ``weight_scale_2`` is the inverse, pass ``1 / value``)."""
    return {e: g / u for e, (g, u) in enumerate(zip(gate, up))
            if abs(g - u) > GATE_UP_RTOL * abs(u) + 1e-8}


# The kernels whose scales the plugin's carry reaches on the oracle design (its wrapped helpers,
# ``patches/nvfp4_oracle``; Marlin's weight-only one where the probe finds it taking the layer,
# as in 0.32.0 and 0.34.0); B12X and Humming prepare their layers elsewhere.
GATE_UP_CARRIED_KERNELS = ("flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cutedsl",
                           "vllm_cutlass", "marlin")


def plugin_fixes_gate_up_split(design_key: str | Design, fmt: str,
                               kernel: Optional[str] = None) -> bool:
    """Does the plugin compute split gate/up weight global scales right? On every design and
    format: each expert's factor on the up half moves into its GEMM2 scales (``gate_up.py``);
    on the oracle design only for the kernels its wrapped helpers prepare (None: unknown,
    judged for the default FlashInfer CUTLASS)."""
    d = design(design_key)
    return d is not Design.NVFP4_ORACLE or (kernel or "flashinfer_cutlass") in \
        GATE_UP_CARRIED_KERNELS


# --- which NVFP4 MoE kernel a release runs on which Blackwell GPU -------------------------------

FAILS_TO_START = "fails_to_start"  # the kernel vLLM picks has no image for this GPU
# GPUs vLLM's own NVFP4 MoE kernels have images for (the wheels' fatbins): 0.11.0 sm_100a; 0.11.1
# to 0.14.x sm_100a + sm_120a (exactly 10.0 and 12.0); 0.20.0+ sm_100f + sm_120f (all families).
_OWN_KERNEL_GPUS = {Design.INIT_PREPARE_FINALIZE: ((10, 0),),
                    Design.MODULAR_METHOD: ((10, 0), (12, 0))}
# --moe-backend value -> the kernel it runs (v0.34.0 FM/oracle/nvfp4.py:175-194)
_BACKEND_KERNELS = {"flashinfer_trtllm": "flashinfer_trtllm", "cutlass": "vllm_cutlass",
                    "flashinfer_cutlass": "flashinfer_cutlass", "marlin": "marlin",
                    "flashinfer_cutedsl": "flashinfer_cutedsl"}


def nvfp4_moe_kernel(design_key: str | Design, capability: str, fmt: Optional[str], *,
                     flashinfer_env: bool = False, flashinfer_backend: Optional[str] = None,
                     moe_backend: Optional[str] = None) -> tuple[Optional[str], str]:
    """(kernel, why) of an NVFP4 MoE layer on GPU ``capability`` ("10.3"): a kernel name,
    :data:`FAILS_TO_START` or None (not modelled). ``moe_backend``: ``--moe-backend`` (0.20.0+);
    None: ``VLLM_USE_FLASHINFER_MOE_FP4`` / ``VLLM_FLASHINFER_MOE_BACKEND`` decide (unset:
    throughput on 0.11.0, latency later). Read from the wheels (docs/SUPPORT.md, GPU families)."""
    d = design(design_key)
    major, minor = (int(x) for x in capability.split("."))
    sm = f"SM{major}{minor}"
    if major < 10:
        return (("marlin", f"{sm}: Marlin W4A16 (activation scales unused)") if major >= 8
                else (None, f"{sm} cannot run NVFP4 MoE in vLLM"))
    if major not in (10, 12):
        return None, f"{sm}: not a Blackwell GPU vLLM serves NVFP4 MoE on; not modelled"
    if moe_backend not in (None, "auto"):
        return _BACKEND_KERNELS.get(moe_backend), (f"--moe-backend {moe_backend} (vLLM refuses "
                                                   "at load one this GPU cannot run)")
    if moe_backend == "auto":  # TRT-LLM and CuteDSL need the 10.x family
        if major == 10:
            return "flashinfer_trtllm", f"{sm}, --moe-backend auto: FlashInfer TRT-LLM first"
        return "flashinfer_cutlass", (f"{sm}, --moe-backend auto: FlashInfer CUTLASS (TRT-LLM "
                                      "and CuteDSL need the 10.x family)" + (
                                          "; FlashInfer's kernels on 12.1 are not verified"
                                          if minor else ""))
    first = d is Design.INIT_PREPARE_FINALIZE
    fi_gpu = (major, minor) == (10, 0) or not first  # 0.11.0: FlashInfer on exactly 10.0
    if flashinfer_env and fi_gpu:
        latency = (flashinfer_backend or ("throughput" if first else "latency")) == "latency"
        if latency and major == 10 and d is Design.MODULAR_METHOD:  # its default from 0.12.0
            return None, (f"{sm}, VLLM_FLASHINFER_MOE_BACKEND latency: this design's TRT-LLM "
                          "path is not modelled; set it to throughput (FlashInfer CUTLASS)")
        if latency and major == 10 and (fmt == "modelopt" or not first):
            return "flashinfer_trtllm", f"{sm} + VLLM_USE_FLASHINFER_MOE_FP4=1, latency backend"
        return "flashinfer_cutlass", f"{sm} + VLLM_USE_FLASHINFER_MOE_FP4=1"
    gpus = _OWN_KERNEL_GPUS.get(d, _OWN_KERNEL_GPUS[Design.MODULAR_METHOD])
    if (major, minor) in gpus:
        return "vllm_cutlass", f"{sm}: vLLM's own CUTLASS kernel (per-expert scales)"
    return FAILS_TO_START, (f"{sm}: vLLM's own NVFP4 MoE kernel, which it picks here, has no "
                            f"image for this GPU in this release (built for "
                            f"{' and '.join(f'{a}.{b}' for a, b in gpus)}): the first MoE "
                            "forward fails")
