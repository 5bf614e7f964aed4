# SPDX-License-Identifier: Apache-2.0
"""Which NVFP4 format a checkpoint is, read from its JSON as vLLM 0.11.0 reads it: the audit
judges scales by format, and a checkpoint vLLM would not load as NVFP4 is refused here."""

from __future__ import annotations

from pathlib import Path

from .tensor_index import CheckpointAuditError, read_json

FORMATS = ("modelopt", "compressed-tensors")


def _is_nvfp4_args(args) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 4 and args.get("type") == "float"
            and args.get("strategy") == "tensor_group" and args.get("group_size") == 16)


def _compressed_tensors_format(qc: dict, where: str) -> str:
    """compressed-tensors: W4A4 NVFP4 needs both weights and input activations in NVFP4
    (vllm/.../compressed_tensors/compressed_tensors.py:270-289)."""
    groups = qc.get("config_groups") or {}
    w4 = [g for g, s in groups.items() if isinstance(s, dict) and _is_nvfp4_args(s.get("weights"))]
    if not w4:
        raise CheckpointAuditError(
            f"{where}: compressed-tensors checkpoint without an NVFP4 config group (weights "
            "num_bits=4, type=float, strategy=tensor_group, group_size=16); this audit only "
            "applies to NVFP4 checkpoints")
    if not any(_is_nvfp4_args(groups[g].get("input_activations")) for g in w4):
        raise CheckpointAuditError(
            f"{where}: NVFP4 weights but no NVFP4 input_activations (NVFP4A16, weight-only): the "
            "checkpoint has no activation scales, so the GEMM1 activation-scale bug cannot apply")
    return "compressed-tensors"


def detect_format(root: Path, config: dict) -> tuple[str, str, list[str]]:
    """``(format, where the quant config came from, warnings)`` in vLLM 0.11.0's order:
    config.json ``quantization_config`` wins over ``hf_quant_config.json``
    (transformers_utils/config.py:599-611; method detection config/model.py:857-876)."""
    warnings: list[str] = []
    qc = config.get("quantization_config")
    if qc is not None:
        where = f"{root / 'config.json'} quantization_config"
        if not isinstance(qc, dict):
            raise CheckpointAuditError(f"{where} must be a JSON object")
        method = str(qc.get("quant_method", "")).lower()
        if method == "compressed-tensors":
            return _compressed_tensors_format(qc, where), where, warnings
        if method == "modelopt":
            algo = str(qc.get("quant_algo", ""))
            if "FP4" not in algo.upper():
                raise CheckpointAuditError(f"{where}: ModelOpt quant_algo {algo!r} is not NVFP4")
            if "ignore" in qc and "exclude_modules" not in qc:
                warnings.append(
                    f"{where} uses ModelOpt >= 0.31's 'ignore' key, which vLLM 0.11.0 does not "
                    "read (it sees exclude_modules=[] and quantizes attention/lm_head too); "
                    "use hf_quant_config.json or add 'exclude_modules'")
            return "modelopt", where, warnings
        raise CheckpointAuditError(
            f"{where}: quant_method {qc.get('quant_method')!r} is not an NVFP4 format this audit "
            f"knows ({FORMATS[0]!r} or {FORMATS[1]!r})")
    hf = root / "hf_quant_config.json"
    if not hf.exists():
        raise CheckpointAuditError(
            f"{root}: not a quantized checkpoint (config.json has no quantization_config and "
            "there is no hf_quant_config.json)")
    hq = read_json(hf, what="ModelOpt hf_quant_config.json")
    producer = (hq.get("producer") or {}).get("name") if isinstance(hq.get("producer"), dict) \
        else None
    quant_algo = (hq.get("quantization") or {}).get("quant_algo") \
        if isinstance(hq.get("quantization"), dict) else None
    if producer != "modelopt":
        raise CheckpointAuditError(
            f"{hf}: producer.name is {producer!r}, not 'modelopt'; vLLM 0.11.0 then treats the "
            "checkpoint as unquantized (config/model.py:857-876); add "
            "\"producer\": {\"name\": \"modelopt\", ...}")
    if quant_algo != "NVFP4":
        raise CheckpointAuditError(f"{hf}: quantization.quant_algo is {quant_algo!r}, not 'NVFP4'")
    return "modelopt", str(hf), warnings
