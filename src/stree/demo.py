"""The bundled demo pair (built by `python -m stree.distill.demo`, see its docstring for the recipe)."""
import os

import torch

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")


def demo_pair(dtype=torch.float32, device="cpu"):
    """(target, draft, tokenizer): a 6-layer Bamba target (5 Mamba2 layers + 1 attention layer) and a one-layer
    Mamba2 draft distilled from it, both trained on the Python standard library's source, and their BPE
    tokenizer. Offline: everything ships inside the package. The target's trained draft head: demo_head(target)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.exists(os.path.join(DEMO_DIR, "target", "model.safetensors")):
        raise FileNotFoundError(f"the demo pair is missing from {DEMO_DIR}; rebuild it with "
                                f"python -m stree.distill.demo --out {DEMO_DIR}")
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO_DIR, "target"), dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO_DIR, "draft"), dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(DEMO_DIR, "tokenizer"))
    return target, draft, tokenizer


def demo_head(target):
    """The bundled target's draft head (a stree.heads.DraftHead: one Bamba attention block fed the target's features,
    trained by `python -m stree.distill.demo_head`), for demo_pair()'s target in any dtype or device."""
    from .heads import DraftHead
    return DraftHead.from_pretrained(os.path.join(DEMO_DIR, "head"), target=target)


def held_out_prompts(tokenizer, count, length, seed=0):
    """`count` windows of `length` tokens from the standard-library files the demo pair never trained on."""
    from .distill.data import random_windows, stdlib_split, tokenize_files
    tokens = tokenize_files(stdlib_split()[1], tokenizer)
    return list(random_windows(tokens, count, length, torch.Generator().manual_seed(seed))[:, None])
