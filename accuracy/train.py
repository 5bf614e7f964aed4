# SPDX-License-Identifier: Apache-2.0
"""Train the tiny MoE models (Qwen3-MoE; DeepSeek-V3) that the NVFP4 accuracy checks quantize


Why a model of our own: a real, trained MoE whose experts all matter, small enough to commit
(~13 MB in bf16) and to run on a CPU, with an exact-match task (accuracy/task.py) on which a
wrong activation scale shows as wrong digits. Fixed seeds; the router's load-balancing loss at
a coefficient strong enough that every expert keeps getting tokens (at a weak one an expert
nearly died, and an expert nobody routes to gets no NVFP4 calibration).

--arch deepseek_v3 trains the mission's architecture instead (MLA with q/kv LoRA, one dense
layer then MoE layers with a shared expert, sigmoid scores, grouped top-k with
e_score_correction_bias): the sizes of the project's random DeepSeek-V3 test checkpoint
(lab/fp4_moe_lab/checkpoint/configs.py, which both CPU engines run), vocab from task.py.
transformers' DeepSeek-V3 has no load-balancing loss; balancing is DeepSeek-V3's own
auxiliary-loss-free rule (arXiv:2412.19437 section 2.1.2): after each step every expert's
correction bias moves by BIAS_RATE towards the mean load, so the bias vLLM reads is a trained
one, not zeros.

Writes OUT_DIR/ (default accuracy/models/qwen3moe-add-bf16, deepseekv3-add-bf16):
  model.safetensors      bf16, one tensor per expert projection (mlp.experts.E.gate_proj.weight,
                         ...), the layout vLLM 0.11.0, transformers 4.57 and transformers 5's
                         loading conversion all read (written by us, not by save_pretrained)
  config.json            readable by transformers 4.57 AND 5 (both spellings of the renamed
                         keys: num_experts/num_local_experts, rope_theta/rope_parameters) and
                         with every key vLLM 0.11.0's Qwen3-MoE model reads, explicitly
  config.transformers5-as-written.json   what transformers 5's save_pretrained wrote by itself
                         (evidence for the sibling config issue; NOT loaded by anything)
  generation_config.json, tokenizer files, train-log.json (losses, per-expert token counts)
Usage (the H200 run of accuracy/README.md): python train.py --tokenizer-dir tokenizer \
    --test-jsonl addition-test.jsonl --out-dir OUT [--steps N]
Mirrors transformers' Qwen3MoeForCausalLM training interface (labels + output_router_logits);
the training loop itself is ours.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

import task  # the sibling accuracy/task.py: this file runs as a script
import torch

HIDDEN, MOE_INTER, LAYERS, EXPERTS, TOP_K = 256, 512, 2, 8, 2
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
ROPE_THETA = 10000.0
MAX_POS = 128
AUX_COEF = 0.05            # Switch-style load balancing; 0.001 (HF default) is too weak here
SEED = 1234
BIAS_RATE = 1e-3           # DeepSeek-V3's bias update speed (gamma), per step

# --arch deepseek_v3: the random test checkpoint's sizes (checkpoint/configs.py DEEPSEEK_V3);
# kv_lora_rank + qk_rope_head_dim = 576 is what every vLLM MLA backend takes.
DS = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
      "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
      "q_lora_rank": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
      "v_head_dim": 64, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
      "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
DEFAULT_OUT = {"qwen3_moe": "qwen3moe-add-bf16", "deepseek_v3": "deepseekv3-add-bf16"}


def shared_config() -> dict:
    """The config keys both architectures write alike (tokens, rope, norms, dtype)."""
    v = task.vocab()
    return {
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POS,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_theta": ROPE_THETA,                 # transformers 4 / vLLM 0.11.0
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},  # transformers 5
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": v[task.BOS],
        "eos_token_id": v[task.EOS],
        "pad_token_id": v[task.PAD],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def deepseek_config_dict() -> dict:
    """--arch deepseek_v3's config.json: every key vLLM 0.11.0 / 0.32.0's DeepseekV2 model and
    both transformers majors read, explicitly (their defaults are the 671B model's)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": task.VOCAB_SIZE,
        **DS,
        "num_key_value_heads": DS["num_attention_heads"],
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "ep_size": 1,
        "rope_interleave": True,      # the checkpoint's rope dims interleaved, as DeepSeek's
        "num_nextn_predict_layers": 0,
        **shared_config(),
    }


