"""The decoder layers of a head stree trains for a target: an HF causal LM of the target's own family whose layers are
all full attention (with the family's MLP), or, for families without attention layers, a Llama model of the target's
width. Its embedding and LM head are replaced by the target's (head.share_embeddings)."""
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig


def _attention_layers(key):
    """Changes giving `layers` full-attention layers through the config field `key` (a per-layer list)."""
    return lambda layers: ({key: ["full_attention"] * layers}, ())


# model_type -> (changes, keys to drop) that make a copy of the target's config all-attention with `layers` layers
OWN_FAMILY = {"llama": lambda layers: ({}, ("layer_types",)), "qwen2": lambda layers: ({}, ("layer_types",)),
              "qwen3": lambda layers: ({}, ("layer_types",)),
              "bamba": lambda layers: ({"attn_layer_indices": list(range(layers))}, ()),
              "nemotron_h": lambda layers: ({"layers_block_type": ["full_attention", "mlp"] * layers,
                                             "num_nextn_predict_layers": 0}, ("hybrid_override_pattern",)),
              "qwen3_next": _attention_layers("layer_types"), "qwen3_5_text": _attention_layers("layer_types"),
              "qwen3_5_moe_text": _attention_layers("layer_types")}


def edited_config(text, drop=(), **changes):
    """A copy of config `text` with `changes`, without the keys `drop`, and with untied embeddings (a head's
    embedding and LM head are its target's)."""
    config = text.to_dict()
    for key in drop:
        config.pop(key, None)
    config.update(changes, tie_word_embeddings=False)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def head_config(target_config, layers=1):
    """The config of a new head's decoder layers for a target of config `target_config` (its text config for
    multimodal wrappers): `layers` attention blocks of the target's family (OWN_FAMILY), else Llama blocks of its
    hidden size, heads and vocabulary."""
    text = target_config.get_text_config()
    if text.model_type in OWN_FAMILY:
        changes, drop = OWN_FAMILY[text.model_type](layers)
        return edited_config(text, drop, num_hidden_layers=layers, mlp_only_layers=[], **changes)
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", None) or max(1, hidden // 64)
    return LlamaConfig(vocab_size=text.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                       intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
                       num_attention_heads=heads, num_key_value_heads=getattr(text, "num_key_value_heads", heads),
                       rms_norm_eps=getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_epsilon", 1e-5),
                       max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
                       tie_word_embeddings=False)


def head_layers(config, target):
    """A new HF causal LM for a head's layers from `config` (head_config's or a saved head's), on the target's dtype
    and device, with its attention and MoE experts implementations (sdpa where it has none set)."""
    text = target.config.get_text_config()
    config._attn_implementation = getattr(text, "_attn_implementation", None) or "sdpa"
    experts = getattr(text, "_experts_implementation", None)
    if experts is not None:
        config._experts_implementation = experts
    return AutoModelForCausalLM.from_config(config, dtype=target.dtype).to(target.device).eval()
