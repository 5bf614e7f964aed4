# SPDX-License-Identifier: Apache-2.0
"""The scale-only audit: exact numbers from written checkpoints, the affected verdict per layout,
named errors, lazy reads only of scale tensors, and speed on a DeepSeek-R1-sized index."""

import json
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.checkpoint.synthetic import MISSING_WEIGHT_SHARD, SCALE, WEIGHT_GLOBAL, write_scales_only
from vllm_fp4_moe_plugin.tools.checkpoint import tensor_index
from vllm_fp4_moe_plugin.tools.checkpoint.audit import LAYOUTS, audit_checkpoint, ep_slices
from vllm_fp4_moe_plugin.tools.checkpoint.render import format_audit
from vllm_fp4_moe_plugin.tools.checkpoint.tensor_index import CheckpointAuditError
from vllm_fp4_moe_plugin.tools.cli import FORMATS

LAYER = "model.layers.3.mlp.experts"
NUM_EXPERTS = 8
# DeepSeek-R1: layers 3..60 are MoE (first_k_dense_replace=3), 256 routed experts each.
R1_LAYERS = range(3, 61)
R1_EXPERTS = 256
R1_SHARDS = 8
R1_MAX_SECONDS = 10.0
BAD_VALUES = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "negative": -0.5}


def _uniform(fmt, n=NUM_EXPERTS, w13=0.25, w2=16.0):
    # Stored values: CT stores the reciprocal sense.
    if fmt == "compressed-tensors":
        w13, w2 = 1 / w13, 1 / w2
    return [w13] * n, [w2] * n


class _RecordingSafeOpen:
    """Stands in for ``safetensors.safe_open``; records every tensor name read."""

    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, path, framework, device="cpu"):
        recorder = self

        class Handle:
            def __enter__(self):
                self.inner = recorder.real(path, framework=framework, device=device).__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, name):
                recorder.read.append(name)
                return self.inner.get_tensor(name)

            def get_slice(self, name):
                recorder.read.append(name)
                return self.inner.get_slice(name)

        return Handle()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("placement, tp_ep_affected", [("linear", False), ("round_robin", True)])