def config_dict(arch: str = "qwen3_moe") -> dict:
    """The model's config.json, written by hand so that both transformers majors and vLLM
    0.11.0 read the same model (see the module docstring)."""
    if arch == "deepseek_v3":
        return deepseek_config_dict()
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": task.VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": MOE_INTER,   # dense-MLP width; unused (no mlp_only_layers)
        "moe_intermediate_size": MOE_INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": EXPERTS,                   # transformers 4 / vLLM 0.11.0
        "num_local_experts": EXPERTS,             # transformers 5's spelling
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": AUX_COEF,
        **shared_config(),
    }


def build_model(device, balance: str = "hf", arch: str = "qwen3_moe"):
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        cfg = dict(config_dict(arch))
        for k in ("architectures", "model_type", "torch_dtype", "dtype", "rope_theta",
                  "rope_scaling"):
            cfg.pop(k)
        torch.manual_seed(SEED)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
        return model.to(device=device, dtype=torch.float32)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = dict(config_dict())
    for k in ("architectures", "model_type", "torch_dtype", "dtype", "num_local_experts",
              "rope_theta", "rope_scaling", "max_window_layers"):
        cfg.pop(k)
    # "hf": transformers' own aux loss (made the committed model); "per-layer": ours, below
    cfg["output_router_logits"] = balance == "hf"
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    return model.to(device=device, dtype=torch.float32)


def make_batch(pairs, device):
    """Right-padded <bos> prompt answer <eos>; loss only on the answer and <eos>."""
    v = task.vocab()
    seqs, labs = [], []
    for a, b in pairs:
        p = [v[task.BOS]] + task.encode(task.prompt(a, b))
        ans = task.encode(task.answer(a, b)) + [v[task.EOS]]
        seqs.append(p + ans)
        labs.append([-100] * len(p) + ans)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), v[task.PAD], dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, y) in enumerate(zip(seqs, labs)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(y)] = torch.tensor(y)
        mask[i, :len(s)] = 1
    return ids.to(device), lab.to(device), mask.to(device)


class RouterTap:
    """Keeps each layer's router logits of the current forward (a hook on mlp.gate)."""

    def __init__(self, model):
        self.logits: list = []
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda m, i, o: self.logits.append(o[0]))


def moe_gates(model) -> list:
    """The router of every MoE layer (a dense layer has none)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: counts each layer's top-k choices over the
    real tokens of a step (the gate returns logits, weights, indices), then moves every
    expert's e_score_correction_bias by BIAS_RATE towards the mean load."""

    def __init__(self, model):
        self.gates = moe_gates(model)
        self.mask = None
        self.counts = [None] * len(self.gates)
        for i, g in enumerate(self.gates):
            g.register_forward_hook(lambda m, inp, out, i=i: self._count(i, m, out[2]))

    def _count(self, i, gate, idx):
        if not gate.training or self.mask is None:
            return
        keep = self.mask.reshape(-1).bool()
        self.counts[i] = torch.bincount(idx[keep].reshape(-1),
                                        minlength=gate.e_score_correction_bias.numel()).float()

    @torch.no_grad()
    def step(self):
        for g, c in zip(self.gates, self.counts):
            if c is not None:
                g.e_score_correction_bias += BIAS_RATE * torch.sign(c.mean() - c)
        self.counts = [None] * len(self.gates)
        self.mask = None  # forwards outside a training step (evaluation) are not counted


