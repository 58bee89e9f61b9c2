import os

import pytest
import torch
import torch.nn.functional as F
import transformers

import stree
from stree.distill import (Continuations, TokenChunks, TopK, TrainConfig, Trainer, cross_entropy, forward_kl,
                           mamba2_from_transformer, mixture_loss, reverse_kl, student_from_config,
                           student_from_layers, target_continuations)
from stree.models import TreeModel, tiny_model


def test_losses_against_direct_formulas():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    p, q = t.softmax(-1), s.softmax(-1)
    kl_pq = (p * (p.log() - q.log())).sum(-1)
    kl_qp = (q * (q.log() - p.log())).sum(-1)
    torch.testing.assert_close(forward_kl(s, t, mask), kl_pq[mask].mean())
    torch.testing.assert_close(reverse_kl(s, t, mask), kl_qp[mask].mean())
    labels = torch.randint(0, 11, (2, 5), generator=g)
    torch.testing.assert_close(cross_entropy(s, labels, mask), F.cross_entropy(s[mask], labels[mask]))
    # temperature: KL of the softened distributions, times T^2
    soft = (t / 2).softmax(-1)
    kl_soft = (soft * (soft.log() - (s / 2).log_softmax(-1))).sum(-1).mean() * 4
    torch.testing.assert_close(forward_kl(s, t, temperature=2.0), kl_soft)
    # top-k over the whole vocabulary is the dense loss; a smaller k is the KL on the teacher's top-k support
    torch.testing.assert_close(forward_kl(s, TopK.of(t, 11), mask), forward_kl(s, t, mask))
    torch.testing.assert_close(reverse_kl(s, TopK.of(t, 11), mask), reverse_kl(s, t, mask))
    assert forward_kl(t, t).abs() < 1e-6
    top = t.topk(3, dim=-1)
    p_top = top.values.softmax(-1)
    sparse = (p_top * (p_top.log() - s.log_softmax(-1).gather(-1, top.indices))).sum(-1)
    torch.testing.assert_close(forward_kl(s, TopK.of(t, 3), mask), sparse[mask].mean())
    loss, parts = mixture_loss({"forward_kl": 0.5, "cross_entropy": 2.0}, s, t, labels, mask)
    torch.testing.assert_close(loss, 0.5 * forward_kl(s, t, mask) + 2.0 * cross_entropy(s, labels, mask))
    assert set(parts) == {"forward_kl", "cross_entropy"}
    with pytest.raises(ValueError, match="unknown losses"):
        mixture_loss({"l2": 1.0}, s, t, labels)


@pytest.mark.parametrize("family, layers", [("mamba2", [1]), ("bamba", [0, 1]), ("nemotron_h", [3, 1, 2]),
                                            ("granitemoehybrid", [1, 2]), ("falcon_h1", [1])])
def test_student_from_layers_keeps_those_layers(family, layers):
    target = tiny_model(family)
    student = student_from_layers(target, layers)
    target_layers = target.state_dict()
    for key, value in student.state_dict().items():
        if ".layers." in key:
            head, rest = key.split(".layers.", 1)
            index, tail = rest.split(".", 1)
            key = f"{head}.layers.{layers[int(index)]}.{tail}"
        assert torch.equal(value, target_layers[key]), key
    # it is a working model for tree decoding
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = stree.generate(target, prompt, draft_model=student, max_new_tokens=6, eos_token_id=[])
    assert out.shape == (1, 11)
    with pytest.raises(ValueError, match="distinct indices"):
        student_from_layers(target, [0, 0])


