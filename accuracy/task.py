# SPDX-License-Identifier: Apache-2.0
"""The accuracy task: 3-digit addition, character by character ("123+456=" -> "579").

Why this task: a 2-layer MoE only gets it right by computing every answer digit from the
operands, with carries, so a quantization error in the experts shows up as wrong digits, and
exact match over a held-out set is a sharp, cheap score (no sampling, no judge).

Run as a script it writes what the model directory and the tests need, deterministically:
  accuracy/data/addition-test.jsonl   the held-out problems (never trained on)
  accuracy/tokenizer/                 the character tokenizer (tokenizer.json + configs)
Usage: python accuracy/task.py [--out-dir accuracy]
Needs only `tokenizers` (any 0.2x); the files load with transformers 4.57 and 5.x.
"""
from __future__ import annotations

import argparse
import json
import os
import random

SEED = 20261203
MAX_OPERAND = 999          # operands 0..999: "a+b=" prompts of 4..8 characters
N_TEST = 1000              # held-out problems (the brief asks for >= 500)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL = [PAD, BOS, EOS, UNK]
CHARS = list("0123456789+=")
VOCAB_SIZE = 64            # the rest are <unused_k>, so the embedding is a friendly size


def vocab() -> dict[str, int]:
    """Token -> id: specials first (pad=0, bos=1, eos=2, unk=3), then the characters."""
    toks = SPECIAL + CHARS
    toks += [f"<unused_{i}>" for i in range(VOCAB_SIZE - len(toks))]
    return {t: i for i, t in enumerate(toks)}


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)


def test_pairs() -> list[tuple[int, int]]:
    """The held-out (a, b) pairs, drawn once from SEED."""
    rng = random.Random(SEED)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < N_TEST:
        pairs.add((rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)))
    return sorted(pairs)


def train_sampler(seed: int):
    """Endless random training pairs, never a test pair (nor its mirror b+a)."""
    held = set(test_pairs())
    held |= {(b, a) for a, b in held}
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        if (a, b) not in held:
            yield a, b


def encode(text: str) -> list[int]:
    """Character ids without specials (the tokenizer adds <bos> in front)."""
    v = vocab()
    return [v[c] for c in text]


def write_test_set(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for a, b in test_pairs():
            f.write(json.dumps({"prompt": prompt(a, b), "answer": answer(a, b)}) + "\n")


def write_tokenizer(out_dir: str) -> None:
    """A HF fast tokenizer: one token per character, <bos> prepended, <eos>/<pad> declared.

    tokenizer_class is PreTrainedTokenizerFast (transformers 4.57, vLLM 0.11.0's, does not know
    transformers 5's "TokenizersBackend"); left padding, so batched greedy generation puts every
    prompt's end next to its first generated token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    v = vocab()
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, v[BOS])])
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": True, "add_eos_token": False,
        "padding_side": "left", "truncation_side": "left",
        "model_max_length": 32, "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
                  f, indent=2)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    write_test_set(os.path.join(args.out_dir, "data", "addition-test.jsonl"))
    write_tokenizer(os.path.join(args.out_dir, "tokenizer"))
    print(f"wrote {N_TEST} test problems and the tokenizer under {args.out_dir}")


if __name__ == "__main__":
    main()
