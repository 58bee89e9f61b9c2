"""Draft-model distillation (installed as ``stree.distill``): student initialisation, losses, data, trainer."""
from .data import (Continuations, TokenChunks, load_tokens, python_stdlib_files, random_windows, stdlib_split,
                   target_continuations, text_files, tokenize_files)
from .losses import TopK, cross_entropy, forward_kl, mixture_loss, reverse_kl
from .student import (config_from_dict, copy_embeddings, mamba2_from_transformer, mamba_from_attention,
                      student_from_config, student_from_layers)
from .trainer import TrainConfig, Trainer

__all__ = ["Continuations", "TokenChunks", "load_tokens", "python_stdlib_files", "random_windows", "stdlib_split",
           "target_continuations",
           "text_files", "tokenize_files", "TopK", "cross_entropy", "forward_kl", "mixture_loss", "reverse_kl",
           "config_from_dict", "copy_embeddings", "mamba2_from_transformer", "mamba_from_attention",
           "student_from_config", "student_from_layers", "TrainConfig", "Trainer"]
