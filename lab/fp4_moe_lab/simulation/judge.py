# SPDX-License-Identifier: Apache-2.0
"""How a matrix row is judged: errors against the layout's references, the bound, the ``ok`` rule.

One rule for every backend's rows (CUTLASS and TRT-LLM, every design). ``noise_floor`` is the
ideal NVFP4 reference against fp32: the error NVFP4 itself costs. A correct layer sits at about
0 from the ideal reference and at about the noise floor from fp32. A row is a *hole* when stock
is at least ``AFFECTED_FACTOR`` x the bound away from the ideal; on every other row the plugin
must be bit-identical to stock (it is inert there), except where the caller accepts a stock
answer as accurate against fp32 as NVFP4 itself (``equally_accurate_ok``: a planted expert the
plugin repairs while stock computes another valid answer, e.g. a negative input scale whose
sign cancels on the per-expert designs), or where the support model predicts a hole whatever
the scales and stock is outside the bound (``modelled_hole``: vLLM's CUTLASS under EP adds
GEMM1's output for non-local routes when the fixture's GEMM1 output is wider than its hidden
size, 1.8-2x the bound).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from fp4_moe_lab.simulation.gpus import DEFAULT_CAPABILITY
from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.support import Design

# Plugin vs the ideal NVFP4 reference. Both quantize identically; what is left is bf16
# rounding of the layer output (2^-8 relative) and, with TP/DP, a bf16 all-reduce/reduce-scatter.
PLUGIN_BOUND = 1e-2
# The plugin's fp32 error may exceed the noise floor by this factor.
FP32_FACTOR = 1.1
# Stock counts as "affected" when it is this many times further from ideal than the bound.
AFFECTED_FACTOR = 10.0
# Split gate/up weight scales, carried in GEMM2's scales (gate_up.py): GEMM2's input is then
# quantized at another global scale (a2 x r), another NVFP4 realization of the same layer. What
# makes it right is its error against fp32 (at most FP32_FACTOR x the floor, as for every row);
# against the ideal realization it may differ by NVFP4's own noise: up to this fraction of the
# floor. Measured 0.002-0.0785 of a 0.15-0.17 floor (the sweep, 0.11.0-0.21.0): the most
# where vLLM shares one GEMM2 scale over the experts, then max(a2 x r) instead of max(a2).
CARRY_BOUND = 1.0
MODES = ("stock", "plugin")
# How a rank records that vLLM's backend selection refused to build the layer (layouts.refusal).
REFUSED = "vLLM refuses at load: "


@dataclass
class Row:
    format: str
    layout: str
    backend: str
    stock_rel_err: float
    plugin_rel_err: float
    bound: float
    noise_floor: float
    plugin_fp32_err: float
    stock_fp32_err: float
    stock_affected: bool
    bit_identical: bool  # plugin output == stock output, bit for bit, on every rank
    reference_scheme: str  # one of matrix.SCHEMES, or the TRT-LLM rows' own
    vllm_version: str
    design: Optional[Design]
    stock_error: Optional[str]  # set when stock's forward raised (the layer cannot run)
    plugin_error: Optional[str]
    ok: bool
    plugin_prepare_finalize: str
    plugin_a1_gscale_shape: Optional[list]
    plugin_check: list  # the load-time check's verdict per rank
    vllm_refuses: bool = False  # vLLM's backend selection refuses the layout, stock and plugin
    capability: str = DEFAULT_CAPABILITY  # the GPU the seam reported to vLLM (gpus.CAPABILITIES)
    case: Optional[str] = None  # what the fixture plants, where not the matrix's default layer

    def as_dict(self) -> dict:
        """The row as JSON holds it; ``case`` only where a fixture was planted (the published
        matrices predate it)."""
        d = asdict(self)
        if d["case"] is None:
            del d["case"]
        return d


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius), in fp64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _nan_as_inf(err: float) -> float:
    return float("inf") if err != err else err


def judge(fmt: str, layout: str, backend: str, ranks, references: Callable, *, scheme: str,
          release: tuple, check: Optional[Callable] = None,
          equally_accurate_ok: bool = False, modelled_hole: bool = False,
          carried: bool = False, capability: str = DEFAULT_CAPABILITY) -> Row:
    """One row from every rank's stock and plugin outputs (``ranks``: ``layouts.RankOutput``)
    for ``fmt``. ``references(rank)`` gives that rank's (ideal, fp32) references; ``release``:
    ``(vLLM version, design)``; ``check(rank)``: the plugin's load-time verdict there;
    ``capability``: the simulated GPU the ranks ran on, recorded in the row; ``carried``: the
    plugin computes another NVFP4 realization (:data:`CARRY_BOUND`), ok where it is at the
    floor and closer to the ideal one than stock."""
    errs = {m: [] for m in MODES}
    fp32_errs = {m: [] for m in MODES}
    failures: dict[str, Optional[str]] = dict.fromkeys(MODES)
    noise = []
    for r in ranks:
        ideal, fp32 = references(r)
        noise.append(rel_err(ideal, fp32))
        for mode in MODES:
            out = r.outputs.get(f"{fmt}/{mode}")
            if out is None:  # forward raised: the layer cannot run in this layout
                errs[mode].append(float("inf"))
                fp32_errs[mode].append(float("inf"))
                failures[mode] = failures[mode] or r.errors[f"{fmt}/{mode}"]
                continue
            # A NaN output is as far from the reference as can be (NaN compares False below).
            errs[mode].append(_nan_as_inf(rel_err(out, ideal)))
            fp32_errs[mode].append(_nan_as_inf(rel_err(out, fp32)))
    stock, plugin, floor = max(errs["stock"]), max(errs["plugin"]), max(noise)
    plugin_fp32 = max(fp32_errs["plugin"])
    affected = stock >= AFFECTED_FACTOR * PLUGIN_BOUND
    identical = not any(failures.values()) and all(
        torch.equal(r.outputs[f"{fmt}/stock"], r.outputs[f"{fmt}/plugin"]) for r in ranks)
    bound = CARRY_BOUND * floor if carried else PLUGIN_BOUND
    correct = plugin <= bound and plugin_fp32 <= FP32_FACTOR * floor
    info = ranks[0].info[f"{fmt}/plugin"]
    version, design = release
    # vLLM refuses this backend in this layout, with the plugin exactly as without it
    refuses = bool(failures["stock"]) and failures["stock"] == failures["plugin"] and \
        failures["stock"].startswith(REFUSED)
    return Row(
        format=fmt, layout=layout, backend=backend,
        stock_rel_err=stock, plugin_rel_err=plugin, bound=bound, noise_floor=floor,
        plugin_fp32_err=plugin_fp32, stock_fp32_err=max(fp32_errs["stock"]),
        stock_affected=affected and not refuses, bit_identical=identical,
        reference_scheme=scheme,
        vllm_version=version, design=design,
        stock_error=failures["stock"], plugin_error=failures["plugin"],
        ok=refuses or correct and (
            affected or identical or (modelled_hole and stock > PLUGIN_BOUND)
            or (carried and stock > plugin) or (
                equally_accurate_ok and max(fp32_errs["stock"]) <= FP32_FACTOR * floor)),
        plugin_prepare_finalize=info["prepare_finalize"],
        plugin_a1_gscale_shape=info["a1_gscale_shape"],
        plugin_check=[check(r) if check else None for r in ranks], vllm_refuses=refuses,
        capability=capability)


def carried_split(gate_up_split: float, design: Optional[Design], fmt: str, kernel: str) -> bool:
    """A fixture with split gate/up weight scales on a kernel the plugin's carry reaches: its
    rows are judged as another NVFP4 realization (``carried``)."""
    return gate_up_split > 1 and design is not None and \
        support.plugin_fixes_gate_up_split(design, fmt, kernel)


def installed_release() -> tuple[str, Optional[Design]]:
    """(vLLM version, MoE design the plugin's probe sees) of the installed vLLM."""
    import vllm

    from vllm_fp4_moe_plugin.patches import compat

    return vllm.__version__, compat.probe().design
