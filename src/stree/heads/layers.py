"""The decoder layers of a head stree trains for a target: an HF causal LM of the target's own family whose layers are
all full attention (with the family's MLP), or, for families without attention layers, a Llama model of the target's
width. Its embedding and LM head are replaced by the target's (head.share_embeddings)."""
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from ..models.families import SUPPORTED_MODEL_TYPES


def _attention_layers(key):
    """Edits a config dict to `layers` full-attention layers through the config field `key` (a per-layer list)."""
    def edit(config, layers):
        config[key] = ["full_attention"] * layers
    return edit


def _bamba(config, layers):
    config["attn_layer_indices"] = list(range(layers))


def _nemotron_h(config, layers):
    config["layers_block_type"] = ["full_attention", "mlp"] * layers
    config.pop("hybrid_override_pattern", None)
    config["num_nextn_predict_layers"] = 0


def _plain(config, layers):
    config.pop("layer_types", None)


# model_type -> how a copy of the target's config (a dict, num_hidden_layers set) is made all-attention
OWN_FAMILY = {"llama": _plain, "qwen2": _plain, "qwen3": _plain, "bamba": _bamba, "nemotron_h": _nemotron_h,
              "qwen3_next": _attention_layers("layer_types"), "qwen3_5_text": _attention_layers("layer_types"),
              "qwen3_5_moe_text": _attention_layers("layer_types")}


def head_config(target_config, layers=1):
    """The config of a new head's decoder layers for a target of config `target_config` (its text config for
    multimodal wrappers): `layers` attention blocks of the target's family (OWN_FAMILY), else Llama blocks of its
    hidden size, heads and vocabulary."""
    text = target_config.get_text_config()
    if text.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {text.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if text.model_type in OWN_FAMILY:
        config = text.to_dict()
        config.update(num_hidden_layers=layers, mlp_only_layers=[], tie_word_embeddings=False)
        OWN_FAMILY[text.model_type](config, layers)
        return AutoConfig.for_model(config.pop("model_type"), **config)
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
