"""Training draft heads (stree.distill.heads): the unrolled mask and forward against naive sequential definitions,
the trainer's checkpoints, training that raises the head's acceptance, the bundled head, and inflation."""
import pytest
import torch

import stree
from stree.distill import TokenChunks, TrainConfig
from stree.distill.heads import HeadTrainer, head_loss, target_outputs, unrolled_head, unrolled_visibility
from stree.heads import DraftHead, new_head
from stree.heads.inflate import inflate_head
from stree.models import inflate_bamba, tiny_model


def naive_visibility(entries, steps):
    """Row (s, t) sees the true entries a draft s levels below a root at t - s sees, and its own path."""
    allowed = torch.zeros(steps * entries, steps * entries, dtype=torch.bool)
    for s in range(steps):
        for t in range(entries):
            row = s * entries + t
            for u in range(t - s + 1):
                allowed[row, u] = True            # step 0 (true features) up to the root t - s
            for k in range(1, s + 1):             # the draft path below the root: level k at entry t - s + k
                if t - s + k >= 0:
                    allowed[row, k * entries + t - s + k] = True
            allowed[row, row] = True
    return allowed


@pytest.mark.parametrize("entries, steps", [(1, 1), (5, 1), (6, 3), (4, 4)])
def test_unrolled_visibility_is_the_drafting_attention(entries, steps):
    assert torch.equal(unrolled_visibility(entries, steps), naive_visibility(entries, steps))


def sequential_step(head, tokens, features, step, t):
    """The head's logits at entry t of unroll step `step`, walked as drafting walks it: the true entries up to the
    root t - step, then `step` levels each fed the level before's output hidden state (DraftHead.forward, causal)."""
    root = t - step
    ids, feats, own = tokens[:, :root + 1], features[:, :root + 1], []
    logits, hidden = head(ids, feats)
    for level in range(1, step + 1):
        ids = torch.cat([ids, tokens[:, root + level:root + level + 1]], 1)
        own.append(hidden[:, -1:])
        logits, hidden = head(ids, feats, torch.cat(own, 1))
    return logits[:, -1]


@pytest.mark.parametrize("family, seed, feature_layers", [("bamba", 0, None), ("qwen3_5", 1, None),
                                                          ("mamba2", 2, None), ("qwen3_5", 3, (2, 0, 1))])
def test_unrolled_head_equals_sequential_drafting(family, seed, feature_layers):
    target = tiny_model(family, dtype=torch.float64, seed=seed)
    torch.manual_seed(seed)
    head = new_head(target, feature_layers=feature_layers)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 64, (2, 9), generator=g)
    _, _, features = target_outputs(target, tokens, head.feature_layers)
    with torch.no_grad():
        logits, _ = unrolled_head(head, tokens[:, 1:], features[:, :-1], steps=3)
        for step in range(3):
            for t in range(step, 8):
                want = sequential_step(head, tokens[:, 1:], features[:, :-1], step, t)
                torch.testing.assert_close(logits[step][:, t], want, atol=1e-6, rtol=1e-6)


def test_target_features_are_the_named_layers_outputs():
    """The features of a head reading layers (2, 0) of a 4-layer target, from training's target_outputs and from a
    TreeModel's prefill and tree pass, are those layers' outputs in that order: HF's hidden_states[3] then [1] (a
    forward with output_hidden_states; the tree pass's chain of nodes is the prompt's continuation). The reversed
    order is not (the comparison can fail)."""
    from stree.models import TreeModel
    target = tiny_model("nemotron_h", dtype=torch.float64, seed=4)
    tokens = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = target.base_model(tokens, output_hidden_states=True).hidden_states
    want = torch.cat([states[3], states[1]], -1)
    _, _, features = target_outputs(target, tokens, (2, 0))
    torch.testing.assert_close(features, want)
    assert not torch.allclose(features, torch.cat([states[1], states[3]], -1))
    tree_model = TreeModel(target, returns_hidden=(2, 0))
    _, prefilled = tree_model.prefill(tokens[:, :5])
    _, passed = tree_model.tree_forward(tokens[:, 5:], [[-1, 0, 1, 2]])
    torch.testing.assert_close(torch.cat([prefilled, passed], 1), want)


def test_head_loss_counts_every_step_and_trains_only_the_head():
    target = tiny_model("bamba", dtype=torch.float64, seed=3).requires_grad_(False)  # as HeadTrainer freezes it
    head = new_head(target)
    tokens = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, parts = head_loss(head, target, tokens, steps=2)
    assert loss.requires_grad and set(parts) == {"kl_0", "feature_0", "kl_1", "feature_1"}
    assert all(v > 0 for v in parts.values())
    loss.backward()
    assert all(p.grad is not None for p in head.own_parameters())
    assert target.get_output_embeddings().weight.grad is None


@pytest.fixture(scope="module")
def demo():
    target, _, tokenizer = stree.demo_pair()
    prompts = stree.demo.held_out_prompts(tokenizer, 3, 32, seed=5)
    return target, tokenizer, prompts


def tau(target, head, prompts, new_tokens=32):
    passes = []
    for prompt in prompts:
        _, stats = stree.generate(target, prompt, draft_model=head, max_new_tokens=new_tokens, tree=(3, 2, 2, 1),
                                  eos_token_id=[], return_stats=True)
        passes += stats.tokens_per_pass
    return sum(passes) / len(passes)


