"""Tiny random configs of the supported families, for tests, benchmarks and examples (no download)."""
import torch
import transformers

# Each: config class name, model class name, config kwargs (hidden 32, vocab 64, 2-4 layers; every hybrid has at
# least one attention layer, mamba2 has none).
TINY_CONFIGS = {
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=2,
        expand=2, conv_kernel=4, chunk_size=16)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=64, hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, ssm_state_size=8,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=16)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=48, position_embedding_type="rope", mamba_n_heads=4,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        embedding_multiplier=2.0, logits_scaling=1.5, residual_multiplier=0.7, attention_multiplier=0.3)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, mamba_rms_norm=True, lm_head_multiplier=0.8,
        embedding_multiplier=1.3, key_multiplier=0.9, attention_out_multiplier=0.7, attention_in_multiplier=1.1,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], ssm_in_multiplier=0.95, ssm_out_multiplier=1.2,
        mlp_multipliers=[1.1, 0.9])),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=16,
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=4, num_mem_blocks=1,
        use_shared_attention_adapter=True, adapter_rank=4)),
}


def tiny_model(family, *, dtype=torch.float32, seed=0, **overrides):
    """A randomly initialised tiny model of `family` (a key of TINY_CONFIGS), in eval mode.

    Weights come from the model's own initialiser under torch.manual_seed(seed); then every parameter gets a
    small random perturbation so that no tensor is left at a constant (e.g. D = 1, norm weights = 1).
    """
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {sorted(TINY_CONFIGS)}")
    config_name, model_name, kwargs = TINY_CONFIGS[family]
    config = getattr(transformers, config_name)(**{**kwargs, **overrides})
    config._experts_implementation = "eager"  # the grouped-GEMM experts path has no float64 kernel
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()
