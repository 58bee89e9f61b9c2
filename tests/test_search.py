import pytest
import torch

from loops import plain_vote
from stree.models import tiny_model
from stree.search import ALLOCATIONS, SearchConfig, tree_search
from test_search_speculative import one_thread  # noqa: F401 (autouse fixture: one intra-op thread)


def even_share(prompt, steps):
    """A scripted verifier: the share of even tokens in the latest step."""
    return sum(t % 2 == 0 for t in steps[-1]) / len(steps[-1])


def depth_nodes(trajectories, depth):
    """Search-tree nodes at `depth` (1 = first step) on the paths of the given trajectories."""
    found = set()
    for t in trajectories:
        path = t.ancestors() + [t.node]
        if len(path) > depth:
            found.add(path[depth])
    return found


@pytest.fixture(scope="module")
def policy_model():
    return tiny_model("bamba", dtype=torch.float64, vocab_size=16, seed=3)


@pytest.mark.parametrize("strategy", sorted(ALLOCATIONS))
def test_every_strategy_runs_end_to_end(policy_model, strategy):
    calls = []

    def verifier(prompt, steps):
        calls.append(len(steps))
        return even_share(prompt, steps)

    config = SearchConfig(strategy=strategy, width=9, max_steps=3, step_max_tokens=3, seed=1)
    result = tree_search(policy_model, [1, 2, 3], verifier, config, answer_fn=lambda tokens: tokens[-1] % 3)
    # the answer is the weighted vote of the trajectories' answers, weighted by their last step's score
    assert result.scores == [even_share(None, t.steps) for t in result.trajectories]
    assert result.answer == plain_vote([t.tokens[-1] % 3 for t in result.trajectories], result.scores)
    assert len(result.trajectories) == 9 and all(len(t.steps) == 3 for t in result.trajectories)
    # nothing finishes, so every step spends the width; siblings that drew the same step are scored once
    assert all(1 <= calls.count(d) <= 9 for d in (1, 2, 3)) and result.stats["verifier_calls"] == len(calls)
    assert result.stats["steps"] == 3
    # one search-tree node per distinct step of a parent: copies share its id, different steps never do
    ids = {}
    for t in result.trajectories:
        ids.setdefault((t.parent.node, tuple(t.steps[-1])), set()).add(t.node)
    assert all(len(v) == 1 for v in ids.values()) and len(set.union(*ids.values())) == len(ids)
    if strategy == "beam":
        assert all(len(depth_nodes(result.trajectories, d)) <= 3 for d in (1, 2))
    if strategy == "dvts":
        for group in range(3):
            members = [t for t in result.trajectories if t.group == group]
            assert len(depth_nodes(members, 1)) == 1 and len(depth_nodes(members, 2)) == 1
    if strategy == "best_of_n":
        assert len(depth_nodes(result.trajectories, 1)) == 9  # nine independent chains


def test_ets_node_cost_prunes_more_than_rebase(policy_model):
    def kept_parents(strategy, lambda_b):
        config = SearchConfig(strategy=strategy, width=12, max_steps=3, step_max_tokens=2, lambda_b=lambda_b,
                              lambda_d=0.0, seed=2)
        result = tree_search(policy_model, [5, 6], even_share, config)
        return len(depth_nodes(result.trajectories, 2))
    assert kept_parents("ets", 6.0) < kept_parents("rebase", 0.0)


def test_width_shrinks_as_trajectories_finish(policy_model):
    config = SearchConfig(strategy="rebase", width=8, max_steps=6, step_max_tokens=3, eos_token_ids=(0, 1, 2, 3),
                          seed=3)
    result = tree_search(policy_model, [4, 5], even_share, config)
    assert all(t.finished for t in result.trajectories) and len(result.trajectories) <= 8
    assert result.stats["verifier_calls"] <= 8 * result.stats["steps"]
    assert SearchConfig(strategy="ets").kept == 4