@pytest.mark.parametrize("feature_layers", [None, "eagle3"])
def test_training_raises_the_heads_acceptance(demo, tmp_path, feature_layers):
    """60 steps of HeadTrainer on standard-library text raise tau on held-out prompts by at least 0.3 over the
    untrained head (measured: ~1.0 untrained), for a head reading the last hidden state and one reading three
    layers (EAGLE-3's choice); the saved head loads back as it was; a checkpoint resumes where it stopped."""
    target, tokenizer, prompts = demo
    torch.manual_seed(0)
    head = new_head(target, feature_layers=feature_layers)
    before = tau(target, head, prompts)
    from stree.distill.data import stdlib_split, tokenize_files
    tokens = tokenize_files(stdlib_split()[0][:40], tokenizer)
    config = TrainConfig(output_dir=str(tmp_path), steps=60, batch_size=8, lr=3e-3, warmup=10, save_every=30,
                         progress=False)
    trainer = HeadTrainer(head, config, TokenChunks(tokens, 48), target, unroll=2)
    trainer.train()
    after = tau(target, head, prompts)
    assert after > before + 0.3, (before, after)
    loaded = DraftHead.from_pretrained(tmp_path / "final", target=target)
    assert loaded.feature_layers == head.feature_layers
    assert loaded.own_state_dict().keys() == head.own_state_dict().keys()
    for mine, theirs in zip(head.own_state_dict().values(), loaded.own_state_dict().values()):
        torch.testing.assert_close(mine, theirs)
    resumed = HeadTrainer(new_head(target, feature_layers=feature_layers), config, TokenChunks(tokens, 48), target,
                          unroll=2)
    resumed.resume(tmp_path / "checkpoint-30")
    assert resumed.step == 30


def test_the_bundled_head_drafts_better_than_an_untrained_one(demo):
    target, _, prompts = demo
    torch.manual_seed(0)
    untrained = tau(target, new_head(target), prompts)
    trained = tau(target, stree.demo_head(target), prompts)
    assert trained > untrained + 1.0, (untrained, trained)


def test_an_inflated_head_drafts_what_the_small_one_drafts(demo):
    target, _, prompts = demo
    head = stree.demo_head(target)
    sizes = dict(hidden_size=512, mamba_heads=16, d_state=48, intermediate_size=1024)
    big_target = inflate_bamba(target, **sizes, num_layers=7)
    big_head = inflate_head(head, big_target, **sizes)
    ids = prompts[0]
    with torch.no_grad():
        _, small_features, _ = target_outputs(target, ids)
        _, big_features, _ = target_outputs(big_target, ids)
        small, _ = head(ids[:, 1:], small_features[:, :-1])
        big, _ = big_head(ids[:, 1:], big_features[:, :-1])
    torch.testing.assert_close(big, small, atol=2e-4, rtol=1e-4)
    assert sum(p.numel() for p in big_head.own_parameters()) > 3 * sum(p.numel() for p in head.own_parameters())


def head_setup(steps, output_dir, batch_size=4, **config):
    """A tiny float64 bamba target (rounding does not blur the comparisons), a new head for it, random-token chunks
    and a TrainConfig."""
    target = tiny_model("bamba", dtype=torch.float64, seed=1)
    torch.manual_seed(0)
    head = new_head(target)
    tokens = torch.randint(1, 64, (4000,), generator=torch.Generator().manual_seed(2))
    config = TrainConfig(output_dir=str(output_dir), steps=steps, batch_size=batch_size, lr=1e-2, warmup=1,
                         progress=False, **config)
    return target, head, TokenChunks(tokens, 16), config


def test_head_training_resumes_exactly(tmp_path):
    target, straight, data, config = head_setup(6, tmp_path / "a")
    HeadTrainer(straight, config, data, target, unroll=2).train()
    target, checkpointed, data, config = head_setup(6, tmp_path / "b", save_every=3)
    HeadTrainer(checkpointed, config, data, target, unroll=2).train()
    target, resumed, data, config = head_setup(6, tmp_path / "c")
    trainer = HeadTrainer(resumed, config, data, target, unroll=2).resume(tmp_path / "b" / "checkpoint-3")
    assert trainer.step == 3
    trainer.train()
    torch.testing.assert_close(resumed.own_state_dict(), straight.own_state_dict())


def _ddp_head_worker(rank, world, init_file, output_dir, result_file):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    target, head, data, config = head_setup(4, output_dir, batch_size=2)
    HeadTrainer(head, config, data, target, unroll=2).train()
    if rank == 0:
        torch.save({k: v.detach() for k, v in head.own_state_dict().items()}, result_file)
    dist.destroy_process_group()


def test_two_gloo_processes_train_a_head_as_one_process(tmp_path):
    import torch.multiprocessing as mp
    result = str(tmp_path / "ddp.pt")
    mp.spawn(_ddp_head_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "ddp"), result), nprocs=2, join=True)
    target, single, data, config = head_setup(4, tmp_path / "single", batch_size=4)
    HeadTrainer(single, config, data, target, unroll=2).train()
    want = {k: v.detach() for k, v in single.own_state_dict().items()}
    torch.testing.assert_close(torch.load(result), want, rtol=1e-9, atol=1e-10)
