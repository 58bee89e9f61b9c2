"""Draft (student) initialisation: from a config, from a subset of the target's layers, or attention -> Mamba2.

All students share the target's vocabulary. Embeddings / LM head can be copied from the target when the hidden
sizes agree.
"""
import copy
import inspect

import torch
import transformers

# Per family: the config field that says which layers are which (None: every layer is alike).
LAYER_LISTS = {
    "mamba2": None,
    "bamba": "attn_layer_indices",
    "nemotron_h": "layers_block_type",
    "granitemoehybrid": "layer_types",
    "falcon_h1": None,
}


def _decoder_layers(model):
    """The ModuleList of decoder blocks (Mamba2: backbone.layers; others: model.layers)."""
    base = getattr(model, "backbone", None) or model.model
    return base.layers


def copy_embeddings(student, target):
    """Copy input embeddings and LM head from target to student (same vocabulary and hidden size required)."""
    for get in ("get_input_embeddings", "get_output_embeddings"):
        src, dst = getattr(target, get)(), getattr(student, get)()
        if src.weight.shape != dst.weight.shape:
            raise ValueError(f"cannot share {get[4:]}: target {tuple(src.weight.shape)} vs student "
                             f"{tuple(dst.weight.shape)} (hidden sizes must match)")
        with torch.no_grad():
            dst.weight.copy_(src.weight)


# Older spellings that HF configs still accept through **kwargs.
_LEGACY_CONFIG_KEYS = {"torch_dtype", "rope_scaling", "use_cache", "tie_word_embeddings", "pad_token_id",
                       "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id", "num_labels",
                       "tokenizer_class"}


def config_from_dict(config):
    """An HF config from a dict with a "model_type" and that config class's own keys. ValueError on a missing or
    unknown model_type, and on keys the config class does not know (HF would keep a misspelt key silently)."""
    if not isinstance(config, dict):
        raise ValueError(f"a student config must be a dict or an HF config, got {type(config).__name__}")
    config = dict(config)
    if "model_type" not in config:
        raise ValueError(f"a student config dict needs a \"model_type\" (e.g. \"mamba2\"), got keys {sorted(config)}")
    model_type = config.pop("model_type")
    mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    if model_type not in mapping:
        raise ValueError(f"unknown model_type {model_type!r}: not a transformers model type")
    cls = mapping[model_type]
    known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
    known |= set(inspect.signature(transformers.PretrainedConfig.__init__).parameters) | _LEGACY_CONFIG_KEYS
    try:
        known |= set(cls().to_dict())
    except (TypeError, ValueError):  # a config class that needs arguments: its signature's keys only
        pass
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown} for model_type {model_type!r}; {cls.__name__} takes "
                         f"{sorted(known - {'self', 'kwargs', 'args'})}")
    return cls(**config)


def student_from_config(target, config, *, share_embeddings=False):
    """A fresh causal LM from `config` (an HF config, or a dict with "model_type": see config_from_dict), with the
    target's vocabulary.

    share_embeddings copies the target's embeddings and LM head (hidden sizes must agree).
    """
    if not isinstance(config, transformers.PretrainedConfig):
        config = config_from_dict(config)
    config.vocab_size = target.config.vocab_size
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(config, name, getattr(target.config, name, None))
    student = transformers.AutoModelForCausalLM.from_config(config).to(target.dtype)
    if share_embeddings:
        copy_embeddings(student, target)
    return student