def layer_balance_loss(logits_per_layer, mask) -> torch.Tensor:
    """--balance per-layer: Switch load balancing, E * sum_e f_e * P_e, for EACH layer over
    real (unpadded) tokens, averaged over layers; 1.0 when balanced.

    Why: transformers' aux loss (--balance hf, which made the committed model) sums the expert
    counts over all layers before the product, so one layer can starve an expert index that
    another layer over-feeds: the committed model's layer 1 gives experts 3 and 4 only 0.6 %
    and 0.2 % of the routed tokens (layer 0 gives the same indices 25 % each). Smoke-tested on
    the CPU only; no model made with it is committed (the H200 was not available again).
    """
    m = mask.reshape(-1).float()
    total = m.sum()
    losses = []
    for lg in logits_per_layer:
        probs = torch.softmax(lg.float(), dim=-1)
        top = torch.topk(probs, TOP_K, dim=-1).indices
        chosen = torch.zeros_like(probs).scatter_(1, top, 1.0)
        f = (chosen * m[:, None]).sum(0) / (total * TOP_K)
        p = (probs * m[:, None]).sum(0) / total
        losses.append(EXPERTS * (f * p).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def greedy_exact_match(model, problems, device, max_new=5, batch=1024):
    """Exact match by greedy decoding without padding (prompts grouped by length), the way an
    engine sees them; a quick in-training check, accuracy/eval_hf.py is the reported one."""
    v = task.vocab()
    inv = {i: t for t, i in v.items()}
    by_len: dict[int, list] = {}
    for p, ans in problems:
        by_len.setdefault(len(p), []).append((p, ans))
    good = total = 0
    model.eval()
    for _, group in sorted(by_len.items()):
        for s in range(0, len(group), batch):
            chunk = group[s:s + batch]
            ids = torch.tensor([[v[task.BOS]] + task.encode(p) for p, _ in chunk], device=device)
            out = [[] for _ in chunk]
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            for _ in range(max_new):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
                for i, t in enumerate(nxt.tolist()):
                    if not done[i]:
                        out[i].append(t)
                done |= nxt == v[task.EOS]
                ids = torch.cat([ids, nxt[:, None]], 1)
            for (_p, ans), toks in zip(chunk, out):
                text = "".join(inv[t] for t in toks if t != v[task.EOS])
                good += int(text == ans and toks and toks[-1] == v[task.EOS])
                total += 1
    model.train()
    return good / total


def expert_token_counts(model, device, n=4096):
    """Tokens routed to each expert (top-k) per layer on n training problems."""
    counts = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "gate"):
            continue  # DeepSeek-V3's dense first layer

        def hook(mod, inp, out, li=li):
            idx, n = out[2].reshape(-1), out[0].shape[-1]
            c = torch.bincount(idx, minlength=n).tolist()
            counts[li] = [x + y for x, y in zip(counts.get(li, [0] * n), c)]
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    gen = task.train_sampler(SEED + 7)
    ids, _, mask = make_batch([next(gen) for _ in range(n)], device)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return counts


