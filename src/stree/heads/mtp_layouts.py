"""The MTP heads published inside checkpoint folders, read from the `mtp.*` tensors HF's loader skips.

Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (one layout):
    mtp.fc.weight (H, 2H)                               -> fusion.fc
    mtp.pre_fc_norm_embedding / pre_fc_norm_hidden      -> fusion's norms (the family's 1 + weight RMSNorm)
    mtp.layers.i.*                                      -> inner.model.layers.i.* (full-attention decoder layers)
    mtp.norm.weight                                     -> inner.model.norm
Nemotron-H (blocks from mtp_layers_block_type, e.g. attention then MoE, run in sequence each step):
    mtp.layers.0.enorm / hnorm / eh_proj                -> fusion's norms and fc
    mtp.layers.j.{norm, mixer.*}                        -> inner.model.layers.j.*
    mtp.layers.<last>.final_layernorm                   -> inner.model.norm_f
Routed experts stored one tensor per expert (mlp.experts.<e>.gate_proj ...) are stacked into HF's fused layout
(experts.gate_up_proj (E, 2I, H) with the gate rows first, experts.down_proj (E, H, I); Nemotron's non-gated
experts.up_proj (E, I, H)), as HF's own loader does for the main layers.
"""
import json
import os
import re

import torch

from .head import DraftHead, new_fusion
from .layers import edited_config, head_layers

MTP_PREFIX = r"^(model\.)?(language_model\.)?mtp\."  # multimodal checkpoints nest the text model's keys
QWEN_MTP = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def load_mtp_head(path, target):
    """The MTP head of the checkpoint in folder `path` for `target` (see the module docstring)."""
    from .published import read_tensors
    config = _folder_config(path)
    model_type = config.get("model_type")
    if model_type not in QWEN_MTP + ("nemotron_h",):
        raise ValueError(f"{path} holds no stree head (stree_head.json) and its model type {model_type!r} publishes "
                         f"no MTP head stree reads (those of {', '.join(QWEN_MTP + ('nemotron_h',))})")
    tensors = {re.sub(MTP_PREFIX, "mtp.", k): v for k, v in read_tensors(path, MTP_PREFIX).items()}
    if not tensors:
        raise ValueError(f"the {model_type} checkpoint in {path} holds no mtp.* weights: it was saved without its MTP "
                         "head (HF's save_pretrained drops them)")
    layout = _nemotron_h if model_type == "nemotron_h" else _qwen
    inner_config, names = layout(target.config.get_text_config(), tensors)
    inner = head_layers(inner_config, target)
    head = DraftHead(inner, new_fusion(inner), target, kind=f"{model_type}_mtp")
    _load(head, {names(k): v for k, v in tensors.items()}, path)
    return head


def _folder_config(path):
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise ValueError(f"{path} holds neither a stree head (stree_head.json) nor a model (config.json)")
    with open(file) as f:
        config = json.load(f)
    return config.get("text_config", config) if config.get("model_type") not in QWEN_MTP + ("nemotron_h",) else config


def _qwen(text, tensors):
    """(inner config, key renamer) of a Qwen3-Next / Qwen3.5 MTP head."""
    layers = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", k)))
    config = edited_config(text, num_hidden_layers=layers, layer_types=["full_attention"] * layers, mlp_only_layers=[])

    def name(key):
        key = key[len("mtp."):]
        if key.startswith("layers."):
            return "inner.model." + key
        return {"fc.weight": "fusion.fc.weight", "pre_fc_norm_embedding.weight": "fusion.norm_embedding.weight",
                "pre_fc_norm_hidden.weight": "fusion.norm_hidden.weight", "norm.weight": "inner.model.norm.weight"
                }.get(key, "unknown." + key)
    return config, name


def _nemotron_h(text, tensors):
    """(inner config, key renamer) of a Nemotron-H MTP head."""
    blocks = list(getattr(text, "mtp_layers_block_type", None) or [])
    present = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", k)))
    if len(blocks) != present:
        raise ValueError(f"the config's mtp_layers_block_type {blocks} does not match the {present} mtp layers stored")
    config = edited_config(text, layers_block_type=blocks, num_nextn_predict_layers=0)
    last = f"layers.{present - 1}.final_layernorm.weight"

    def name(key):
        key = key[len("mtp."):]
        fusion = {"layers.0.enorm.weight": "fusion.norm_embedding.weight",
                  "layers.0.hnorm.weight": "fusion.norm_hidden.weight", "layers.0.eh_proj.weight": "fusion.fc.weight",
                  last: "inner.model.norm_f.weight"}
        return fusion.get(key, "inner.model." + key)
    return config, name


def _load(head, tensors, path):
    """Load renamed tensors into the head (experts stacked as HF keeps them); ValueError naming what does not fit."""
    own = head.own_state_dict()
    tensors = stack_experts(tensors, own)
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if own[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(f"the mtp.* weights in {path} do not fit the head built from its config: missing {missing}, "
                         f"unexpected {unexpected}, shapes differ {wrong}")
    with torch.no_grad():
        for key, value in tensors.items():
            own[key].copy_(value)


def stack_experts(tensors, own):
    """tensors with per-expert weights (...experts.<e>.{gate,up,down}_proj.weight) stacked into the fused parameters
    `own` has (...experts.gate_up_proj, ...experts.up_proj, ...experts.down_proj); others unchanged."""
    out = dict(tensors)
    for key in own:
        match = re.match(r"(.*\.experts\.)(gate_up_proj|up_proj|down_proj)$", key)
        if match is None or key in out:
            continue
        prefix, fused = match.groups()
        count = own[key].shape[0]
        parts = [fused] if fused != "gate_up_proj" else ["gate_proj", "up_proj"]
        per_expert = [[out.pop(f"{prefix}{e}.{part}.weight", None) for part in parts] for e in range(count)]
        if all(t is not None for row in per_expert for t in row):
            out[key] = torch.stack([torch.cat(row, 0) for row in per_expert])
    return out
