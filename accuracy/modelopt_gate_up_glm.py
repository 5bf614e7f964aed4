# SPDX-License-Identifier: Apache-2.0
"""Does ModelOpt write split gate/up weight global scales? A tiny random Glm4MoeForCausalLM
-> ModelOpt NVFP4 (NVFP4_DEFAULT_CFG) -> export_hf_checkpoint, then gate_proj vs up_proj
weight_scale_2 / input_scale per routed expert.

usage (a virtualenv with nvidia-modelopt 0.45.0 or 0.47.0, torch, transformers, on the CPU):
    python accuracy/modelopt_gate_up_glm.py EXPORT_DIR [--scale-up]
Findings: accuracy/results/modelopt-gate-up-glm.md.
"""

import argparse
import glob
import json
import os

import modelopt
import modelopt.torch.quantization as mtq
import torch
import transformers
from modelopt.torch.export import export_hf_checkpoint
from safetensors import safe_open
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

p = argparse.ArgumentParser()
p.add_argument("export_dir")
p.add_argument(
    "--scale-up",
    action="store_true",
    help="multiply routed expert e's up_proj weight by (1,3,0.5,8)[e%4]",
)
args = p.parse_args()

print(
    "modelopt",
    modelopt.__version__,
    "torch",
    torch.__version__,
    "transformers",
    transformers.__version__,
)
torch.manual_seed(0)

cfg = Glm4MoeConfig(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    n_group=1,
    topk_group=1,
    max_position_embeddings=256,
)
# from_pretrained checkpoints carry this; ModelOpt export's is_multimodal_model() iterates it
cfg.architectures = ["Glm4MoeForCausalLM"]
model = Glm4MoeForCausalLM(cfg).eval().to(torch.float32)
MOE = 1
experts = model.model.layers[MOE].mlp.experts
print("experts module type:", type(experts))
for n, prm in experts.named_parameters(recurse=False):
    print("  experts param:", n, tuple(prm.shape))
print("  experts children:", [n for n, _ in list(experts.named_children())[:3]], "...")

FACT = (1.0, 3.0, 0.5, 8.0)
if args.scale_up:
    with torch.no_grad():
        if hasattr(experts, "gate_up_proj"):
            # fused layout: gate_up_proj [E, 2*I, H] or [E, H, 2*I]; find the 2*I dim
            w = experts.gate_up_proj
            inter = cfg.moe_intermediate_size
            for e in range(w.shape[0]):
                # transformers 5.x Glm4MoeExperts: gate_up_proj is [E, 2*I, H];
                # forward does linear(x, gate_up_proj[e]).chunk(2, dim=-1): up = rows [I:2I]
                assert w.shape[1] == 2 * inter, tuple(w.shape)
                w[e, inter:, :] *= FACT[e % 4]
            print("scaled up half of fused gate_up_proj per expert by", FACT)
        else:
            for e, ex in enumerate(experts):
                ex.up_proj.weight *= FACT[e % 4]
            print("scaled per-expert up_proj.weight by", FACT)

# pre-quant per-expert abs-max of gate and up weights (what split per-tensor amax would be)
with torch.no_grad():
    inter = cfg.moe_intermediate_size
    print(
        "pre-quant |w|max per routed expert: (gate, up, up/gate); split ws2 would be amax/(6*448)"
    )
    for e in range(cfg.n_routed_experts):
        if hasattr(experts, "gate_up_proj"):
            gu = experts.gate_up_proj[e]  # [2I, H] in transformers 5.x Glm4MoeExperts
            assert gu.shape[0] == 2 * inter
            ga, ua = gu[:inter].abs().max().item(), gu[inter:].abs().max().item()
        else:
            ga = experts[e].gate_proj.weight.abs().max().item()
            ua = experts[e].up_proj.weight.abs().max().item()
        print(
            f"  expert {e}: gate {ga:.5g}  up {ua:.5g}  up/gate {ua / ga:.4g}"
            f"  -> gate ws2 {ga / 2688:.5g} up ws2 {ua / 2688:.5g}"
        )

