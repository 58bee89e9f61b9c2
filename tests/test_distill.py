import os

import pytest
import torch
import torch.nn.functional as F
import transformers

import stree
from stree.distill import (Continuations, TokenChunks, TopK, TrainConfig, Trainer, config_from_dict, cross_entropy,
                           forward_kl, mamba2_from_transformer, mixture_loss, random_windows, reverse_kl,
                           student_from_config, student_from_layers, target_continuations)
from stree.models import tiny_model


def hf_greedy(model, prompt, new_tokens):
    """HF's own greedy search, EOS off, every prompt position attended (without a mask HF takes the pad id, 0 in
    the tiny models, for padding)."""
    model.generation_config.eos_token_id = None
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens)


@torch.no_grad()
def oracle_tau(target, draft, prompts, new_tokens, branching):
    """Mean tokens per target pass of greedy decoding with a static tree, counted without stree: on the target's
    greedy continuation (HF's), a pass at position `pos` accepts level d while the target's token there is among the
    draft's top-branching[d] given the tokens before it (one HF forward of the draft), and emits the accepted drafts
    plus the target's own token, at most what is left; the first new token comes from the prefill, not a pass."""
    counts = []
    for prompt in prompts:
        sequence = hf_greedy(target, prompt[None], new_tokens)[0]
        ranked = draft(sequence[None]).logits[0]
        start, pos = prompt.numel(), 1
        while pos < new_tokens:
            accepted = 0
            for depth, width in enumerate(branching):
                i = start + pos + depth
                if pos + depth >= new_tokens or sequence[i] not in ranked[i - 1].topk(width).indices:
                    break
                accepted += 1
            counts.append(min(accepted + 1, new_tokens - pos))
            pos += counts[-1]
    return sum(counts) / len(counts)


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


def test_cross_entropy_ignores_labels_where_the_mask_is_off():
    """Masked-out positions do not count, whatever their label (HF's -100 included); counted ones must be ids."""
    g = torch.Generator().manual_seed(0)
    s, labels = torch.randn(1, 4, 11, generator=g), torch.tensor([[3, 7, 1, 2]])
    mask = torch.tensor([[True, True, False, True]])
    expected = F.cross_entropy(s[mask], labels[mask])
    torch.testing.assert_close(cross_entropy(s, labels.masked_fill(~mask, -100), mask), expected)
    torch.testing.assert_close(cross_entropy(s, labels.masked_fill(~mask, 50), mask), expected)
    with pytest.raises(ValueError, match=r"labels holds token id -100, outside the model's vocabulary of 11 ids"):
        cross_entropy(s, labels.masked_fill(~mask, -100))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_losses_reject_a_temperature_that_is_not_positive_and_finite(temperature):
    s, t = torch.randn(1, 3, 11), torch.randn(1, 3, 11)
    for loss in (forward_kl, reverse_kl):
        with pytest.raises(ValueError, match=f"temperature must be a finite number > 0.0, got {temperature}"):
            loss(s, t, temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be"):
        mixture_loss({"forward_kl": 1.0}, s, t, None, temperature=temperature)


def test_losses_reject_mismatched_vocabularies_ids_and_weights():
    s, labels = torch.randn(1, 3, 11), torch.tensor([[1, 2, 11]])
    with pytest.raises(ValueError, match=r"teacher logits \(1, 3, 12\) and student logits \(1, 3, 11\) differ"):
        forward_kl(s, torch.randn(1, 3, 12))
    with pytest.raises(ValueError, match=r"top-k indices holds token id 20, outside the model's vocabulary of 11 ids"):
        reverse_kl(s, TopK(torch.randn(1, 3, 2), torch.full((1, 3, 2), 20)))
    with pytest.raises(ValueError, match=r"labels holds token id 11, outside the model's vocabulary of 11 ids \(0..10\)"):
        cross_entropy(s, labels)
    with pytest.raises(ValueError, match="teacher top-k must be an int >= 1, got 0"):
        TopK.of(s, 0)
    with pytest.raises(ValueError, match="the weight of forward_kl must be a finite number >= 0.0, got nan"):
        mixture_loss({"forward_kl": float("nan")}, s, s, None)
    with pytest.raises(ValueError, match="non-empty dict"):
        mixture_loss({}, s, s, None)
    with pytest.raises(ValueError, match="every loss weight is 0"):
        mixture_loss({"forward_kl": 0.0}, s, s, None)


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
    # it is a working draft for tree decoding: greedy output is HF's greedy search of the target, token for token
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = stree.generate(target, prompt, draft_model=student, max_new_tokens=6, eos_token_id=[])
    assert out.tolist() == hf_greedy(target, prompt, 6).tolist()
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
    prompt = torch.tensor([[2, 7, 1, 8]])
    out = stree.generate(target, prompt, draft_model=student, max_new_tokens=8, tree=(2, 2), eos_token_id=[])
    assert out.tolist() == hf_greedy(target, prompt, 8).tolist()
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
    # as a draft of its Transformer: greedy output is the target's HF greedy search, token for token
    prompt = torch.tensor([[1, 2, 3]])
    out = stree.generate(target, prompt, draft_model=student.eval(), max_new_tokens=8, eos_token_id=[])
    assert out.tolist() == hf_greedy(target, prompt, 8).tolist()


def test_student_from_config_rejects_bad_dicts():
    target = tiny_model("mamba2")
    good = dict(model_type="mamba2", hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, state_size=8,
                n_groups=1)
    assert config_from_dict(good).hidden_size == 32
    with pytest.raises(ValueError, match=r"needs a \"model_type\".*got keys \['hidden_size'\]"):
        student_from_config(target, dict(hidden_size=32))
    with pytest.raises(ValueError, match="unknown model_type 'mambo'"):
        student_from_config(target, dict(good, model_type="mambo"))
    with pytest.raises(ValueError, match=r"unknown keys \['expnd', 'hidden_sise'\] for model_type 'mamba2'"):
        student_from_config(target, dict(good, hidden_sise=32, expnd=2))  # HF would have kept the typos silently
    with pytest.raises(ValueError, match="must be a dict or an HF config, got list"):
        student_from_config(target, [("model_type", "mamba2")])


def test_datasets():
    tokens = torch.arange(23)
    chunks = TokenChunks(tokens, 5)
    assert len(chunks) == 4
    item = chunks[1]
    assert item["input_ids"].tolist() == [5, 6, 7, 8, 9] and item["labels"].tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match=r"at least 31 tokens, got shape \(23,\)"):
        TokenChunks(tokens, 30)
    target = tiny_model("mamba2")
    prompts = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(0))
    data = target_continuations(target, prompts, max_new_tokens=6, temperature=1.0)
    assert isinstance(data, Continuations) and len(data) == 3
    item = data[0]
    assert item["input_ids"][:4].tolist() == prompts[0].tolist() and item["input_ids"].shape == (9,)
    assert item["labels"][:-1].tolist() == item["input_ids"][1:].tolist()
    assert item["mask"].tolist() == [False] * 3 + [True] * 6
    # greedy (temperature 0): each new token is the target's argmax after the tokens before it (one full forward),
    # EOS excluded: the continuations all run to max_new_tokens
    greedy = target_continuations(target, prompts, max_new_tokens=6, temperature=0.0, batch_size=2)
    for i, prompt in enumerate(prompts):
        sequence = torch.cat([greedy[i]["input_ids"], greedy[i]["labels"][-1:]])
        assert sequence[:4].tolist() == prompt.tolist()
        with torch.no_grad():
            logits = target(sequence[None]).logits[0, 3:-1]
        logits[:, target.config.eos_token_id] = -float("inf")
        assert sequence[4:].tolist() == logits.argmax(-1).tolist()