@pytest.mark.parametrize("strategy", ["rebase", "ets", "beam"])
def test_replayed_leaf_states_change_memory_not_results(policy_model, strategy):
    """leaf_states="replay" rebuilds chosen leaves from their parents' snapshots: the same search (same draws, steps,
    scores and answer, float64 policy) with fewer snapshots held."""
    def run(leaf_states):
        config = SearchConfig(strategy=strategy, width=8, max_steps=4, step_max_tokens=3, lambda_b=4.0, seed=4,
                              eos_token_ids=(0, 1), leaf_states=leaf_states)  # some finish early
        return tree_search(policy_model, [3, 1, 4], even_share, config, answer_fn=lambda tokens: tokens[-1] % 3)
    keep, replay = run("keep"), run("replay")
    assert [t.steps for t in keep.trajectories] == [t.steps for t in replay.trajectories]
    assert keep.scores == replay.scores and keep.answer == replay.answer
    assert replay.stats["peak_tree_bytes"] < keep.stats["peak_tree_bytes"]
    # what still holds a cache at the end: keep, the last unfinished leaves; replay, only the last parents
    for result, leaf_states in ((keep, "keep"), (replay, "replay")):
        last = [t for t in result.trajectories if len(t.steps) == result.stats["steps"]]
        allowed = {t.node for t in last if not t.finished} if leaf_states == "keep" else {t.parent.node for t in last}
        held = {a.node for t in result.trajectories for a in t.lineage() if a.state.held}
        assert held <= allowed, leaf_states
    with pytest.raises(ValueError, match="leaf_states"):
        SearchConfig(leaf_states="drop")


def test_ets_keeps_or_prunes_the_copies_of_a_node_together(policy_model):
    """Three copies of one node against single nodes: ETS decides per node (its weight is the copies' sum) and
    shares a kept node's count evenly among its copies."""
    from stree.search.loop import SearchContext, Trajectory, TreeMemory, ets
    from stree.search.policy import Policy
    _, state = Policy(policy_model).prefill([1, 2, 3])
    root = Trajectory(0, None, [], [], state)
    leaves = [Trajectory(1, root, [[5]], [0.5], state) for _ in range(3)]
    leaves += [Trajectory(2, root, [[6]], [0.55], state), Trajectory(3, root, [[7]], [0.1], state)]
    config = SearchConfig(strategy="ets", width=8, lambda_b=0.5, lambda_d=0.0, rebase_temperature=0.2)
    counts = dict(ets(leaves, 8, config, SearchContext(TreeMemory(state), embedder=lambda tokens: [1.0, 0.0])))
    copies = [counts[t] for t in leaves[:3]]
    assert sum(counts.values()) == 8 and max(copies) - min(copies) <= 1
    assert min(copies) > 0 and counts[leaves[4]] == 0  # three copies at 0.5 outweigh one node at 0.55


def test_bad_config():
    with pytest.raises(ValueError, match="strategy must be one of .*'beam', 'best_of_n', 'dvts', 'ets', 'rebase', "
                                         "'spec_beam'.*'mcts'"):
        SearchConfig(strategy="mcts")
    with pytest.raises(ValueError):
        SearchConfig(width=0)
    with pytest.raises(ValueError, match="beam_width"):
        SearchConfig(beam_width=-1)
    for seed in (-1, 2 ** 61, 1.5):  # hash(-1) == hash(-2) in CPython: two seeds would give one search
        with pytest.raises(ValueError, match="seed"):
            SearchConfig(seed=seed)


