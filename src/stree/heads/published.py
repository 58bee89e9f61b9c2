"""Loading and saving draft heads: heads stree trains (a folder with stree_head.json and head.safetensors) and the
MTP heads published inside Qwen3-Next, Qwen3.5 and Nemotron-H checkpoint folders (mtp_layouts.py)."""
import json
import os
import re

from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from ..models.families import check_model
from .head import DraftHead, new_fusion
from .layers import head_config, head_layers
from .mtp_layouts import load_mtp_head

HEAD_CONFIG = "stree_head.json"
HEAD_WEIGHTS = "head.safetensors"


def new_head(target, layers=1, feature_layers=None):
    """An untrained EAGLE-style head for `target` (a loaded HF causal LM): `layers` attention blocks of the target's
    family (heads.layers), a fresh fusion, the target's embedding and LM head, on the target's dtype and device.
    feature_layers: None (the head reads the target's last hidden state, EAGLE-1/2), indices of the target's decoder
    layers whose outputs it reads, or "eagle3" (EAGLE-3's choice: an early, the middle and a late layer)."""
    check_model(target)  # a supported family (ValueError listing them)
    feature_layers = checked_feature_layers(feature_layers, target.config.get_text_config().num_hidden_layers)
    inner = head_layers(head_config(target.config, layers), target)
    return DraftHead(inner, new_fusion(inner, feature_layers), target, kind="eagle", feature_layers=feature_layers)


def checked_feature_layers(feature_layers, count):
    """None or a tuple of distinct layer indices in [0, count) from new_head's feature_layers (ValueError if not)."""
    if feature_layers is None:
        return None
    if feature_layers == "eagle3":
        if count < 5:
            raise ValueError(f"feature_layers='eagle3' takes layers 1, N // 2 and N - 2 of N >= 5 layers; the target "
                             f"has {count}: name the layers")
        return 1, count // 2, count - 2
    layers = tuple(feature_layers) if isinstance(feature_layers, (tuple, list)) else None
    if (not layers or len(set(layers)) != len(layers)
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in layers)):
        raise ValueError(f"feature_layers must be None, 'eagle3' or distinct layer indices in [0, {count}), got "
                         f"{feature_layers!r}")
    return layers


def save_head(head, path):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, HEAD_CONFIG), "w") as f:
        json.dump({"kind": head.kind, "feature_layers": head.feature_layers, "config": head.inner.config.to_dict()},
                  f, indent=2)
    state = {k: v.detach().contiguous() for k, v in head.own_state_dict().items()}
    save_file(state, os.path.join(path, HEAD_WEIGHTS))


def load_head(path, target):
    """DraftHead.from_pretrained's work (see there)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"a head's path must be a folder, got {path!r}")
    if os.path.exists(os.path.join(path, HEAD_CONFIG)):
        return _load_trained(path, target)
    return load_mtp_head(path, target)


def _load_trained(path, target):
    with open(os.path.join(path, HEAD_CONFIG)) as f:
        saved = json.load(f)
    config = dict(saved["config"])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    if config.vocab_size != target.config.get_text_config().vocab_size:
        raise ValueError(f"the head in {path} was made for a vocabulary of {config.vocab_size}, the target has "
                         f"{target.config.get_text_config().vocab_size}")
    inner = head_layers(config, target)
    layers = checked_feature_layers(saved.get("feature_layers"), target.config.get_text_config().num_hidden_layers)
    head = DraftHead(inner, new_fusion(inner, layers), target, kind=saved.get("kind", "eagle"), feature_layers=layers)
    load_weights(head, path)
    return head


def load_weights(head, path):
    """Load the head's own weights from folder `path` (save_head's head.safetensors); ValueError naming what is
    missing or unexpected."""
    state = load_file(os.path.join(path, HEAD_WEIGHTS), device=str(head.device))
    missing, unexpected = head.load_state_dict(state, strict=False)
    own = set(head.own_state_dict())
    if unexpected or own & set(missing):
        raise ValueError(f"{path} does not hold this head's weights: missing {sorted(own & set(missing))}, "
                         f"unexpected {sorted(unexpected)}")


def read_tensors(path, pattern):
    """{key: tensor} of every tensor in the folder's safetensors files whose key matches the regular expression
    `pattern` (re.match), read without loading the rest (the shard index tells which files hold them)."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted({file for key, file in json.load(f)["weight_map"].items() if re.match(pattern, key)})
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys() if re.match(pattern, key)})
    return tensors