def student_from_layers(target, layers):
    """A shallower copy of the target that keeps only the decoder layers with the given indices (in order),
    with their weights, the embeddings, the final norm and the LM head. Families: mamba2, bamba, nemotron_h,
    granitemoehybrid, falcon_h1 (Zamba2's shared blocks are not split)."""
    model_type = target.config.model_type
    if model_type not in LAYER_LISTS:
        raise ValueError(f"student_from_layers supports {sorted(LAYER_LISTS)}, not {model_type!r}")
    layers = list(layers)
    n_target = len(_decoder_layers(target))
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < n_target for i in layers):
        raise ValueError(f"layers must be distinct indices in [0, {n_target}), got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    field = LAYER_LISTS[model_type]
    if field == "attn_layer_indices":
        config.attn_layer_indices = [new for new, old in enumerate(layers) if old in target.config.attn_layer_indices]
    elif field is not None:
        setattr(config, field, [getattr(target.config, field)[i] for i in layers])
    student = type(target)(config).to(target.dtype)
    source = target.state_dict()
    renamed = {}
    for key, value in source.items():
        marker = ".layers."
        if marker in key:
            head, rest = key.split(marker, 1)
            index, tail = rest.split(".", 1)
            if int(index) not in layers:
                continue
            key = f"{head}{marker}{layers.index(int(index))}.{tail}"
        renamed[key] = value
    student.load_state_dict(renamed, strict=True)
    return student


@torch.no_grad()
def mamba_from_attention(attention, mixer):
    """Initialise a Mamba2 mixer from an attention module, the linear-attention correspondence used to distil
    Transformers into Mamba (x <- V, B <- K, C <- Q, out_proj <- o_proj).

    The mixer must have num_heads = attention heads, head_dim = attention head_dim, n_groups = num_heads and
    ssm_state_size = head_dim. K and V are repeated over the query heads of their group (GQA). The conv starts
    as the identity on its newest tap, D at 0, and dt, A and the gate keep their own initialisation.
    """
    heads, head_dim = mixer.num_heads, mixer.head_dim
    q, k, v, o = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight, attention.o_proj.weight
    if q.shape[0] != heads * head_dim or mixer.n_groups != heads or mixer.ssm_state_size != head_dim:
        raise ValueError(f"mixer must have num_heads={q.shape[0] // head_dim}, n_groups=num_heads and "
                         f"ssm_state_size=head_dim={head_dim} to take this attention layer")
    repeat = heads // (k.shape[0] // head_dim)

    def per_head(weight):  # (kv_heads * d, hidden) -> (heads * d, hidden)
        return weight.view(-1, head_dim, weight.shape[-1]).repeat_interleave(repeat, dim=0).reshape(-1, weight.shape[-1])

    inner, state = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    rows = dict(x=(inner, 2 * inner), B=(2 * inner, 2 * inner + state), C=(2 * inner + state, 2 * inner + 2 * state))
    weight = mixer.in_proj.weight
    weight[slice(*rows["x"])] = per_head(v).to(weight.dtype)
    weight[slice(*rows["B"])] = per_head(k).to(weight.dtype)
    weight[slice(*rows["C"])] = q.to(weight.dtype)
    mixer.out_proj.weight.copy_(o)
    mixer.conv1d.weight.zero_()
    mixer.conv1d.weight[:, 0, -1] = 1.0
    if mixer.conv1d.bias is not None:
        mixer.conv1d.bias.zero_()
    mixer.D.zero_()
    return mixer


def mamba2_from_transformer(target):
    """A Mamba2 student with one mixer per attention layer of a Transformer target, each initialised from that
    layer by mamba_from_attention (MLPs are dropped: Mamba2 blocks have none); embeddings, LM head and final norm
    copied. Works for targets whose layers hold `self_attn` (Llama, Qwen2, Qwen3, ...)."""
    attentions = [layer.self_attn for layer in _decoder_layers(target)]
    first = attentions[0]
    heads = first.q_proj.weight.shape[0] // first.head_dim
    hidden = target.config.hidden_size
    if (heads * first.head_dim) % hidden:
        raise ValueError(f"attention width {heads * first.head_dim} must be a multiple of hidden_size {hidden}")
    config = transformers.Mamba2Config(
        vocab_size=target.config.vocab_size, hidden_size=hidden, num_hidden_layers=len(attentions),
        num_heads=heads, head_dim=first.head_dim, n_groups=heads, state_size=first.head_dim,
        expand=heads * first.head_dim // hidden, conv_kernel=4, tie_word_embeddings=False,
        eos_token_id=target.config.eos_token_id, bos_token_id=target.config.bos_token_id,
        pad_token_id=target.config.pad_token_id)
    student = transformers.Mamba2ForCausalLM(config).to(target.dtype)
    copy_embeddings(student, target)
    with torch.no_grad():
        student.backbone.norm_f.weight.copy_(target.model.norm.weight)
    for attention, block in zip(attentions, student.backbone.layers):
        mamba_from_attention(attention, block.mixer)
    return student
