"""Which HF models stree runs, and how it finds their recurrent mixers.

A mixer kind is one adapter class for every model whose mixer modules it matches (MIXER_KINDS; the contract is
MixerKind below). A TreeModel groups a model's mixers by kind and by state shape and runs each group through its
kind's adapter; attention, MLP and MoE blocks run as HF's own modules.
"""
from typing import Protocol

from .gated_delta import GatedDeltaLayers
from .kimi_delta import KimiDeltaLayers
from .mamba1 import Mamba1Layers
from .mamba2 import Mamba2Layers
from .short_conv import ShortConvLayers

SSM_FAMILIES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2",  # Mamba2
                "mamba", "falcon_mamba", "jamba", "zamba",  # Mamba1 selective scan
                "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid",  # GDN
                "kimi_linear",  # KDA
                "lfm2", "lfm2_moe")  # short convolutions
TRANSFORMER_FAMILIES = ("llama", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = SSM_FAMILIES + TRANSFORMER_FAMILIES
# Families without attention layers (no attention buffers, no mask).
ATTENTION_FREE = ("mamba2", "mamba", "falcon_mamba")
# Families whose CausalLM forward rescales the LM head's output, as it does: model_type -> scale(logits, config,
# base model).
LOGIT_SCALE = {"granitemoehybrid": lambda logits, config, base: logits / config.logits_scaling,
               "falcon_h1": lambda logits, config, base: logits * base.lm_head_multiplier}


class MixerKind(Protocol):
    """What a mixer kind's adapter class provides (see mamba2.Mamba2Layers for a full one).

    An adapter holds the mixers of one cache.StateGroup (mixers[j] owns slice j of group.conv / group.recurrent) and
    buffers over the tree's node slots; every pass reads all `capacity` slots, so no shape depends on the tree.
    """
    SEQUENTIAL: bool  # optional (False if absent): its passes walk the new nodes level by level (TreePass.levels)

    @staticmethod
    def matches(module) -> bool:
        """Whether `module` is a mixer of this kind."""

    @staticmethod
    def window_keys(module) -> list:
        """The conv windows its passes need, (width, state_len) pairs."""

    @staticmethod
    def check(module) -> None:
        """Optional: raise ValueError for a configuration the adapter does not implement."""

    def __init__(self, mixers, group): ...

    def reserve(self, capacity) -> None:
        """Hold at least `capacity` node slots, keeping what the buffers hold."""

    def forward(self, j, hidden_states, tree_pass, conv_state, recurrent_state):
        """Layer j over the pass's new nodes tree_pass.rows: hidden_states (batch, R, hidden) -> (batch, R, hidden);
        the committed states are read only."""

    def commit(self, index, nodes) -> None:
        """Overwrite the group's states in place with those after path(nodes[b]) of the tree whose TreeIndex (over
        all slots) is `index`; nodes (batch,) int64 on the device, -1 = nothing accepted."""


MIXER_KINDS = (Mamba2Layers, Mamba1Layers, GatedDeltaLayers, KimiDeltaLayers, ShortConvLayers)


def check_model(model):
    """The model's type, after refusing what a TreeModel cannot run (ValueError naming what would)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    attn = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in attn:
        raise ValueError(f"attn_implementation={attn!r} only takes 2D padding masks, not a tree mask; load the "
                         "model with attn_implementation='sdpa' or 'eager'")
    return model_type


def find_mixers(model, model_type, required=True):
    """({layer_idx: mixer module}, {layer_idx: its kind}) of the model's recurrent mixers, each checked by its
    kind. required: a model of an SSM family must have some (a draft head of one need not)."""
    mixers, kinds = {}, {}
    for module in model.modules():
        kind = next((k for k in MIXER_KINDS if k.matches(module)), None)
        if kind is not None:
            mixers[module.layer_idx], kinds[module.layer_idx] = module, kind
    if required and model_type in SSM_FAMILIES and not mixers:
        raise ValueError(f"found no supported mixer in this {model_type} model")
    for i, mixer in mixers.items():
        getattr(kinds[i], "check", lambda module: None)(mixer)
    return mixers, kinds