def test_student_from_config_shares_vocab_and_embeddings():
    target = tiny_model("bamba")
    student = student_from_config(target, dict(model_type="mamba2", hidden_size=32, num_hidden_layers=1,
                                               num_heads=4, head_dim=16, state_size=8, n_groups=1),
                                  share_embeddings=True)
    assert student.config.vocab_size == target.config.vocab_size
    assert torch.equal(student.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(student.get_output_embeddings().weight, target.get_output_embeddings().weight)
    TreeModel(student)
    with pytest.raises(ValueError, match="hidden sizes must match"):
        student_from_config(target, dict(model_type="mamba2", hidden_size=64, num_hidden_layers=1, num_heads=4,
                                         head_dim=32, state_size=8, n_groups=1), share_embeddings=True)


def test_attention_to_mamba_initialisation():
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    student = mamba2_from_transformer(target)
    for attn, block in zip((layer.self_attn for layer in target.model.layers), student.backbone.layers):
        mixer, d = block.mixer, 8
        w = mixer.in_proj.weight
        inner, state = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
        v = attn.v_proj.weight.view(2, d, 32).repeat_interleave(2, 0).reshape(-1, 32)
        k = attn.k_proj.weight.view(2, d, 32).repeat_interleave(2, 0).reshape(-1, 32)
        assert torch.equal(w[inner:2 * inner], v)
        assert torch.equal(w[2 * inner:2 * inner + state], k)
        assert torch.equal(w[2 * inner + state:2 * inner + 2 * state], attn.q_proj.weight)
        assert torch.equal(mixer.out_proj.weight, attn.o_proj.weight)
    assert student(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)


def test_datasets():
    tokens = torch.arange(23)
    chunks = TokenChunks(tokens, 5)
    assert len(chunks) == 4
    item = chunks[1]
    assert item["input_ids"].tolist() == [5, 6, 7, 8, 9] and item["labels"].tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError):
        TokenChunks(tokens, 30)
    target = tiny_model("mamba2")
    data = target_continuations(target, torch.randint(0, 64, (3, 4)), max_new_tokens=6, temperature=1.0)
    assert isinstance(data, Continuations) and len(data) == 3
    item = data[0]
    assert item["input_ids"].shape == (9,) and item["mask"].tolist() == [False] * 3 + [True] * 6


def small_setup(steps, output_dir, batch_size=4, **overrides):
    torch.manual_seed(0)
    target = tiny_model("bamba", seed=1)
    student = tiny_model("mamba2", seed=2)
    tokens = torch.randint(0, 64, (600,), generator=torch.Generator().manual_seed(3))
    config = TrainConfig(output_dir=str(output_dir), steps=steps, batch_size=batch_size, lr=3e-3, warmup=2,
                         progress=False, log_every=1, **overrides)
    return target, student, TokenChunks(tokens, 12), config


def test_distillation_lowers_the_kl_and_evaluates_tau(tmp_path):
    target, student, data, config = small_setup(40, tmp_path, eval_every=20, eval_new_tokens=8)
    trainer = Trainer(student, config, data, teacher=target, eval_prompts=torch.randint(0, 64, (2, 5)))
    history = trainer.train()
    first, last = history[0]["forward_kl"], history[-1]["forward_kl"]
    assert last < 0.5 * first, (first, last)
    assert [h["step"] for h in history if "tau" in h] == [20, 40] and all(h["tau"] >= 1 for h in history if "tau" in h)
    final = os.path.join(tmp_path, "final")
    assert os.path.exists(os.path.join(final, "model.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(final)
    torch.testing.assert_close(reloaded.state_dict(), student.state_dict())


def test_language_model_training_with_cross_entropy_and_accumulation(tmp_path):
    _, student, data, config = small_setup(30, tmp_path, losses={"cross_entropy": 1.0}, grad_accum=2)
    history = Trainer(student, config, data).train()
    assert history[-1]["cross_entropy"] < history[0]["cross_entropy"] - 0.3


def test_resume_continues_exactly(tmp_path):
    _, straight, data, config = small_setup(8, tmp_path / "a")
    Trainer(straight, config, data, teacher=tiny_model("bamba", seed=1)).train()
    _, checkpointed, data, config = small_setup(8, tmp_path / "b", save_every=4)
    Trainer(checkpointed, config, data, teacher=tiny_model("bamba", seed=1)).train()
    _, resumed, data, config = small_setup(8, tmp_path / "c")
    trainer = Trainer(resumed, config, data, teacher=tiny_model("bamba", seed=1))
    trainer.resume(os.path.join(tmp_path / "b", "checkpoint-4"))
    assert trainer.step == 4
    trainer.train()
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict())


def _ddp_worker(rank, world, init_file, output_dir, result_file):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    target, student, data, config = small_setup(6, output_dir, batch_size=2)
    Trainer(student, config, data, teacher=target).train()
    if rank == 0:
        torch.save(student.state_dict(), result_file)
    dist.destroy_process_group()


def test_two_gloo_processes_equal_one_process_on_the_same_global_batch(tmp_path):
    import torch.multiprocessing as mp
    result = str(tmp_path / "ddp.pt")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "ddp"), result), nprocs=2, join=True)
    target, single, data, config = small_setup(6, tmp_path / "single", batch_size=4)
    Trainer(single, config, data, teacher=target).train()
    torch.testing.assert_close(torch.load(result), single.state_dict(), rtol=1e-5, atol=1e-6)
