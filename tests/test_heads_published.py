"""Published MTP heads load from a checkpoint folder with the published key names, and compute what the published
math says: a reference forward written here (the fusion, its norms and the concatenation order by hand; the decoder
layers as HF's classes with weights this file places), against DraftHead.from_pretrained's head."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from stree.heads import DraftHead
from stree.models import tiny_model

# family -> (tiny_model overrides giving the target an MTP head in its config, 1 + weight norms?)
LAYOUTS = {
    "qwen3_next": (dict(mtp_num_hidden_layers=1), True),
    "qwen3_5": (dict(mtp_num_hidden_layers=1), True),
    "qwen3_5_moe": (dict(mtp_num_hidden_layers=1), True),
    "nemotron_h": (dict(num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"],
                        n_routed_experts=4, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16), False),
}


def rms_norm(x, weight, eps, plus_one):
    """RMSNorm as published: x / rms(x) * (1 + w) (Qwen's, Gemma-style) or * w (Nemotron-H's)."""
    x = x.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + weight.double()) if plus_one else weight.double())


def layer_model(target, family):
    """A fresh HF model holding the MTP's decoder layers (full attention; Nemotron-H: its mtp block types)."""
    config = target.config.to_dict()
    if family == "nemotron_h":
        config.update(layers_block_type=list(target.config.mtp_layers_block_type), num_nextn_predict_layers=0)
    else:
        config.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    config._experts_implementation = "eager"
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # so that no norm weight is at its initial value
    return model


