"""Tiny random configs of the supported families, for tests, benchmarks and examples (no download)."""
import torch
import transformers

# Each: config class name, model class name, config kwargs (hidden 32, vocab 64, 2-4 layers; every hybrid has at
# least one attention layer; mamba2, mamba and falcon_mamba have none).
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
    # Mamba1 selective scan
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4,
        initializer_range=0.5)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4,
        mixer_rms_eps=1e-6, initializer_range=0.3)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)),
    "zamba": ("ZambaConfig", "ZambaForCausalLM", dict(  # Mamba1 with per-head x_proj / dt_proj (2 heads)
        vocab_size=64, hidden_size=32, attention_hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_attention_heads=4, num_key_value_heads=4,
        attention_head_dim=16, n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        initializer_range=0.3)),
    # Gated DeltaNet (qwen3_5 / qwen3_5_moe: the text models AutoModelForCausalLM loads for those checkpoints)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, mlp_only_layers=[0, 2],
        layer_types=["linear_attention", "full_attention", "linear_attention"])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"])),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, pad_token_id=0,
        eos_token_id=1, layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # Kimi Delta Attention (KDA: per-channel decay) with MLA attention
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "dense"])),
    # short convolutions
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=True, initializer_range=0.5,
        layer_types=["conv", "full_attention", "conv"])),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, layer_types=["conv", "full_attention"])),
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