def test_tree_memory_counts_kv_per_token_and_one_ssm_snapshot_per_leaf(policy_model):
    from stree.search.loop import Trajectory, TreeMemory
    from stree.search.policy import Policy
    config = policy_model.config
    _, root_state = Policy(policy_model).prefill([1, 2, 3, 4])
    memory = TreeMemory(root_state)
    head_dim = config.hidden_size // config.num_attention_heads
    attention_layers = len(config.attn_layer_indices)
    assert memory.kv_per_token == 2 * attention_layers * config.num_key_value_heads * head_dim * 8
    mamba_layers = config.num_hidden_layers - attention_layers
    conv_dim = config.mamba_n_heads * config.mamba_d_head + 2 * config.mamba_n_groups * config.mamba_d_state
    per_layer = (config.mamba_n_heads * config.mamba_d_head * config.mamba_d_state * 4  # fp32 recurrent state
                 + conv_dim * config.mamba_d_conv * 8)
    assert memory.ssm_bytes == mamba_layers * per_layer
    root = Trajectory(0, None, [], [], root_state)
    a = Trajectory(1, root, [[5, 6]], [0.5], root_state)
    b, c = Trajectory(2, a, [[5, 6], [7]], [0.5, 0.1], root_state), Trajectory(3, a, [[5, 6], [8, 9, 1]], [0.5, 0.2], root_state)
    kv = memory.kv_per_token
    assert memory.tree_bytes([b, c]) == pytest.approx(kv * (4 + 2 + 1 + 3) + 2 * memory.ssm_bytes)
    # a finished leaf keeps no snapshot; copies of one node (same id) keep one; holders= names who keeps one
    d = Trajectory(3, a, [[5, 6], [8, 9, 1]], [0.5, 0.2], root_state)
    c.finished = True
    assert memory.tree_bytes([b, c]) == pytest.approx(kv * (4 + 2 + 1 + 3) + 1 * memory.ssm_bytes)
    c.finished = False
    assert memory.tree_bytes([b, c, d]) == pytest.approx(kv * (4 + 2 + 1 + 3) + 2 * memory.ssm_bytes)
    assert memory.tree_bytes([b, c, d], holders=[a]) == pytest.approx(kv * (4 + 2 + 1 + 3) + memory.ssm_bytes)


def test_ets_keeps_less_memory_than_rebase(policy_model):
    def peak(strategy, lambda_b):
        config = SearchConfig(strategy=strategy, width=12, max_steps=3, step_max_tokens=2, lambda_b=lambda_b,
                              lambda_d=0.0, seed=5)
        return tree_search(policy_model, [5, 6], even_share, config).stats["peak_tree_bytes"]
    assert peak("ets", 6.0) < peak("rebase", 0.0)


def test_prm_verifier_scores_the_latest_step_at_its_tag(policy_model):
    from stree.search import PRMVerifier
    prm_model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=8)
    prm = PRMVerifier(prm_model, step_tag_id=15, good_token_id=13, bad_token_id=14)
    score = prm([1, 2], [[3, 4], [5]])
    with torch.no_grad():
        logits = prm_model(torch.tensor([[1, 2, 3, 4, 15, 5, 15]])).logits[0, -1]
    assert 0.0 < score < 1.0 and score == pytest.approx(float(logits[[13, 14]].softmax(-1)[0]))
    result = tree_search(policy_model, [1, 2], prm, SearchConfig(strategy="beam", width=4, max_steps=2,
                                                                 step_max_tokens=2))
    assert len(result.trajectories) == 4


def test_ets_with_an_external_embedder(policy_model):
    seen = []

    def embedder(tokens):
        seen.append(tokens)
        return [float(tokens[-1] % 2), 1.0]  # two clusters: odd and even last tokens

    config = SearchConfig(strategy="ets", width=6, max_steps=2, step_max_tokens=2)
    tree_search(policy_model, [3], even_share, config, embedder=embedder)
    assert len(seen) == 6  # every live trajectory of the one selection round was embedded


@pytest.mark.parametrize("field, value", [
    ("width", 0), ("width", 1.5), ("width", True), ("max_steps", 0), ("max_steps", -2), ("step_max_tokens", 0),
    ("step_max_tokens", -1), ("beam_width", -1), ("beam_width", 2.0), ("temperature", 0.0), ("temperature", -1.0),
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("rebase_temperature", 0.0), ("rebase_temperature", float("nan")), ("lambda_b", -1.0),
    ("lambda_b", float("inf")), ("lambda_d", float("nan")), ("cluster_threshold", float("nan")),
    ("eos_token_ids", (-1,)), ("eos_token_ids", (1.5,)), ("step_delimiter_ids", 4), ("aggregation", "max")])
