# SPDX-License-Identifier: Apache-2.0
"""Every replaced symbol has a complete ledger entry in its folder, whose builder is there and
whose predicate reads only findings the probe reports, and docs/PATCHES.md says the same as the
code."""

import ast
import importlib.util
import itertools
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from fp4_moe_lab.ledger_doc import WIDTH, render
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches import compat, ledger
from vllm_fp4_moe_plugin.patches.registry import ONE_MODULE, PATCH_MODULES, SLICES

DOC = Path(__file__).resolve().parents[2] / "docs" / "PATCHES.md"
# Sample values per kind of finding: the class name the CT entries compare with, the helper
# tuples the oracle entries look in, booleans for the rest; a one-module patch's findings
# declare their own (patching.Finding.samples).
SAMPLES = {
    "compressed_tensors_class": (None, "CompressedTensorsW4A4MoeMethod",
                                 "CompressedTensorsW4A4Nvfp4MoEMethod"),
    "oracle_helpers": ((), ("prepare_nvfp4_moe_layer_for_fi_or_cutlass",),
                       ("prepare_nvfp4_moe_layer_for_fi_or_cutlass",
                        "prepare_nvfp4_moe_layer_for_flashinfer_cutedsl")),
    **{name: f.samples for p in ONE_MODULE for name, f in p.findings.items()},
}


class StrictFindings(Mapping):
    """The findings a design's probe reports, and nothing else: reading another key fails."""

    def __init__(self, design, values):
        self._design, self._values = design, values

    def __getitem__(self, key):
        if key not in self._values:
            raise AssertionError(f"predicate reads {key!r}, which the {self._design} probe "
                                 "does not report (compat.FINDINGS)")
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)


def _all_findings(design):
    keys = compat.FINDINGS[design]
    for combo in itertools.product(*(SAMPLES.get(k, (False, True)) for k in keys)):
        yield StrictFindings(design, dict(zip(keys, combo)))


ENTRIES = [(s.design, p) for s in SLICES for p in s.patches]


def _id(entry):
    return f"{entry[1].target}@{entry[0]}"


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_entry_is_complete(entry):
    design, patch = entry
    for field in ("why", "how", "upstream", "remove_when"):
        assert len(getattr(patch, field).strip()) > 20, (patch.target, field)
    assert design is None or isinstance(design, Design)  # None: every design
    assert patch.needed.__doc__ and len(patch.needed.__doc__.strip()) > 20, patch.target
    how = textwrap.wrap(f"- **How:** {' '.join(patch.how.split())}", WIDTH)
    assert len(how) <= 3, f"{patch.target}: 'how' takes {len(how)} lines in docs/PATCHES.md"


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_builder_is_a_function_of_the_entrys_own_folder(entry):
    """Read from the source (builders import vLLM): ``module:function`` is defined, in the
    folder whose slice holds the entry, or in the one-module patch that declares it (a patch
    lives in one place)."""
    _, patch = entry
    module, _, name = patch.build.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, patch.build
    tree = ast.parse(Path(spec.origin).read_text())
    assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, patch.build
    if module in PATCH_MODULES:  # a one-module patch: its builder is beside its record
        assert patch in importlib.import_module(module).PATCH.entries, patch.build
        return
    part = next(s for s in SLICES if patch in s.patches)
    folder = module.split(".")[2]  # vllm_fp4_moe_plugin.patches.<folder>[.module]
    own = importlib.import_module(f"vllm_fp4_moe_plugin.patches.{folder}").SLICE
    assert own.design == part.design and patch in own.patches, patch.build


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_predicate_reads_only_reported_findings(entry):
    design, patch = entry
    verdicts = {bool(patch.needed(f)) for f in _all_findings(design)}
    # A predicate that can never be true (or never false) decides nothing.
    assert verdicts == {False, True}, patch.target


def test_every_design_has_a_slice_and_each_target_is_unique_within_it():
    assert {s.design for s in SLICES} == set(Design) | {None}
    for design in [*Design, None]:
        targets = [p.target for p in ledger.entries_for_design(design)]
        assert len(targets) == len(set(targets)), design