# fixed calibration data
gen = torch.Generator().manual_seed(1234)
calib = [torch.randint(0, cfg.vocab_size, (4, 32), generator=gen) for _ in range(8)]


def forward_loop(m):
    with torch.no_grad():
        for ids in calib:
            m(input_ids=ids)


model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
if hasattr(mtq, "print_quant_summary") and os.environ.get("SUMMARY"):
    mtq.print_quant_summary(model)

os.makedirs(args.export_dir, exist_ok=True)
export_hf_checkpoint(model, export_dir=args.export_dir)
print("exported files:", sorted(os.listdir(args.export_dir)))

# ---- read back ----
tensors = {}
for f in sorted(glob.glob(os.path.join(args.export_dir, "*.safetensors"))):
    with safe_open(f, "pt") as sf:
        for k in sf.keys():
            tensors[k] = sf.get_tensor(k)

pref = f"model.layers.{MOE}.mlp."
print(f"\n== all exported tensors under {pref} (excluding experts >0) ==")
for k in sorted(tensors):
    if k.startswith(pref) and not any(f"experts.{i}." in k for i in range(1, cfg.n_routed_experts)):
        t = tensors[k]
        print(f"  {k:70s} {str(tuple(t.shape)):18s} {t.dtype}")


def val(t):
    return t.float().flatten().tolist()


rows = []
n_ws_diff = n_is_diff = 0
print(
    "\n| expert | gate ws2 | up ws2 | up/gate ws2 | gate input_scale | up input_scale"
    " | up/gate in |"
)
print("|---|---|---|---|---|---|---|")
for e in range(cfg.n_routed_experts):
    g = f"{pref}experts.{e}.gate_proj."
    u = f"{pref}experts.{e}.up_proj."
    if g + "weight_scale_2" not in tensors:
        print(f"expert {e}: no per-expert gate_proj.weight_scale_2 key")
        continue
    gw, uw = tensors[g + "weight_scale_2"].float(), tensors[u + "weight_scale_2"].float()
    gi, ui = tensors.get(g + "input_scale"), tensors.get(u + "input_scale")
    wd = not torch.allclose(gw, uw)
    n_ws_diff += wd
    if gi is not None and ui is not None:
        idf = not torch.allclose(gi.float(), ui.float())
        n_is_diff += idf
        gis, uis = f"{gi.float().item():.6g}", f"{ui.float().item():.6g}"
        ir = f"{(ui.float() / gi.float()).item():.4g}"
    else:
        gis = uis = ir = "n/a"
    print(
        f"| {e} | {gw.item():.6g} | {uw.item():.6g} | {(uw / gw).item():.4g} | {gis} | {uis}"
        f" | {ir} |"
    )
print(f"\nweight_scale_2 pairs differing (not allclose): {n_ws_diff}/{cfg.n_routed_experts}")
print(f"input_scale pairs differing (not allclose): {n_is_diff}/{cfg.n_routed_experts}")

# shared expert + dense layer for reference
for k in [
    f"{pref}shared_experts.gate_proj.weight_scale_2",
    f"{pref}shared_experts.up_proj.weight_scale_2",
    "model.layers.0.mlp.gate_proj.weight_scale_2",
    "model.layers.0.mlp.up_proj.weight_scale_2",
]:
    if k in tensors:
        print(f"{k} = {val(tensors[k])}")

hq = os.path.join(args.export_dir, "hf_quant_config.json")
if os.path.exists(hq):
    print("\nhf_quant_config.json:", open(hq).read())
cj = json.load(open(os.path.join(args.export_dir, "config.json")))
print(
    "config.json quantization_config:",
    json.dumps(cj.get("quantization_config"), indent=None)[:1500],
)