def test_bad_config_values_name_the_field_and_the_value(field, value):
    """Every numeric setting is checked when the config is made (before, NaN or negative values reached the search:
    a NaN rebase_temperature or cluster_threshold ran silently, step_max_tokens=0 gave one-token steps, a float
    width failed in range(), an unknown aggregation only after the first level was decoded)."""
    with pytest.raises(ValueError, match=field) as error:
        SearchConfig(**{field: value})
    assert repr(value) in str(error.value) or str(value) in str(error.value)


@pytest.fixture
def no_forward(policy_model, monkeypatch):
    """The policy, made to fail any forward pass: the checks below must come first."""
    def forward(*args, **kwargs):
        raise AssertionError("a forward pass ran before the input was checked")
    monkeypatch.setattr(policy_model, "forward", forward)
    return policy_model


@pytest.mark.parametrize("prompt, message", [
    ([1, 16], "prompt 0: .*token id 16, outside the model's vocabulary of 16 ids"),
    ([1, -1], "prompt 0: .*token id -1, outside the model's vocabulary of 16 ids"),
    (torch.tensor([[3, 200]]), "token id 200, outside the model's vocabulary of 16 ids"),
    ([], "prompt 0 is empty"), (torch.zeros(1, 0, dtype=torch.long), "prompt 0 is empty"),
    ([1.5, 2.0], "prompt 0: .*integer"), (torch.tensor([[1, 2], [3, 4]]), r"shape \(2, 2\)")])
def test_bad_prompts_are_refused_before_any_forward(no_forward, prompt, message):
    """Before: HF's embedding raised IndexError (ids out of range, negative ids), float ids a RuntimeError, and a
    (2, P) tensor was silently flattened into one prompt."""
    config = SearchConfig(strategy="rebase", width=2, max_steps=1)
    with pytest.raises(ValueError, match=message):
        tree_search(no_forward, prompt, even_share, config)


def test_bad_token_ids_and_vocabularies_are_refused_before_any_forward(no_forward):
    from stree.search import PRMVerifier, tree_search_batch
    config = SearchConfig(strategy="beam", width=2, max_steps=1)
    with pytest.raises(ValueError, match="prompt 1: .*token id 99, outside the model's vocabulary of 16 ids"):
        tree_search_batch(no_forward, [[1], [2, 99]], even_share, config)
    for field in ("eos_token_ids", "step_delimiter_ids"):  # before: never matched, so silently ignored
        with pytest.raises(ValueError, match=f"{field} holds token id 16, outside the model's vocabulary of 16 ids"):
            tree_search(no_forward, [1], even_share, SearchConfig(width=2, max_steps=1, **{field: (3, 16)}))
    small = tiny_model("mamba2", vocab_size=8, seed=8)  # before: IndexError in the PRM's embedding, mid-search
    prm = PRMVerifier(small, step_tag_id=7, good_token_id=5, bad_token_id=6)
    with pytest.raises(ValueError, match=r"vocabulary \(8 ids\) is smaller than the policy's \(16\)"):
        tree_search(no_forward, [1], prm, config)
    with pytest.raises(ValueError, match="the PRM.s input holds token id 9, outside its vocabulary of 8 ids"):
        prm([1], [[9]])
    with pytest.raises(ValueError, match="step_tag_id is 8, not a token id of the PRM's vocabulary of 8 ids"):
        PRMVerifier(small, step_tag_id=8, good_token_id=5, bad_token_id=6)


@pytest.mark.parametrize("strategy", ["rebase", "spec_beam"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_verifier_scores_are_refused(policy_model, strategy, bad):
    """Before: a NaN score was ranked and allocated silently (every comparison with NaN is False)."""
    config = SearchConfig(strategy=strategy, width=4, beam_width=2, max_steps=2, step_max_tokens=2)
    with pytest.raises(ValueError, match=f"verifier returned the score {bad}"):
        tree_search(policy_model, [1, 2], lambda prompt, steps: bad, config)