def published_tensors(target, family, layers):
    """The head's weights under the published names, routed experts one tensor per expert."""
    H, g = target.config.hidden_size, torch.Generator().manual_seed(3)
    rand = lambda *shape: 0.3 * torch.randn(*shape, generator=g, dtype=target.dtype)  # noqa: E731
    out = {}
    for key, value in layers.model.state_dict().items():
        match = re.match(r"layers\.(\d+)\.(.*)", key)
        if match is None:
            continue
        i, rest = match.groups()
        fused = re.match(r"(.*experts\.)(gate_up_proj|up_proj|down_proj)$", rest)
        if fused is None:
            out[f"mtp.layers.{i}.{rest}"] = value.clone()
            continue
        prefix, name = fused.groups()
        for e in range(value.shape[0]):
            if name == "gate_up_proj":  # the gate's rows first
                gate, up = value[e].chunk(2, dim=0)
                out[f"mtp.layers.{i}.{prefix}{e}.gate_proj.weight"] = gate.clone()
                out[f"mtp.layers.{i}.{prefix}{e}.up_proj.weight"] = up.clone()
            else:
                out[f"mtp.layers.{i}.{prefix}{e}.{name}.weight"] = value[e].clone()
    if family == "nemotron_h":
        last = len(target.config.mtp_layers_block_type) - 1
        out.update({"mtp.layers.0.enorm.weight": 1 + rand(H), "mtp.layers.0.hnorm.weight": 1 + rand(H),
                    "mtp.layers.0.eh_proj.weight": rand(H, 2 * H),
                    f"mtp.layers.{last}.final_layernorm.weight": 1 + rand(H)})
    else:
        out.update({"mtp.fc.weight": rand(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": rand(H),
                    "mtp.pre_fc_norm_hidden.weight": rand(H), "mtp.norm.weight": rand(H)})
    return out


def write_checkpoint(folder, target, tensors, sharded):
    """The target saved by HF, plus the MTP tensors in a file of their own (listed in a shard index if sharded)."""
    target.save_pretrained(folder)
    save_file(tensors, os.path.join(folder, "mtp.safetensors"))
    if sharded:
        weight_map = {k: "model.safetensors" for k in target.state_dict()}
        weight_map.update({k: "mtp.safetensors" for k in tensors})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def reference_logits(target, family, tensors, layers, tokens, features, embedding_first=True):
    """The published forward: fc(cat([norm_e(embed(x)), norm_h(f)])) (embedding first), the layers, the final
    norm, the target's LM head. `layers` holds the decoder layers; its final norm is replaced by the published one."""
    plus_one = LAYOUTS[family][1]
    config = target.config
    eps = getattr(config, "rms_norm_eps", None) or config.layer_norm_epsilon
    if family == "nemotron_h":
        w_e, w_h, fc = (tensors[f"mtp.layers.0.{k}.weight"] for k in ("enorm", "hnorm", "eh_proj"))
        w_final = tensors[f"mtp.layers.{len(config.mtp_layers_block_type) - 1}.final_layernorm.weight"]
    else:
        w_e, w_h, fc, w_final = (tensors[f"mtp.{k}.weight"] for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                      "fc", "norm"))
    e = rms_norm(target.get_input_embeddings()(tokens), w_e, eps, plus_one)
    h = rms_norm(features, w_h, eps, plus_one)
    x = (torch.cat([e, h] if embedding_first else [h, e], -1) @ fc.double().T).to(target.dtype)
    final = layers.model.norm_f if family == "nemotron_h" else layers.model.norm
    final.forward = lambda hidden: rms_norm(hidden, w_final, eps, plus_one).to(hidden.dtype)
    hidden = layers.model(inputs_embeds=x).last_hidden_state
    return target.get_output_embeddings()(hidden)


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_published_head_computes_the_published_forward(family, tmp_path):
    overrides, _ = LAYOUTS[family]
    target = tiny_model(family, dtype=torch.float64, seed=1, **overrides)
    layers = layer_model(target, family)
    tensors = published_tensors(target, family, layers)
    write_checkpoint(tmp_path, target, tensors, sharded=family == "qwen3_next")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,  # HF skips mtp.*
                                                  experts_implementation="eager").eval()
    head = DraftHead.from_pretrained(tmp_path, target=loaded)
    assert head.kind.startswith(family) and head.kind.endswith("_mtp")
    assert head.inner.get_input_embeddings() is loaded.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, target.config.vocab_size, (1, 7), generator=g)
    features = torch.randn(1, 7, target.config.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got, _ = head(tokens, features)
        want = reference_logits(loaded, family, tensors, layers, tokens, features)
        swapped = reference_logits(loaded, family, tensors, layers, tokens, features, embedding_first=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # HF's norms compute in float32
    assert not torch.allclose(swapped, want, atol=1e-3)  # the order matters: a swapped concatenation would fail


def test_folders_without_a_head_are_refused(tmp_path):
    target = tiny_model("bamba", seed=1)
    target.save_pretrained(tmp_path / "bamba")
    with pytest.raises(ValueError, match="publishes no MTP head"):
        DraftHead.from_pretrained(tmp_path / "bamba", target=target)
    qwen = tiny_model("qwen3_5", seed=1)
    qwen.save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match="holds no mtp"):
        DraftHead.from_pretrained(tmp_path / "qwen", target=qwen)
    with pytest.raises(ValueError, match="must be a folder"):
        DraftHead.from_pretrained(tmp_path / "nowhere", target=qwen)


def test_mismatched_mtp_weights_are_refused(tmp_path):
    target = tiny_model("qwen3_5", dtype=torch.float64, seed=1, mtp_num_hidden_layers=1)
    tensors = published_tensors(target, "qwen3_5", layer_model(target, "qwen3_5"))
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :-1].contiguous()
    write_checkpoint(tmp_path, target, tensors, sharded=False)
    with pytest.raises(ValueError, match="shapes differ.*fusion.fc.weight"):
        DraftHead.from_pretrained(tmp_path, target=target)


def test_bad_feature_layers_are_refused():
    """new_head's feature_layers: indices of the target's layers, distinct, or "eagle3" for targets of 5+ layers;
    an inflated head must read the last hidden state (inflation adds layers)."""
    from stree.heads import new_head
    from stree.heads.inflate import inflate_head
    target = tiny_model("bamba", dtype=torch.float64)  # 3 layers
    for bad in ([], (0, 0), (3,), (-1,), (True,), (0.0,), "eagle3", "last", 1):
        with pytest.raises(ValueError, match="feature_layers|eagle3"):
            new_head(target, feature_layers=bad)
    assert new_head(target, feature_layers=[2, 0]).feature_layers == (2, 0)
    deep = tiny_model("bamba", dtype=torch.float64, num_hidden_layers=6, attn_layer_indices=[3])
    head = new_head(deep, feature_layers="eagle3")
    assert head.feature_layers == (1, 3, 4) and head.feature_size == 3 * deep.config.hidden_size
    with pytest.raises(ValueError, match="feature_layers"):  # refused before anything is inflated
        inflate_head(head, deep, hidden_size=64, mamba_heads=8, d_state=32, intermediate_size=128)