def test_tp_ep_is_judged_per_rank_slice(tmp_path, fmt, placement, tp_ep_affected):
    """Uniform within each linear EP slice (0-3 | 4-7) but not across: only TP+EP is fine."""
    lo, w2 = _uniform(fmt, NUM_EXPERTS // 2)
    hi, _ = _uniform(fmt, NUM_EXPERTS // 2, w13=0.5)
    write_scales_only(tmp_path, fmt, {LAYER: (lo + hi, w2 + w2)})
    (entry,) = audit_checkpoint(tmp_path, ep_size=2, expert_placement=placement)["layers"]
    assert entry["affected"]["tp_ep"] is tp_ep_affected
    assert all(entry["affected"][lay] for lay in LAYOUTS if lay != "tp_ep")
    assert entry["w13_spread"] == 2.0


@pytest.mark.parametrize("num_experts, ep_size, placement, want", [
    (8, 2, "linear", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (7, 3, "linear", [[0, 1, 2], [3, 4], [5, 6]]),
    (7, 3, "round_robin", [[0, 3, 6], [1, 4], [2, 5]]),
])
def test_ep_slices_follow_vllm_expert_map(num_experts, ep_size, placement, want):
    assert ep_slices(num_experts, ep_size, placement) == want


def test_gate_up_mismatch_is_a_warning(tmp_path):
    w13, w2 = _uniform("modelopt")
    scales = write_scales_only(tmp_path, "modelopt", {LAYER: (w13, w2)}, drop=())
    # Rewrite expert 2's up_proj scale to differ from gate_proj.
    name = f"{LAYER}.2.up_proj.input_scale"
    shard = tmp_path / "model-00001-of-00001.safetensors"
    vals = {n: np.array(v if n != name else 0.375, dtype=np.float32) for n, v in scales.items()}
    save_file(vals, str(shard))
    report = audit_checkpoint(tmp_path)
    (entry,) = report["layers"]
    assert entry["gate_up_mismatch"] == [2]
    assert entry["w13_stored"][2] == 0.375, "vLLM keeps max(gate, up)"
    assert any("expert(s) [2]" in w for w in report["warnings"])


def test_r1_sized_index_audits_fast_and_never_reads_a_weight(tmp_path, monkeypatch):
    """58 MoE layers x 256 experts x 3 projections of scales, in 8 shards; the index also lists
    every weight / block-scale / weight-scale tensor in a shard file that does not exist."""
    fmt = "modelopt"
    layers = {}
    for li in R1_LAYERS:
        w13 = [0.125 * (1 + ((e * 7 + li) % 16) / 16) for e in range(R1_EXPERTS)]
        layers[f"model.layers.{li}.mlp.experts"] = (w13, [16.0 + e for e in range(R1_EXPERTS)])
    write_scales_only(tmp_path, fmt, layers, num_shards=R1_SHARDS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sum(v == MISSING_WEIGHT_SHARD for v in index.values()) == len(index) // 2
    assert not (tmp_path / MISSING_WEIGHT_SHARD).exists()
    recorder = _RecordingSafeOpen(tensor_index.safe_open)
    monkeypatch.setattr(tensor_index, "safe_open", recorder)  # every shard is opened there

    start = time.perf_counter()
    report = audit_checkpoint(tmp_path)
    elapsed = time.perf_counter() - start
    print(f"\nR1-sized audit: {len(recorder.read)} scale tensors in {elapsed:.2f} s")

    assert elapsed < R1_MAX_SECONDS
    assert len(report["layers"]) == len(R1_LAYERS)
    assert len(recorder.read) == len(R1_LAYERS) * R1_EXPERTS * 6
    assert all(n.endswith((".input_scale", ".weight_scale_2")) for n in recorder.read)
    assert all(entry["w13_spread"] == 31 / 16 for entry in report["layers"])
    assert report["affected_layers"] == len(R1_LAYERS)


# --- errors ---------------------------------------------------------------------------------

def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointAuditError, match=r"nope does not exist"):
        audit_checkpoint(tmp_path / "nope")


def test_missing_config_is_named(tmp_path):
    with pytest.raises(CheckpointAuditError, match=r"config\.json: missing config\.json"):
        audit_checkpoint(tmp_path)


@pytest.mark.parametrize("fmt, file", [("compressed-tensors", "config.json"),
                                       ("modelopt", "hf_quant_config.json")])
def test_invalid_json_is_named(tmp_path, fmt, file):
    write_scales_only(tmp_path, fmt, {LAYER: _uniform(fmt)})
    (tmp_path / file).write_text('{"architectures": [,]}')
    with pytest.raises(CheckpointAuditError, match=rf"{file}: invalid JSON .* line 1 column"):
        audit_checkpoint(tmp_path)


def test_unquantized_checkpoint_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(CheckpointAuditError, match="not a quantized checkpoint"):
        audit_checkpoint(tmp_path)


@pytest.mark.parametrize("quant, file, match", [
    ({"quant_method": "fp8"}, "config.json", "quant_method 'fp8' is not an NVFP4 format"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "config.json", "'FP8' is not NVFP4"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                           "strategy": "channel"}}}},
     "config.json", "without an NVFP4 config group"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                           "strategy": "tensor_group"}}}},
     "config.json", "weight-only"),
    ({"quantization": {"quant_algo": "NVFP4"}}, "hf_quant_config.json", "producer.name is None"),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}},
     "hf_quant_config.json", "quant_algo is 'FP8', not 'NVFP4'"),
])
def test_non_nvfp4_checkpoint_is_named(tmp_path, quant, file, match):
    cfg = {"model_type": "deepseek_v3"}
    if file == "config.json":
        cfg["quantization_config"] = quant
    else:
        (tmp_path / file).write_text(json.dumps(quant))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointAuditError, match=match) as info:
        audit_checkpoint(tmp_path)
    assert file in str(info.value)