def test_datasets_reject_bad_arguments():
    tokens = torch.arange(40)
    with pytest.raises(ValueError, match="length must be an int >= 1, got 0"):
        TokenChunks(tokens, 0)
    with pytest.raises(ValueError, match="tokens must be integer token ids, got dtype torch.float32"):
        TokenChunks(tokens.float(), 5)
    with pytest.raises(ValueError, match="length must be an int >= 1, got 0"):
        random_windows(tokens, 2, 0)
    with pytest.raises(ValueError, match="count must be an int >= 1, got -1"):
        random_windows(tokens, -1, 4)
    with pytest.raises(ValueError, match=r"same length, got lengths \[5, 6\]"):
        Continuations([torch.arange(5), torch.arange(6)], 2)
    with pytest.raises(ValueError, match="prompt_length 5 leaves no continuation in sequences of 5 tokens"):
        Continuations([torch.arange(5)], 5)
    target = tiny_model("mamba2")
    prompts = torch.randint(0, 64, (2, 3))
    with pytest.raises(ValueError, match=r"prompts holds token id 64, outside the model's vocabulary of 64 ids \(0..63\)"):
        target_continuations(target, prompts.clone().fill_(64), 2)
    with pytest.raises(ValueError, match=r"non-empty \(n, P\) tensor of token ids, got \(3,\)"):
        target_continuations(target, prompts[0], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        target_continuations(target, prompts, 0)
    for temperature in (float("nan"), -1.0):  # both used to decode greedily without a word
        with pytest.raises(ValueError, match=f"temperature must be a finite number >= 0.0, got {temperature}"):
            target_continuations(target, prompts, 2, temperature=temperature)


def small_setup(steps, output_dir, batch_size=4, **overrides):
    torch.manual_seed(0)
    target = tiny_model("bamba", seed=1)
    student = tiny_model("mamba2", seed=2)
    tokens = torch.randint(0, 64, (600,), generator=torch.Generator().manual_seed(3))
    config = TrainConfig(**{**dict(output_dir=str(output_dir), steps=steps, batch_size=batch_size, lr=3e-3, warmup=2,
                                   progress=False, log_every=1), **overrides})
    return target, student, TokenChunks(tokens, 12), config


def test_distillation_lowers_the_kl_and_evaluates_tau(tmp_path):
    target, student, data, config = small_setup(40, tmp_path, eval_every=20, eval_new_tokens=8)
    prompts = torch.randint(0, 64, (2, 5))
    trainer = Trainer(student, config, data, teacher=target, eval_prompts=prompts)
    history = trainer.train()
    first, last = history[0]["forward_kl"], history[-1]["forward_kl"]
    assert last < 0.5 * first, (first, last)
    taus = [h["tau"] for h in history if "tau" in h]
    assert [h["step"] for h in history if "tau" in h] == [20, 40] and 1 <= taus[0] <= len(config.eval_tree) + 1
    assert taus[1] == pytest.approx(oracle_tau(target, student.eval(), prompts, 8, config.eval_tree), abs=1e-12)
    final = os.path.join(tmp_path, "final")
    assert os.path.exists(os.path.join(final, "model.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(final)
    torch.testing.assert_close(reloaded.state_dict(), student.state_dict())


def test_distillation_raises_tau(tmp_path):
    """A confident target (its LM head scaled up, so its greedy tokens carry the mass) and a fresh student: 40 steps
    of forward KL lift tau, as the trainer evaluates it, from about 1 (the draft almost never right) to well above;
    before and after, the trainer's tau is the count oracle_tau makes without stree. (Config seeds 0-4 all gave a
    rise of 0.47 to 0.97, here 1.0 -> 1.875.)"""
    target, student, data, config = small_setup(40, tmp_path, lr=1e-2, eval_every=40, eval_new_tokens=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    prompts = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(10))
    trainer = Trainer(student, config, data, teacher=target, eval_prompts=prompts)
    before = trainer.evaluate()
    assert before == pytest.approx(oracle_tau(target, student.eval(), prompts, 16, config.eval_tree), abs=1e-12)
    after = trainer.train()[-1]["tau"]
    assert after == pytest.approx(oracle_tau(target, student.eval(), prompts, 16, config.eval_tree), abs=1e-12)
    assert before + 0.3 < after <= len(config.eval_tree) + 1, (before, after)


def test_train_config_and_trainer_reject_bad_values(tmp_path):
    for field, value, message in [("steps", 0, "steps must be an int >= 1, got 0"),
                                  ("batch_size", -1, "batch_size must be an int >= 1, got -1"),
                                  ("grad_accum", 0, "grad_accum must be an int >= 1, got 0"),
                                  ("lr", 0.0, "lr must be a finite number > 0.0, got 0.0"),
                                  ("lr", float("nan"), "lr must be a finite number > 0.0, got nan"),
                                  ("temperature", 0.0, "temperature must be a finite number > 0.0, got 0.0"),
                                  ("temperature", float("nan"), "temperature must be a finite number > 0.0, got nan"),
                                  ("warmup", -1, "warmup must be an int >= 0, got -1"),
                                  ("teacher_top_k", -1, "teacher_top_k must be an int >= 0, got -1"),
                                  ("min_lr_ratio", 2.0, r"min_lr_ratio must be in \[0, 1\], got 2.0"),
                                  ("mixed_precision", "fp8", "must be auto, no, bf16 or fp16, got 'fp8'"),
                                  ("losses", {"l2": 1.0}, r"unknown losses \['l2'\]")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(output_dir=str(tmp_path), **{field: value})
    target, student, data, config = small_setup(2, tmp_path)
    with pytest.raises(ValueError, match=r"losses \['forward_kl'\] need a teacher"):
        Trainer(student, config, data)
    with pytest.raises(ValueError, match="eval_every=1 needs a teacher and eval_prompts"):
        Trainer(student, TrainConfig(output_dir=str(tmp_path), eval_every=1), data, teacher=target)
    with pytest.raises(ValueError, match=r"eval_prompts holds token id 64, outside the model's vocabulary of 64 ids"):
        Trainer(student, config, data, teacher=target, eval_prompts=torch.full((1, 3), 64))
    wide = tiny_model("mamba2", vocab_size=100)
    with pytest.raises(ValueError, match=r"student's vocabulary \(100\) differs from the teacher's \(64\)"):
        Trainer(wide, config, data, teacher=target)
    # ids outside the vocabulary in the data: found in the first batch, before the embedding's IndexError
    tokens = torch.randint(0, 64, (600,), generator=torch.Generator().manual_seed(3))
    for bad in (64, -1):
        trainer = Trainer(student, config, TokenChunks(tokens.masked_fill(tokens % 4 == 0, bad), 12), teacher=target)
        with pytest.raises(ValueError, match=f"a batch of the dataset holds token id {bad}, outside the model's vocabulary of "
                                             "64 ids"):
            trainer.train()


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
