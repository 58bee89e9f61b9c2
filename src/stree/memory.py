"""The memory a round of tree verification holds, computed from a model's config: stree's per-node tensors against
keeping a full recurrent-state snapshot per tree node (SGLang's way for hybrid models) or per draft position
(vLLM's way, which verifies chains).

stree keeps no state per node. For Mamba2 layers it keeps each node's pre-conv and post-conv inputs and its dt
(the accepted path's state follows in closed form at the commit); for Gated DeltaNet it keeps each node's
normalised key, log decay and delta-rule write (the path's state is recomputed from them). A snapshot scheme keeps,
per node or position, the layer's whole SSM state (heads x head_dim x d_state, in fp32 as HF caches it) and conv
state. All three hold the tree's attention K/V alike; `round_bytes` counts them in every scheme.

    round_bytes(config, batch=64, nodes=16, depth=6)   # {"stree": ..., "per_node_snapshot": ..., ...}
    print(memory_table())                              # the README's table: three ~8B hybrids at B = 1, 16, 64
"""
from dataclasses import dataclass

import torch

STATE_BYTES = 4  # HF caches these families' SSM / delta-rule states in fp32


@dataclass(frozen=True)
class LayerCounts:
    """What tree verification memory depends on, per family: Mamba2 layers (heads, head_dim, groups, d_state),
    Gated DeltaNet layers (key heads, key dim, value heads, value dim), the conv kernel, attention layers (kv heads,
    head dim)."""
    mamba2: int = 0
    mamba2_dims: tuple = (0, 0, 0, 0)
    gated_delta: int = 0
    gated_delta_dims: tuple = (0, 0, 0, 0)
    conv_kernel: int = 4
    attention: int = 0
    attention_dims: tuple = (0, 0)