def test_modelopt_ignore_key_in_config_json_warns(tmp_path):
    write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")})
    (tmp_path / "hf_quant_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}}))
    report = audit_checkpoint(tmp_path)
    assert report["format"] == "modelopt"
    assert any("'ignore' key" in w for w in report["warnings"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("proj", ["gate_proj", "up_proj", "down_proj"])
def test_missing_input_scale_is_an_uncalibrated_expert(tmp_path, fmt, proj):
    """vllm#45212: ModelOpt exports can omit the input_scale of experts no calibration token
    reached. That expert is uncalibrated (a finding: exit 1), named as missing; stock computes
    with whatever its never-loaded parameter holds, so it is affected in every layout."""
    name = f"{LAYER}.5.{proj}.{SCALE[fmt]}"
    write_scales_only(tmp_path, fmt, {LAYER: _uniform(fmt)}, drop=(name,))
    report = audit_checkpoint(tmp_path)
    (entry,) = report["layers"]
    gemm = "w2" if proj == "down_proj" else "w13"
    assert entry[f"uncalibrated_{gemm}"] == [5] and entry[f"missing_{gemm}"] == [5]
    assert entry["stock_wrong_uncalibrated"] and all(entry["affected"].values())
    assert "1 of them missing from the checkpoint" in report["summary"]
    assert "missing from the checkpoint: [5]" in format_audit(report)


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_weight_scale_is_a_bad_checkpoint(tmp_path, fmt):
    """A weight whose global scale is absent cannot be dequantized at all: refused (exit 2)."""
    name = f"{LAYER}.5.up_proj.{WEIGHT_GLOBAL[fmt]}"
    write_scales_only(tmp_path, fmt, {LAYER: _uniform(fmt)}, drop=(name,))
    with pytest.raises(CheckpointAuditError, match=rf"{LAYER}: expert 5 has no weight scale "
                                                   rf"tensor {name}"):
        audit_checkpoint(tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", BAD_VALUES)
def test_bad_input_scale_value_is_an_uncalibrated_expert(tmp_path, fmt, kind):
    """Any activation scale no calibration produced (llmcompressor writes uninitialised memory
    for an expert it never calibrated: NaN, inf, 0 and negative values alike) is a finding,
    not a bad checkpoint: the plugin loads the calibrated experts' max amax for it."""
    w13, w2 = _uniform(fmt)
    w13[6] = BAD_VALUES[kind]
    write_scales_only(tmp_path, fmt, {LAYER: (w13, w2)})
    (entry,) = audit_checkpoint(tmp_path)["layers"]
    assert entry["uncalibrated_w13"] == [6] and entry["uncalibrated_w2"] == []
    assert entry["w13_spread"] == 1.0  # what the plugin loads: the fallback


def test_missing_scale_shard_is_named(tmp_path):
    write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")}, num_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointAuditError, match=r"model-00002-of-00002.safetensors: shard "
                                                   r"file missing"):
        audit_checkpoint(tmp_path)


def test_no_moe_layer_is_named(tmp_path):
    write_scales_only(tmp_path, "modelopt", {"model.layers.0.mlp": _uniform("modelopt")})
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {"lm_head.weight": MISSING_WEIGHT_SHARD}
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointAuditError, match="no routed-expert tensors"):
        audit_checkpoint(tmp_path)


# --- other releases' semantics (support.DESIGNS) ---------------------------------------------

DP_EP = ("dp_ep_allgather", "dp_ep_all2allv")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ep_size, ranks_differ", [(2, True), (4, True), (1, False)])
def test_oracle_design_judges_the_ep_ranks_local_maxima(tmp_path, fmt, ep_size, ranks_differ):
    """0.14.0+: only compressed-tensors under DP+EP, and only when the EP slices' maxima differ.
    Amax per expert 1,2,...,8 (CT stores 1/amax): at EP 2 the ranks' maxima are 4 and 8."""
    amax = [float(e + 1) for e in range(NUM_EXPERTS)]
    w13 = [1 / a for a in amax] if fmt == "compressed-tensors" else amax
    _, w2 = _uniform(fmt)
    write_scales_only(tmp_path, fmt, {LAYER: (w13, w2)})
    report = audit_checkpoint(tmp_path, ep_size=ep_size, design="nvfp4_oracle")
    (entry,) = report["layers"]
    # Reference check: the maxima per rank, from the amax list and vLLM's linear placement.
    want_maxima = [max(amax[r * (NUM_EXPERTS // ep_size):(r + 1) * (NUM_EXPERTS // ep_size)])
                   for r in range(ep_size)]
    # The file stores fp32 (CT: 1/amax), hence the fp32 tolerance.
    assert entry["ep_rank_max_amax"] == pytest.approx(want_maxima, rel=1e-6)
    hole = fmt == "compressed-tensors" and ranks_differ
    assert {lay for lay in LAYOUTS if entry["affected"][lay]} == (set(DP_EP) if hole else set())
    # The NVLink one-sided dispatch quantizes on the sender too (its own column on this design).
    assert entry["affected"]["dp_ep_one_sided"] is hole
    if fmt == "compressed-tensors":
        assert entry["dp_ep_off_by"] == pytest.approx(max(want_maxima) / min(want_maxima), rel=1e-6)
    assert report["affected_layers"] == int(hole)
    assert ("AFFECTED" in report["summary"]) is hole
    assert "0.14.0 - 0.34.0" in format_audit(report)


@pytest.mark.parametrize("fmt", FORMATS)
def test_oracle_design_spread_within_ranks_only_is_not_affected(tmp_path, fmt):
    """Experts differ, but both EP ranks hold the same largest amax: stock 0.14.0+ agrees."""
    amax = [1.0, 4.0, 2.0, 3.0, 4.0, 1.0, 1.0, 2.0]
    w13 = [1 / a for a in amax] if fmt == "compressed-tensors" else amax
    _, w2 = _uniform(fmt)
    write_scales_only(tmp_path, fmt, {LAYER: (w13, w2)})
    (entry,) = audit_checkpoint(tmp_path, ep_size=2, design="nvfp4_oracle")["layers"]
    assert entry["w13_spread"] == 4.0
    assert not any(entry["affected"].values())
    # The same checkpoint on 0.11.0 is wrong in every layout but tp_ep.
    (old,) = audit_checkpoint(tmp_path, ep_size=2, design="init_prepare_finalize")["layers"]
    assert all(old["affected"][lay] for lay in LAYOUTS if lay != "tp_ep")


@pytest.mark.parametrize("fmt, want", [("modelopt", set()),
                                       ("compressed-tensors", {"dp", *DP_EP})])
def test_0_11_1_design_judges_only_compressed_tensors_dp(tmp_path, fmt, want):
    amax = [float(e + 1) for e in range(NUM_EXPERTS)]
    w13 = [1 / a for a in amax] if fmt == "compressed-tensors" else amax
    _, w2 = _uniform(fmt)
    write_scales_only(tmp_path, fmt, {LAYER: (w13, w2)})
    (entry,) = audit_checkpoint(tmp_path, design="modular_method")["layers"]
    assert {lay for lay in LAYOUTS if entry["affected"][lay]} == want


def test_unknown_design_is_refused_before_reading(tmp_path):
    with pytest.raises(ValueError, match="unknown MoE design"):
        audit_checkpoint(tmp_path / "nowhere", design="0.99")


# --- the plugin's own scale rule, and files that cannot be read -------------------------

def _rewrite(root, name, array):
    """Replace one tensor of a single-shard scales-only checkpoint."""
    shard = root / "model-00001-of-00001.safetensors"
    from safetensors.numpy import load_file
    tensors = load_file(str(shard))
    tensors[name] = array
    save_file(tensors, str(shard))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["nan", "zero"])
def test_bad_weight_global_scale_is_a_bad_checkpoint(tmp_path, fmt, kind):
    """The plugin refuses a NaN/zero weight global scale at load; the audit must too."""
    write_scales_only(tmp_path, fmt, {LAYER: _uniform(fmt)})
    name = f"{LAYER}.4.down_proj.{WEIGHT_GLOBAL[fmt]}"
    _rewrite(tmp_path, name, np.array(BAD_VALUES[kind], dtype=np.float32))
    word = "NaN" if kind == "nan" else kind
    with pytest.raises(CheckpointAuditError, match=rf"{name}' is {word}"):
        audit_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_non_float_input_scale_is_a_bad_checkpoint(tmp_path, dtype):
    write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")})
    name = f"{LAYER}.1.up_proj.input_scale"
    _rewrite(tmp_path, name, np.array(1, dtype=dtype))
    with pytest.raises(CheckpointAuditError, match=rf"{name}' has dtype .*float32"):
        audit_checkpoint(tmp_path)


def test_wrong_shape_scale_is_a_bad_checkpoint(tmp_path):
    write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")})
    name = f"{LAYER}.1.gate_proj.input_scale"
    _rewrite(tmp_path, name, np.array([0.25, 0.25], dtype=np.float32))
    with pytest.raises(CheckpointAuditError, match=rf"{name}' has shape \[2\]"):
        audit_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "empty", "directory"])
@pytest.mark.parametrize("sharded", [False, True])
def test_unreadable_safetensors_file_is_named(tmp_path, damage, sharded):
    if sharded:
        write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")}, num_shards=2)
        bad = tmp_path / "model-00002-of-00002.safetensors"
    else:  # no index: the audit lists the file's header itself
        write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")})
        (tmp_path / "model.safetensors.index.json").unlink()
        bad = tmp_path / "model-00001-of-00001.safetensors"
    data = bad.read_bytes()
    bad.unlink()
    if damage == "directory":
        bad.mkdir()
    else:
        bad.write_bytes(data[: len(data) - 16] if damage == "truncated" else b"")
    with pytest.raises(CheckpointAuditError, match=rf"{bad.name}: not a readable safetensors"):
        audit_checkpoint(tmp_path)


@pytest.mark.parametrize("ep_size, placement, why", [
    (3, "linear", "8 experts are not divisible by EP size 3"),
    (2, "round_robin", "round_robin expert placement"),
])
def test_layouts_flashinfer_cannot_compute_are_affected(tmp_path, ep_size, placement, why):
    """Uniform scales, yet FlashInfer computes the wrong experts in the EP layouts."""
    write_scales_only(tmp_path, "modelopt", {LAYER: _uniform("modelopt")})
    report = audit_checkpoint(tmp_path, ep_size=ep_size, expert_placement=placement)
    (entry,) = report["layers"]
    assert why in entry["layout_problem"] and why in report["summary"]
    assert {lay for lay in LAYOUTS if entry["affected"][lay]} == {
        "tp_ep", "dp_ep_allgather", "dp_ep_all2allv"}
    assert report["affected_layers"] == 1 and report["summary"].startswith("AFFECTED")
    linear = audit_checkpoint(tmp_path, ep_size=2, expert_placement="linear")
    assert linear["affected_layers"] == 0 and linear["layers"][0]["layout_problem"] is None


# --- uncalibrated experts and the calibration signature -----------------------------------
# What llmcompressor 0.14 writes for an expert no calibration token reached (routed calibration):
# gate/up input_global_scale 1.57e-29, down_proj 0.0.
DESIGNS = ("init_prepare_finalize", "modular_method", "nvfp4_oracle")


def _routed_ct(n=NUM_EXPERTS):
    """compressed-tensors stored scales with a routed calibration's spread (1.3x, 9x)."""
    w13 = [2688 / a for a in np.geomspace(10.0, 13.0, n)]
    w2 = [2688 / a for a in np.geomspace(3.0, 27.0, n)]
    return w13, w2


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("gemm,value", [("w13", 1.57e-29), ("w13", 0.0), ("w2", 0.0),
                                        ("w2", 1.57e-29)])
def test_uncalibrated_expert_reported_per_design(tmp_path, design, gemm, value):
    w13, w2 = _routed_ct()
    (w13 if gemm == "w13" else w2)[5] = value
    write_scales_only(tmp_path, "compressed-tensors", {LAYER: (w13, w2)})
    report = audit_checkpoint(tmp_path, design=design)
    (entry,) = report["layers"]
    assert entry[f"uncalibrated_{gemm}"] == [5]
    assert entry[f"uncalibrated_{'w2' if gemm == 'w13' else 'w13'}"] == []
    assert entry["uncalibrated_kinds"] == ["high"]  # 1/0 = inf, 2688/1.57e-29 = 1.7e32
    # Reference check: compressed-tensors always stores its per-rank max, every design uses it.
    assert entry["stock_wrong_uncalibrated"] and all(entry["affected"].values())
    assert "uncalibrated activation scale(s)" in report["summary"]
    assert "AFFECTED" in report["summary"]
    # Spreads are of what the plugin loads: the fallback is the calibrated max amax.
    assert entry["w13_spread"] == pytest.approx(1.3, rel=1e-5)
    assert entry["w2_spread"] == pytest.approx(9.0, rel=1e-5)
    text = format_audit(report)
    assert f"uncalibrated {gemm} input scale: expert(s) [5]" in text


@pytest.mark.parametrize("design,wrong", [("init_prepare_finalize", True),
                                          ("modular_method", False), ("nvfp4_oracle", False)])
def test_modelopt_zero_amax_ignored_by_collapsing_designs(tmp_path, design, wrong):
    """A ModelOpt input_scale of 0 (amax 0) is uncalibrated too, a low one; from 0.11.1 ModelOpt
    collapses each GEMM's scales to their max, which skips it (0.11.0 uses it per expert)."""
    w13, w2 = _uniform("modelopt")
    w2[2] = 0.0
    write_scales_only(tmp_path, "modelopt", {LAYER: (w13, w2)})
    (entry,) = audit_checkpoint(tmp_path, design=design)["layers"]
    assert entry["uncalibrated_w2"] == [2] and entry["uncalibrated_kinds"] == ["low"]
    assert entry["stock_wrong_uncalibrated"] is wrong
    assert any(entry["affected"].values()) is wrong


@pytest.mark.parametrize("fmt", FORMATS)
def test_legitimately_rare_expert_is_untouched(tmp_path, fmt):
    """An expert with 20x (or even 10000x) the others' amax is calibrated: not flagged."""
    for factor in (20.0, 1e4):
        amax13 = [10.0] * NUM_EXPERTS
        amax13[3] *= factor
        w13 = [2688 / a for a in amax13] if fmt == "compressed-tensors" else \
            [a / 2688 for a in amax13]
        _, w2 = _uniform(fmt)
        write_scales_only(tmp_path / str(factor), fmt, {LAYER: (w13, w2)})
        (entry,) = audit_checkpoint(tmp_path / str(factor), design="nvfp4_oracle")["layers"]
        assert entry["uncalibrated_w13"] == [] and entry["uncalibrated_w2"] == []
        assert entry["w13_spread"] == pytest.approx(factor, rel=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_calibration_signature(tmp_path, fmt):
    write_scales_only(tmp_path / "all", fmt, {LAYER: _uniform(fmt)})
    report = audit_checkpoint(tmp_path / "all")
    assert report["layers"][0]["calibration"] == "all-experts"
    assert report["calibration"].startswith("calibration: all-experts in all 1")
    w13, w2 = _routed_ct()
    if fmt == "modelopt":
        w13, w2 = [1 / v for v in w13], [1 / v for v in w2]
    write_scales_only(tmp_path / "routed", fmt, {LAYER: (w13, w2)})
    report = audit_checkpoint(tmp_path / "routed")
    assert report["layers"][0]["calibration"] == "routed"
    assert "spread up to 1.3x" in report["calibration"]
    assert report["calibration"] in format_audit(report)


def test_layer_without_any_calibrated_expert_is_a_bad_checkpoint(tmp_path):
    w13, w2 = _routed_ct()
    w2 = [0.0] * NUM_EXPERTS
    write_scales_only(tmp_path, "compressed-tensors", {LAYER: (w13, w2)})
    with pytest.raises(CheckpointAuditError, match=r"no expert has a calibrated GEMM2"):
        audit_checkpoint(tmp_path)


def test_transformers4_config_has_no_misreads(tmp_path):
    write_scales_only(tmp_path, "compressed-tensors", {LAYER: _uniform("compressed-tensors")})
    assert audit_checkpoint(tmp_path)["transformers4_misreads"] == []


# --- what real quantizers wrote (accuracy/models: llmcompressor 0.14 on the trained model) -----
from tests.real_quantizer_checks import DEAD, MODELS  # noqa: E402


@pytest.mark.parametrize("design", DESIGNS)
def test_llmcompressor_all_experts_calibration(design):
    """Default calibration: every gate/up input scale identical, so no design's GEMM1 hole
    shows; down_proj still spread (measured 4-5x)."""
    report = audit_checkpoint(MODELS / "qwen3moe-add-nvfp4-ct-all", design=design)
    assert [e["calibration"] for e in report["layers"]] == ["all-experts"] * 2
    assert all(e["w13_spread"] == 1.0 and e["w2_spread"] > 2 for e in report["layers"])
    assert report["affected_layers"] == 0
    assert all(not e["uncalibrated_w13"] and not e["uncalibrated_w2"] for e in report["layers"])


def test_llmcompressor_routed_calibration_is_spread():
    report = audit_checkpoint(MODELS / "qwen3moe-add-nvfp4-ct-routed")
    assert [e["calibration"] for e in report["layers"]] == ["routed"] * 2
    assert all(1.05 < e["w13_spread"] < 2 for e in report["layers"])
    assert report["affected_layers"] == 2  # 0.11.0: expert 0's scale for every token
    assert "calibration: routed in 2 of 2" in format_audit(report)


@pytest.mark.parametrize("design", DESIGNS)
def test_llmcompressor_dead_experts_are_named(design):
    """Routed calibration on one sequence: llmcompressor wrote uninitialised memory for three
    experts (0.0, -127.6, 2.3e23, 1.2e-38, ...); the audit names exactly those."""
    report = audit_checkpoint(DEAD, design=design)
    layers = {e["layer"]: e for e in report["layers"]}
    l0, l1 = layers["model.layers.0.mlp.experts"], layers["model.layers.1.mlp.experts"]
    assert (l0["uncalibrated_w13"], l0["uncalibrated_w2"]) == ([1, 7], [1, 7])
    assert (l1["uncalibrated_w13"], l1["uncalibrated_w2"]) == ([4], [4])
    assert report["summary"].startswith("AFFECTED: 6 uncalibrated activation scale(s)")


def test_labelled_ep_skew_checkpoint_has_exactly_the_planted_slice_factor(tmp_path):
    """accuracy/skew.py (the accuracy table's labelled edit): only experts 4-7's gate/up input
    global scales change, by the factor, so the newest design's DP+EP factor is that factor and
    every other byte is the quantizer's."""
    from fp4_moe_lab.accuracy import skew
    from fp4_moe_lab.accuracy.experts_only import read_header

    src, out = MODELS / "qwen3moe-add-nvfp4-ct-all", tmp_path / "skew"
    log = skew.skew(src, out, 2.0)
    assert len(log["edits"]) == 2 * 4 * 2  # layers x rank-1 experts x (gate, up)
    assert all(e["new"] == e["old"] / 2 for e in log["edits"])
    a, b = (src / "model.safetensors").read_bytes(), (out / "model.safetensors").read_bytes()
    header, base = read_header(src / "model.safetensors")
    edited = {header[e["tensor"]]["data_offsets"][0] + base for e in log["edits"]}
    assert len(a) == len(b) and {i - i % 4 for i in range(len(a)) if a[i] != b[i]} <= edited
    report = audit_checkpoint(out, design="nvfp4_oracle")
    assert [e["dp_ep_off_by"] for e in report["layers"]] == [pytest.approx(2.0)] * 2
    assert report["affected_layers_by_layout"]["dp_ep_allgather"] == 2
    assert report["affected_layers_by_layout"]["single"] == 0


@pytest.mark.parametrize("src_name,factor", [("qwen3moe-add-nvfp4-ct-all", 1.5),
                                             ("qwen3moe-add-nvfp4-ct-all", 4.0),
                                             ("deepseekv3-add-nvfp4-ct-routed", 4.0)])
def test_labelled_ep_skew_checkpoint_is_regenerated_byte_for_byte(tmp_path, src_name, factor):
    """The table's skew checkpoints are not committed: skew.py must rewrite exactly the bytes the
    published rows were measured on (skew.OUTPUT_SHA256)."""
    from fp4_moe_lab.accuracy import skew

    out = tmp_path / "skew"
    skew.skew(MODELS / src_name, out, factor)
    assert skew.sha256(out / "model.safetensors") == skew.OUTPUT_SHA256[(src_name, factor)]
    assert set(skew.OUTPUT_SHA256) == {("qwen3moe-add-nvfp4-ct-all", 1.5),
                                       ("qwen3moe-add-nvfp4-ct-all", 4.0),
                                       ("deepseekv3-add-nvfp4-ct-routed", 4.0)}


@pytest.mark.parametrize("src_name,case", [("qwen3moe-add-nvfp4-modelopt", "missing"),
                                           ("qwen3moe-add-nvfp4-ct-all", "nan"),
                                           ("qwen3moe-add-nvfp4-ct-all", "inf"),
                                           ("qwen3moe-add-nvfp4-ct-all", "denormal"),
                                           ("qwen3moe-add-nvfp4-ct-all", "zero"),
                                           ("qwen3moe-add-nvfp4-ct-all", "negative")])
def test_labelled_dead_scale_checkpoint_is_audited_as_uncalibrated(tmp_path, src_name, case):
    """accuracy/dead_scale.py (the accuracy table's dead-scale rows, one per reported value
    class: vllm#45212 missing, llm-compressor#2826 NaN, compressed-tensors#595 +inf,
    vllm#42601 denormal, 0, negative): regenerated byte for byte, and audit names expert 5 of
    every MoE layer as uncalibrated (missing ones as missing), a finding (exit 1), not a bad
    checkpoint."""
    from fp4_moe_lab.accuracy import dead_scale

    out = tmp_path / "dead"
    log = dead_scale.dead(MODELS / src_name, out, case)
    assert len(log["edits"]) == 2 * 3  # layers x (gate, up, down)
    assert dead_scale.sha256(out / "model.safetensors") == \
        dead_scale.OUTPUT_SHA256[(src_name, case)]
    report = audit_checkpoint(out, design="nvfp4_oracle")
    for entry in report["layers"]:
        assert entry["uncalibrated_w13"] == [5] and entry["uncalibrated_w2"] == [5], entry
        missing = [5] if case == "missing" else []
        assert entry["missing_w13"] == missing and entry["missing_w2"] == missing


# --- gate and up with their own weight global scales (published GLM exports: up to 10x) ------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ratio", [1.1, 4.0, 10.0])
def test_split_gate_up_weight_scales_affect_every_layout(tmp_path, fmt, ratio):
    """vLLM keeps the gate's weight global scale for both halves: each such expert's output is
    off by the ratio, in every layout; the audit names the experts and the worst ratio."""
    write_scales_only(tmp_path, fmt, {LAYER: _uniform(fmt)})
    for e, r in ((2, ratio), (5, ratio ** 0.5)):
        gs = 2.0 ** -10 / r if fmt == "compressed-tensors" else 2.0 ** -10 * r
        _rewrite(tmp_path, f"{LAYER}.{e}.up_proj.{WEIGHT_GLOBAL[fmt]}",
                 np.array(gs, dtype=np.float32))
    report = audit_checkpoint(tmp_path)
    (layer,) = report["layers"]
    assert layer["weight_gate_up_split"] == [2, 5]
    assert layer["weight_gate_up_worst"] == pytest.approx(ratio, rel=1e-5)
    assert all(layer["affected"].values()) and report["affected_layers"] == 1
    assert report["summary"].startswith("AFFECTED: gate and up weight global scales differ")
    assert f"{ratio:.4g}x" in report["summary"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_equal_gate_up_weight_scales_are_not_reported(tmp_path, fmt):
    write_scales_only(tmp_path, fmt, {LAYER: _uniform(fmt)})
    (layer,) = audit_checkpoint(tmp_path)["layers"]
    assert layer["weight_gate_up_split"] == [] and layer["weight_gate_up_worst"] == 1.0


def test_labelled_gate_up_split_keeps_the_model_and_audit_names_it(tmp_path):
    """accuracy/gate_up_split.py: per split expert, up's weight global scale x f, down's / f and
    down's activation scale x f (the same model); only those scalars change, and the audit finds
    the split with its worst ratio (8x) in both layers, affected in every layout."""
    from fp4_moe_lab.accuracy import gate_up_split
    from fp4_moe_lab.accuracy.experts_only import read_header

    src, out = MODELS / "qwen3moe-add-nvfp4-modelopt", tmp_path / "split"
    log = gate_up_split.split(src, out)
    split = [e for e in range(8) if gate_up_split.factor(e) != 1.0]
    assert len(log["edits"]) == 2 * len(split) * 3  # layers x split experts x 3 scalars
    a, b = (src / "model.safetensors").read_bytes(), (out / "model.safetensors").read_bytes()
    header, base = read_header(src / "model.safetensors")
    edited = {header[e["tensor"]]["data_offsets"][0] + base for e in log["edits"]}
    assert len(a) == len(b) and {i - i % 4 for i in range(len(a)) if a[i] != b[i]} <= edited
    for e in log["edits"]:  # the model is unchanged: up x f pairs with down / f
        f = gate_up_split.factor(int(e["tensor"].split(".")[5]))
        want = e["old"] * (f if e["tensor"].endswith(("up_proj.weight_scale_2",
                                                      "down_proj.input_scale")) else 1 / f)
        assert e["new"] == pytest.approx(want, rel=1e-7), e
    report = audit_checkpoint(out, design="nvfp4_oracle")
    assert report["summary"].startswith("AFFECTED: gate and up weight global scales differ for "
                                        f"{2 * len(split)} expert(s) in 2 layer(s), up to 8x")


@pytest.mark.parametrize("src_name", ["qwen3moe-add-nvfp4-modelopt",
                                      "qwen3moe-add-nvfp4-ct-all-ep-skew4"])
def test_labelled_gate_up_split_is_regenerated_byte_for_byte(tmp_path, src_name):
    """Not committed either: gate_up_split.py must rewrite the bytes the table and CI's slice
    were measured on (its source for the second is the skew edit, regenerated first)."""
    from fp4_moe_lab.accuracy import gate_up_split, skew

    src = MODELS / src_name
    if src_name.endswith("-ep-skew4"):
        src = tmp_path / src_name
        skew.skew(MODELS / "qwen3moe-add-nvfp4-ct-all", src, 4.0)
    out = tmp_path / "split"
    gate_up_split.split(src, out)
    assert gate_up_split.sha256(out / "model.safetensors") == gate_up_split.OUTPUT_SHA256[src_name]