def test_plan_follows_the_predicates_not_the_design_alone():
    base = dict.fromkeys(compat.FINDINGS[Design.MODULAR_METHOD], False)
    seen = compat.Observation(Design.MODULAR_METHOD, True, "seen", {
        **base, "compressed_tensors_class": "CompressedTensorsW4A4Nvfp4MoEMethod"})
    plan = ledger.plan(seen)
    assert plan.install and [t.rsplit(".", 1)[1] for t in plan.patches] == [
        "CompressedTensorsW4A4Nvfp4MoEMethod"]
    fixed = compat.Observation(Design.MODULAR_METHOD, True, "seen", {
        **base, "compressed_tensors_class": "CompressedTensorsW4A4Nvfp4MoEMethod",
        "compressed_tensors_dp_scale_shared": True})
    plan = ledger.plan(fixed)
    assert not plan.install and not plan.patches and "no hole left" in plan.reason
    unpatchable = compat.Observation(Design.NVFP4_ORACLE, False, "helpers changed", {})
    assert ledger.plan(unpatchable).reason == "helpers changed"


def test_doc_matches_code():
    assert DOC.read_text() == render() + "\n", (
        "docs/PATCHES.md is stale: run `python -m fp4_moe_lab.ledger_doc > docs/PATCHES.md`")




def _oracle_plan(**fixed):
    """The plan on a 0.34.0-like oracle observation with the given findings true."""
    findings = dict.fromkeys(compat.FINDINGS[Design.NVFP4_ORACLE], False)
    findings.update({"oracle_helpers": ("prepare_nvfp4_moe_layer_for_fi_or_cutlass",),
                     "cutlass_fp4_takes_expert_map": True, **fixed})
    return ledger.plan(compat.Observation(Design.NVFP4_ORACLE, True, "seen", findings))


def test_oracle_plan_keeps_each_hole_until_upstream_fixes_it():
    from vllm_fp4_moe_plugin.patches import nvfp4_oracle as o

    routes = "vllm.model_executor.layers.fused_moe.experts.cutlass_moe.run_cutlass_moe_fp4"
    scales = "vllm.model_executor.layers.fused_moe.oracle.nvfp4." + \
        "prepare_nvfp4_moe_layer_for_fi_or_cutlass"
    stock = _oracle_plan()
    assert stock.install and set(stock.patches) == {routes, scales}
    assert stock.reason.endswith(f"{o.ACTIVE}; {o.ROUTES}; {o.CARRY}")
    carried = {"upstream_carries_gate_up": True}
    assert _oracle_plan(**carried).reason.endswith(f"{o.ACTIVE}; {o.ROUTES}")
    both_scales = _oracle_plan(upstream_agrees_gemm1_scale=True,
                               upstream_repairs_uncalibrated=True, **carried)
    assert both_scales.patches == (routes,)
    assert both_scales.reason.endswith(f"{o.SCALES_FIXED}; {o.ROUTES}")
    # the gate/up duty alone keeps the scale wrapper
    gate_up_left = _oracle_plan(upstream_agrees_gemm1_scale=True,
                                upstream_repairs_uncalibrated=True,
                                upstream_zeroes_non_local_routes=True)
    assert gate_up_left.patches == (scales,) and gate_up_left.reason.endswith(o.CARRY)
    no_routes = _oracle_plan(upstream_zeroes_non_local_routes=True, **carried)
    assert no_routes.patches == (scales,) and no_routes.reason.endswith(o.ACTIVE)
    before_0_32 = _oracle_plan(cutlass_fp4_takes_expert_map=False, **carried)
    assert before_0_32.patches == (scales,) and before_0_32.reason.endswith(o.ACTIVE)
    fixed = _oracle_plan(upstream_agrees_gemm1_scale=True, upstream_repairs_uncalibrated=True,
                         upstream_zeroes_non_local_routes=True, **carried)
    assert not fixed.install and fixed.upstream_fixed and fixed.reason.endswith(o.FIXED)


def test_one_module_patches_are_found_by_their_assignment_alone(tmp_path):
    """The registry finds a patch module by its top-level ``PATCH =`` (read as text: nothing
    else is imported), and each one's entries and findings are in every slice it names."""
    for module, patch in zip(PATCH_MODULES, ONE_MODULE):
        assert importlib.import_module(module).PATCH is patch
        for part in SLICES:
            mine = part.design in patch.designs
            assert all((e in part.patches) == mine for e in patch.entries), (module, part.design)
            assert all((f in part.findings) == mine for f in patch.findings), (module, part.design)
            assert (patch in part.extras) == mine
    assert ONE_MODULE, "no one-module patch: the mechanism is untested"