def layer_counts(config):
    """LayerCounts of an HF config of the nemotron_h, falcon_h1, qwen3_next or qwen3_5 families (ValueError for
    others)."""
    kind = config.model_type
    if kind not in ("nemotron_h", "falcon_h1", "qwen3_next", "qwen3_5", "qwen3_5_text"):
        raise ValueError(f"no memory formula for model type {kind!r} (nemotron_h, falcon_h1, qwen3_next, qwen3_5)")
    kv = (config.num_key_value_heads, getattr(config, "head_dim", None)
          or config.hidden_size // config.num_attention_heads)
    if kind == "nemotron_h":
        types = config.layers_block_type
        return LayerCounts(mamba2=types.count("linear_attention"), conv_kernel=config.conv_kernel,
                           mamba2_dims=(config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                                        config.ssm_state_size),
                           attention=types.count("full_attention"), attention_dims=kv)
    if kind == "falcon_h1":  # every layer holds an attention and a Mamba2 mixer side by side
        return LayerCounts(mamba2=config.num_hidden_layers, conv_kernel=config.mamba_d_conv,
                           mamba2_dims=(config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                                        config.mamba_d_state),
                           attention=config.num_hidden_layers, attention_dims=kv)
    types = config.layer_types
    return LayerCounts(gated_delta=types.count("linear_attention"), conv_kernel=config.linear_conv_kernel_dim,
                       gated_delta_dims=(config.linear_num_key_heads, config.linear_key_head_dim,
                                         config.linear_num_value_heads, config.linear_value_head_dim),
                       attention=types.count("full_attention"), attention_dims=kv)


def per_node_bytes(counts, dtype_bytes):
    """Bytes stree keeps per tree node and batch row, over all recurrent layers (the compute dtype of the
    delta-rule factors: fp32 for 16-bit models, else the model's)."""
    heads, head_dim, groups, d_state = counts.mamba2_dims
    mamba2 = (2 * (heads * head_dim + 2 * groups * d_state) + heads) * dtype_bytes  # xbc, conv, dt
    hk, dk, hv, dv = counts.gated_delta_dims
    compute = max(dtype_bytes, 4)
    gated_delta = (2 * hk * dk + hv * dv) * dtype_bytes + (hk * dk + hv + hv * dv) * compute  # qkv; k, g, u
    return counts.mamba2 * mamba2 + counts.gated_delta * gated_delta


def state_bytes(counts, dtype_bytes):
    """Bytes of one batch row's recurrent state over all layers: SSM state (fp32) and conv state (K columns)."""
    heads, head_dim, groups, d_state = counts.mamba2_dims
    mamba2 = heads * head_dim * d_state * STATE_BYTES + (heads * head_dim + 2 * groups * d_state) * \
        counts.conv_kernel * dtype_bytes
    hk, dk, hv, dv = counts.gated_delta_dims
    gated_delta = hv * dk * dv * STATE_BYTES + (2 * hk * dk + hv * dv) * counts.conv_kernel * dtype_bytes
    return counts.mamba2 * mamba2 + counts.gated_delta * gated_delta


def kv_bytes(counts, dtype_bytes):
    """Bytes of one node's attention K/V over all attention layers, one batch row."""
    kv_heads, head_dim = counts.attention_dims
    return counts.attention * 2 * kv_heads * head_dim * dtype_bytes


def round_bytes(config, *, batch, nodes=16, depth=6, dtype=torch.bfloat16):
    """{scheme: bytes} a verification round holds at `batch` rows for trees of `nodes` nodes (chains of `depth`
    positions for the per-position scheme): "stree" (per-node inputs), "per_node_snapshot" (a full state per tree
    node), "per_position_snapshot" (a full state per chain position); each plus the nodes' attention K/V."""
    counts, size = layer_counts(config), torch.empty((), dtype=dtype).element_size()
    kv = kv_bytes(counts, size)
    return {"stree": batch * nodes * (per_node_bytes(counts, size) + kv),
            "per_node_snapshot": batch * nodes * (state_bytes(counts, size) + kv),
            "per_position_snapshot": batch * depth * (state_bytes(counts, size) + kv)}


def example_configs():
    """{name: HF config} of three ~8B hybrids' shapes (built from config classes: nothing is downloaded)."""
    from transformers import FalconH1Config, NemotronHConfig, Qwen3_5TextConfig
    return {
        "Qwen3.5-9B-like (24 Gated DeltaNet + 8 attention layers)": Qwen3_5TextConfig(
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
            linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8),
        "Nemotron-H-8B-like (24 Mamba2 + 4 attention layers)": NemotronHConfig(
            hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
            mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4,
            layers_block_type=(["linear_attention", "mlp"] * 6 + ["full_attention", "mlp"]) * 2
            + ["linear_attention", "mlp"] * 12),
        "Falcon-H1-7B-like (44 layers, each Mamba2 + attention)": FalconH1Config(
            hidden_size=3072, num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
            mamba_n_heads=24, mamba_d_head=256, mamba_d_ssm=6144, mamba_n_groups=1, mamba_d_state=256,
            mamba_d_conv=4),
    }


def memory_table(batches=(1, 16, 64), nodes=16, depth=6):
    """A markdown table of round_bytes for example_configs() in bf16 (MiB), and how many times less stree holds."""
    lines = [f"| model | B | stree (MiB) | per-node snapshots (MiB) | per-position snapshots, {depth}-chain (MiB) | "
             "per-node / stree |", "|---|---|---|---|---|---|"]
    for name, config in example_configs().items():
        for batch in batches:
            b = round_bytes(config, batch=batch, nodes=nodes, depth=depth)
            lines.append(f"| {name} | {batch} | {b['stree'] / 2**20:.1f} | {b['per_node_snapshot'] / 2**20:.1f} | "
                         f"{b['per_position_snapshot'] / 2**20:.1f} | "
                         f"{b['per_node_snapshot'] / b['stree']:.1f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"Memory a tree verification round holds ({16}-node trees, bf16):\n")
    print(memory_table())
