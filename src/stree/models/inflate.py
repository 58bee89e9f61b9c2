"""A Bamba or Mamba2 model inflated to a larger shape that computes exactly the same function: a realistic-size
target or draft for benchmarks (weights that no longer fit in a CPU cache; a weight-bandwidth-bound decode step)
without a download.

Every old weight sits in the corner of its new matrix and everything new is zero, so the new hidden channels,
heads, state dimensions, MLP units and layers carry zeros: extra layers add nothing to the residual stream, extra
heads see zero inputs. Only the RMS norms notice the zero channels (their mean runs over more of them); their
weights and epsilon are rescaled to compensate, which needs hidden and mixer width to grow by the same factor.
"""
import math

import torch
import transformers


def inflate_bamba(model, *, hidden_size, mamba_heads, d_state, intermediate_size, num_layers, device=None):
    """A new BambaForCausalLM whose logits equal `model`'s (up to float rounding) with the given sizes.

    hidden_size / mamba_heads must scale by the same factor (mamba_heads * mamba_d_head is the mixer width);
    attention heads scale with hidden_size (head_dim fixed), key/value heads with them; new layers are Mamba
    layers. Returns the model in eval mode, in `model`'s dtype, built directly on `device` (default: `model`'s).
    """
    old = model.config
    if old.model_type != "bamba":
        raise ValueError(f"inflate_bamba takes a bamba model, got {old.model_type!r}")
    factor = hidden_size / old.hidden_size
    if mamba_heads / old.mamba_n_heads != factor or old.mamba_n_groups != 1:
        raise ValueError("hidden_size and mamba_heads must grow by the same factor, with mamba_n_groups = 1 "
                         f"(got x{factor} and x{mamba_heads / old.mamba_n_heads}, groups {old.mamba_n_groups})")
    heads = round(old.num_attention_heads * factor)
    if heads * (old.hidden_size // old.num_attention_heads) != hidden_size or heads % (
            old.num_attention_heads // old.num_key_value_heads):
        raise ValueError(f"hidden_size {hidden_size} must keep the attention head size "
                         f"{old.hidden_size // old.num_attention_heads} and the query/key head ratio")
    if d_state < old.mamba_d_state or intermediate_size < old.intermediate_size or num_layers < old.num_hidden_layers:
        raise ValueError("inflate_bamba only grows sizes")
    config = old.to_dict()
    config.update(hidden_size=hidden_size, mamba_n_heads=mamba_heads, mamba_d_state=d_state,
                  intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                  num_key_value_heads=heads // (old.num_attention_heads // old.num_key_value_heads),
                  rms_norm_eps=old.rms_norm_eps / factor, attn_layer_indices=list(old.attn_layer_indices),
                  layers_block_type=None)
    config.pop("layers_block_type")
    config = transformers.BambaConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    config._attn_implementation = old._attn_implementation
    big = _new_model(transformers.BambaForCausalLM, config, model, device)
    _copy_into(big, model, (old.mamba_n_heads * old.mamba_d_head, old.mamba_d_state, old.mamba_n_heads),
               (mamba_heads * old.mamba_d_head, d_state), factor, ("layernorm.weight", "mamba.norm.weight"))
    return big


def inflate_mamba2(model, *, hidden_size, d_state, num_layers, device=None):
    """A new Mamba2ForCausalLM whose logits equal `model`'s (up to float rounding): hidden_size, and with it the
    mixer's width and heads (expand and head_dim kept), the state size and the layers grown. Needs n_groups = 1.
    Returns the model in eval mode, in `model`'s dtype, built directly on `device` (default: `model`'s)."""
    old = model.config
    if old.model_type != "mamba2":
        raise ValueError(f"inflate_mamba2 takes a mamba2 model, got {old.model_type!r}")
    factor = hidden_size / old.hidden_size
    heads = old.num_heads * factor
    if old.n_groups != 1 or heads != int(heads) or int(heads) * old.head_dim != int(old.expand * hidden_size):
        raise ValueError(f"hidden_size must grow by a factor that keeps whole heads (x{factor}: {heads} heads of "
                         f"{old.head_dim}), with n_groups = 1 (got {old.n_groups})")
    if factor < 1 or d_state < old.state_size or num_layers < old.num_hidden_layers:
        raise ValueError("inflate_mamba2 only grows sizes")
    config = {k: v for k, v in old.to_dict().items() if not k.startswith("_")}
    config.update(hidden_size=hidden_size, num_heads=int(heads), state_size=d_state, num_hidden_layers=num_layers,
                  layer_norm_epsilon=old.layer_norm_epsilon / factor)
    config = transformers.Mamba2Config(**config)
    big = _new_model(transformers.Mamba2ForCausalLM, config, model, device)
    _copy_into(big, model, (old.num_heads * old.head_dim, old.state_size, old.num_heads),
               (int(heads) * old.head_dim, d_state), factor, ("norm.weight", "norm_f.weight"))
    return big


def _new_model(cls, config, model, device):
    """cls(config) in eval mode, its parameters created on `device` (default: `model`'s) in `model`'s dtype: an
    8B-parameter model is built on the GPU in bf16, with no float32 copy in host memory first."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        with torch.device(device if device is not None else model.device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def _copy_into(big, model, mixer, big_mixer, factor, norms):
    """Every parameter of `model` into the corner of `big`'s of the same name, the rest of `big` zeroed. mixer:
    (width I, state N, heads) of model's Mamba2 mixers, big_mixer: (I2, N2) of big's: in_proj rows are
    [gate I | x I | B N | C N | dt heads] and conv channels [x I | B N | C N], each segment moved to its new
    offset. Parameters whose names end with one of `norms` are RMS norm weights, scaled by 1 / sqrt(factor)."""
    (I, N, heads), (I2, N2) = mixer, big_mixer
    proj_segments = ((0, 0, I), (I2, I, I), (2 * I2, 2 * I, N), (2 * I2 + N2, 2 * I + N, N),
                     (2 * I2 + 2 * N2, 2 * I + 2 * N, heads))
    conv_segments = ((0, 0, I), (I2, I, N), (I2 + N2, I + N, N))
    small = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in big.named_parameters():
            p.zero_()
            if name not in small:
                continue
            w = small[name]
            if name.endswith("in_proj.weight"):
                _segments(p, w, proj_segments)
            elif name.endswith(("conv1d.weight", "conv1d.bias")):
                _segments(p, w, conv_segments)
            elif name.endswith(norms):
                p[:w.shape[0]] = w / math.sqrt(factor)
            else:
                p[tuple(slice(0, s) for s in w.shape)] = w


def _segments(new, old, segments):
    """Copy rows old[o:o+n] to new[t:t+n] (other dims: the corner) for each (t, o, n)."""
    for target, source, n in segments:
        new[(slice(target, target + n), *(slice(0, s) for s in old.shape[1:]))] = old[source:source + n]
