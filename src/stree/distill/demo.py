"""Build the bundled demo pair: a small Bamba target (Mamba2 + attention) and a distilled one-layer Mamba2 draft,
trained on the Python standard library's source with a BPE tokenizer trained on the same files.

    python -m stree.distill.demo --out stree/assets/demo            # what shipped (about 40 minutes on 2 CPU cores)
    python -m stree.distill.demo --out /tmp/demo --target-steps 20 --draft-steps 20   # a quick smoke run

Every 20th file is held out: its text gives the evaluation prompts. Weights are stored in float16 safetensors and
loaded back in float32 by stree.demo_pair().
"""
import argparse
import json
import os
import tempfile
import time

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import ConcatDataset

from .data import TokenChunks, random_windows, stdlib_split, target_continuations, tokenize_files
from .trainer import TrainConfig, Trainer

EOS = "<|endoftext|>"
TARGET_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, attn_layer_indices=[3],
                     num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
                     mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                     max_position_embeddings=4096, tie_word_embeddings=False)
DRAFT_CONFIG = dict(hidden_size=128, num_hidden_layers=1, num_heads=4, head_dim=64, state_size=32, n_groups=1,
                    expand=2, conv_kernel=4, chunk_size=64, tie_word_embeddings=False)


def train_tokenizer(files, vocab_size):
    """A byte-level BPE tokenizer trained on `files`, with EOS as its only special token."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def build(out, target_steps, draft_steps, vocab_size, seq_len, workdir=None, seed=0):
    torch.manual_seed(seed)
    train_files, held_out = stdlib_split()
    tokenizer = train_tokenizer(train_files, vocab_size)
    tokens = tokenize_files(train_files, tokenizer)
    eval_tokens = tokenize_files(held_out, tokenizer)
    print(f"{len(train_files)} training files, {tokens.numel()} tokens; {len(held_out)} held-out files")
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.eos_token_id)
    workdir = workdir or tempfile.mkdtemp(prefix="stree-demo-")  # trainer checkpoints: not shipped

    target = transformers.BambaForCausalLM(transformers.BambaConfig(**TARGET_CONFIG, **ids))
    started = time.time()
    Trainer(target, TrainConfig(output_dir=os.path.join(workdir, "target"), steps=target_steps, batch_size=8,
                                lr=2e-3, warmup=100, losses={"cross_entropy": 1.0}, seed=seed),
            TokenChunks(tokens, seq_len)).train()
    print(f"target trained in {time.time() - started:.0f} s")

    # What the draft must predict: the target's own continuations of training text, plus the text itself.
    g = torch.Generator().manual_seed(seed)
    continuations = target_continuations(target, random_windows(tokens, 512, 32, g), max_new_tokens=64,
                                         temperature=0.7)
    data = ConcatDataset([continuations, TokenChunks(tokens, 95)])
    draft = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**DRAFT_CONFIG, **ids))
    eval_prompts = random_windows(eval_tokens, 4, 32, g)
    started = time.time()
    history = Trainer(draft, TrainConfig(output_dir=os.path.join(workdir, "draft"), steps=draft_steps, batch_size=16,
                                         lr=3e-3, warmup=50, losses={"forward_kl": 1.0}, eval_every=draft_steps,
                                         eval_new_tokens=48, seed=seed),
                      data, teacher=target, eval_prompts=eval_prompts).train()
    print(f"draft distilled in {time.time() - started:.0f} s; held-out tau {history[-1].get('tau')}")

    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.float16).save_pretrained(os.path.join(out, name), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    with open(os.path.join(out, "build.json"), "w") as f:
        json.dump(dict(target_steps=target_steps, draft_steps=draft_steps, vocab_size=vocab_size, seq_len=seq_len,
                       seed=seed, train_tokens=tokens.numel(), held_out_files=len(held_out),
                       command=f"python -m stree.distill.demo --out {out} --target-steps {target_steps} "
                               f"--draft-steps {draft_steps}"), f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--target-steps", type=int, default=2500)
    parser.add_argument("--draft-steps", type=int, default=1500)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--workdir", default=None, help="where trainer checkpoints go (default: a temp folder)")
    args = parser.parse_args()
    build(args.out, args.target_steps, args.draft_steps, args.vocab_size, args.seq_len, args.workdir)


if __name__ == "__main__":
    main()