def save(model, out_dir, tokenizer_dir, log, arch="qwen3_moe"):
    """Our safetensors (per-expert tensors, bf16; DeepSeek's correction bias fp32, as in its
    checkpoints) + the dual config; see module docstring."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: t.detach().to("cpu", torch.float32 if k.endswith("e_score_correction_bias")
                           else torch.bfloat16).contiguous()
          for k, t in model.state_dict().items()}
    out = {}
    for k, t in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):        # [E, 2I, H] = cat(gate, up) on dim 1
            pre, inter = k[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{pre}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):         # [E, H, I]
            pre = k[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e].clone()
        elif ".experts." in k and k.endswith(".weight"):  # already per expert (older layouts)
            out[k] = t
        else:
            out[k] = t
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict(arch), f, indent=2)
        f.write("\n")
    v = task.vocab()
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": v[task.BOS], "eos_token_id": v[task.EOS],
                   "pad_token_id": v[task.PAD], "do_sample": False}, f, indent=2)
        f.write("\n")
    # What transformers 5 writes by itself, kept as evidence only.
    with tempfile.TemporaryDirectory() as tmp:
        model.config.output_router_logits = False
        model.save_pretrained(tmp)
        shutil.copy(os.path.join(tmp, "config.json"),
                    os.path.join(out_dir, "config.transformers5-as-written.json"))
        from safetensors import safe_open
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            log["save_pretrained_expert_keys_sample"] = sorted(
                k for k in f.keys() if "layers.0.mlp" in k)[:6]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "train-log.json"), "w") as f:
        json.dump(log, f, indent=1)
        f.write("\n")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-dir", default=os.path.join(here, "tokenizer"))
    ap.add_argument("--test-jsonl", default=os.path.join(here, "data", "addition-test.jsonl"))
    ap.add_argument("--arch", choices=sorted(DEFAULT_OUT), default="qwen3_moe")
    ap.add_argument("--out-dir", default="", help="default: models/" + " or ".join(
        DEFAULT_OUT.values()))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-seconds", type=float, default=300)
    ap.add_argument("--balance", choices=["hf", "per-layer"], default="hf",
                    help="qwen3_moe only (deepseek_v3 always uses the correction-bias rule)")
    args = ap.parse_args()
    args.out_dir = args.out_dir or os.path.join(here, "models", DEFAULT_OUT[args.arch])
    deepseek = args.arch == "deepseek_v3"

    import transformers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(device, args.balance, args.arch)
    tap = RouterTap(model) if args.balance == "per-layer" and not deepseek else None
    bias = BiasBalancer(model) if deepseek else None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__} transformers {transformers.__version__} on {device}; "
          f"{n_params / 1e6:.2f} M params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = task.train_sampler(SEED)
    vgen = task.train_sampler(SEED + 1)
    val = [(task.prompt(a, b), task.answer(a, b)) for a, b in (next(vgen) for _ in range(2000))]
    log = {"arch": args.arch, "seed": SEED, "params": n_params, "batch": args.batch,
           "lr": args.lr,
           **({"balance": "correction-bias", "bias_rate": BIAS_RATE} if deepseek
              else {"balance": args.balance, "aux_coef": AUX_COEF}),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"),
           "history": []}
    t0 = time.time()
    step = 0
    for step in range(1, args.steps + 1):
        ids, lab, mask = make_batch([next(gen) for _ in range(args.batch)], device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if tap:
                tap.logits.clear()
            if bias:
                bias.mask = mask
            out = model(input_ids=ids, attention_mask=mask, labels=lab)
        if bias:
            aux, loss = torch.zeros(()), out.loss
        elif tap:
            aux = layer_balance_loss(tap.logits, mask)
            loss = out.loss + AUX_COEF * aux
        else:
            aux, loss = out.aux_loss, out.loss     # HF already added coef * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if bias:
            bias.step()
        if step % 250 == 0 or step == args.steps:
            em = greedy_exact_match(model, val, device)
            if tap:
                tap.logits.clear()
            rec = {"step": step, "loss": round(out.loss.item(), 4),
                   "aux": round(float(aux.detach()), 4), "val_em": em,
                   "s": round(time.time() - t0, 1)}
            log["history"].append(rec)
            print(rec, flush=True)
        if time.time() - t0 > args.max_seconds:
            print(f"stopping at the time budget after {step} steps", flush=True)
            break
    log["steps"] = step
    log["train_seconds"] = round(time.time() - t0, 1)
    with open(args.test_jsonl) as f:
        test = [(d["prompt"], d["answer"]) for d in map(json.loads, f)]
    log["test_em_fp32_weights_bf16_autocast"] = greedy_exact_match(model, test, device)
    fp32_bias = {k: t.detach().clone() for k, t in model.named_buffers()
                 if k.endswith("e_score_correction_bias")}
    model = model.to(torch.bfloat16)
    for k, t in fp32_bias.items():  # the router adds it to fp32 scores; checkpoints keep fp32
        mod = model.get_submodule(k.rsplit(".", 1)[0])
        mod.e_score_correction_bias = t
    log["test_em_bf16_weights"] = greedy_exact_match(model, test, device)
    log["expert_token_counts"] = expert_token_counts(model, device)
    if deepseek:
        log["e_score_correction_bias"] = {
            str(li): [round(x, 4) for x in layer.mlp.gate.e_score_correction_bias.tolist()]
            for li, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    print({k: log[k] for k in ("steps", "train_seconds", "test_em_fp32_weights_bf16_autocast",
                               "test_em_bf16_weights", "expert_token_counts")}, flush=True)
    save(model, args.out_dir, args.tokenizer_dir, log, args.arch)
    print("saved", args.out_dir, flush=True)


if __name__ == "__main__":
    main()
