"""Every strategy on batched rows against a plain sequential reference, and what the rows really hold."""
import weakref

import pytest
import torch

from loops import plain_vote
from stree.models.rows import RowBatch, RowState
from stree.models import tiny_model
from stree.search import (ALLOCATIONS, SearchConfig, TreeMemory, candidate_generator, cluster_embeddings, ets_select,
                          rebase_allocation, tree_search, tree_search_batch)
from test_search_speculative import hashed, one_thread, policy_model  # noqa: F401 (fixtures)


def shares(total, parts):
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def reference_search(model, prompt, verifier, config):
    """The level-synchronous search written out plainly, one candidate at a time: every token re-reads the prompt
    and the candidate's tokens through the model (one full forward, no cache, no batching, no merging) and is drawn
    from the candidate's own generator, candidate_generator(seed, key), where the j-th continuation of a trajectory
    with key k has key k + (j,). Children of a step are ordered by key. A step ends at a delimiter, EOS or
    step_max_tokens tokens; a search-tree node is a distinct path of steps. Allocation as the strategies define
    it: best_of_n one each, beam the k best (stable by key order) with equal shares, rebase rebase_allocation, ets
    ets_select over distinct nodes (embedding: the last layer's hidden state at the step's last token) with each
    kept node's count shared evenly among its copies. DVTS is search-and-learn's loop: k subtrees, the first step's
    child j in subtree j % k, each subtree expanding its best child into its share of the width until that best
    child has ended, its last children its outputs. Returns the final trajectories (finished ones, else all) as
    dicts."""
    stops = set(config.step_delimiter_ids) | set(config.eos_token_ids)
    k = config.kept

    def forward(tokens):
        with torch.no_grad():
            out = model(torch.tensor([prompt + tokens]), output_hidden_states=True)
        return out.logits[0, -1], out.hidden_states[-1][0, -1]

    def draw_step(tokens, generator):
        step = []
        while not step or (step[-1] not in stops and len(step) < config.step_max_tokens):
            probs = torch.softmax(forward(tokens + step)[0].double() / config.temperature, -1)
            step.append(int(torch.multinomial(probs, 1, generator=generator)))
        return step

    def tokens(t):
        return [x for s in t["steps"] for x in s]

    def score(t):
        return t["scores"][-1]

    def allocate(live, width):
        if config.strategy == "best_of_n":
            return [(t, 1) for t in live]
        if config.strategy == "beam":
            best = sorted(live, key=lambda t: -score(t))[:k]
            return list(zip(best, shares(width, len(best))))
        if config.strategy == "rebase":
            return list(zip(live, rebase_allocation([score(t) for t in live], width, config.rebase_temperature)))
        nodes = {}
        for t in live:
            nodes.setdefault(tuple(map(tuple, t["steps"])), []).append(t)
        heads = [group[0] for group in nodes.values()]
        clusters = cluster_embeddings(torch.stack([forward(tokens(t))[1].float() for t in heads]).numpy(),
                                      config.cluster_threshold)
        ancestors = [[tuple(map(tuple, t["steps"][:d])) for d in range(len(t["steps"]))] for t in heads]
        counts = ets_select(ancestors, [score(t) for t in heads], clusters, width, lambda_b=config.lambda_b,
                            lambda_d=config.lambda_d, temperature=config.rebase_temperature,
                            steps=[tuple(t["steps"][-1]) for t in heads], copies=[len(g) for g in nodes.values()])
        return [(t, n) for group, count in zip(nodes.values(), counts)
                for t, n in zip(group, shares(count, len(group)))]

    def expand(t, n):
        """t's n children, ordered by key."""
        children = []
        for j in range(n):
            key = t["key"] + (j,)
            steps = t["steps"] + [draw_step(tokens(t), candidate_generator(config.seed, key))]
            children.append(dict(key=key, steps=steps, scores=t["scores"] + [verifier(prompt, steps)]))
        return children

    def ended(t):
        return t["steps"][-1][-1] in config.eos_token_ids

    root = dict(key=(), steps=[], scores=[])
    if config.strategy == "dvts":  # search-and-learn's loop: each subtree samples its share from its current best
        subtrees = [dict(share=n, best=root, children=None, pruned=False) for n in shares(config.width, k)]
        first = expand(root, config.width)  # the prompt's children dealt out: child j to subtree j % k
        for g, subtree in enumerate(subtrees):
            subtree["children"] = [c for c in first if c["key"][0] % k == g]
        for depth in range(config.max_steps):
            for subtree in subtrees:
                if subtree["pruned"]:
                    continue
                if depth > 0:
                    subtree["children"] = expand(subtree["best"], subtree["share"])
                if not subtree["children"]:
                    subtree["pruned"] = True  # width < k: an empty subtree
                    continue
                subtree["best"] = max(subtree["children"], key=score)  # first maximum in key order
                subtree["pruned"] = ended(subtree["best"])
        outputs = sorted((c for subtree in subtrees for c in subtree["children"] or []), key=lambda t: t["key"])
        return [t for t in outputs if ended(t)] or outputs

    expansions, finished, live = [(root, config.width)], [], []
    for depth in range(config.max_steps):
        children = sorted((c for t, n in expansions for c in expand(t, n)), key=lambda t: t["key"])
        finished += [c for c in children if ended(c)]
        live = [c for c in children if not ended(c)]
        width = config.width - len(finished)
        if not live or width <= 0 or depth == config.max_steps - 1:
            break
        expansions = allocate(live, width)
    return finished or live


@pytest.mark.parametrize("strategy", sorted(ALLOCATIONS))
def test_every_strategy_on_batched_rows_equals_a_sequential_reference(policy_model, strategy):
    """Batched execution (with and without dedup, kept or replayed leaves) gives the trajectories (keys, steps,
    scores) and the answer of the plain one-candidate-at-a-time reference, for two seeds; float64 policy."""
    answer = lambda tokens: tokens[-1] % 3  # noqa: E731
    for seed in (0, 7):
        config = dict(strategy=strategy, width=6, max_steps=3, step_delimiter_ids=(4, 5), step_max_tokens=3,
                      eos_token_ids=(0,), seed=seed, lambda_b=2.0)
        want = reference_search(policy_model, [1, 2, 3], hashed, SearchConfig(**config))
        want_answer = plain_vote([answer([x for s in t["steps"] for x in s]) for t in want],
                                 [t["scores"][-1] for t in want])
        for dedup in (True, False):
            for leaf_states in ("keep", "replay"):
                result = tree_search(policy_model, [1, 2, 3], hashed,
                                     SearchConfig(**config, dedup=dedup, leaf_states=leaf_states), answer_fn=answer)
                got = [(t.key, t.steps, t.step_scores) for t in result.trajectories]
                assert got == [(t["key"], t["steps"], t["scores"]) for t in want], (seed, dedup, leaf_states)
                assert result.scores == [t["scores"][-1] for t in want] and result.answer == want_answer


@pytest.mark.parametrize("width, beam_width, max_steps, eos", [(5, 0, 3, (0, 1, 2)), (7, 3, 3, (0, 1)),
                                                                (2, 3, 2, (0,)), (6, 0, 1, (0,))])
def test_dvts_subtrees_equal_search_and_learns_loop(policy_model, width, beam_width, max_steps, eos):
    """DVTS against the reference's transcription of search-and-learn's subtree loop where subtrees get unequal
    shares (width not a multiple of k), several stop on one step (frequent EOS), there are fewer children than
    subtrees, or there is a single step; three seeds, float64 policy."""
    for seed in (0, 1, 2):
        config = SearchConfig(strategy="dvts", width=width, beam_width=beam_width, max_steps=max_steps,
                              step_delimiter_ids=(4, 5), step_max_tokens=3, eos_token_ids=eos, seed=seed)
        want = reference_search(policy_model, [1, 2, 3], hashed, config)
        result = tree_search(policy_model, [1, 2, 3], hashed, config)
        got = [(t.key, t.steps, t.step_scores) for t in result.trajectories]
        assert got == [(t["key"], t["steps"], t["scores"]) for t in want], seed


@pytest.mark.parametrize("strategy", sorted(ALLOCATIONS))
def test_several_problems_in_one_batch_equal_the_reference_one_by_one(policy_model, strategy):
    """tree_search_batch decodes problems of different prompt lengths and seeds together (each moving on to its next
    level by itself): every problem's trajectories equal the plain reference's for that problem, and its own
    counts (verifier calls, step tokens, forward passes it took part in, replays) equal those of searching it
    alone; float64 policy, kept and replayed leaves."""
    prompts, seeds = [[1, 2, 3], [7, 3, 5, 2, 6, 1], [2]], [0, 7, 3]
    config = dict(strategy=strategy, width=6, max_steps=3, step_delimiter_ids=(4, 5), step_max_tokens=3,
                  eos_token_ids=(0,), lambda_b=2.0)
    wants = [reference_search(policy_model, p, hashed, SearchConfig(**config, seed=seed))
             for p, seed in zip(prompts, seeds)]
    for leaf_states in ("keep", "replay"):
        results = tree_search_batch(policy_model, prompts, hashed, SearchConfig(**config, leaf_states=leaf_states),
                                    seeds=seeds)
        for i, (prompt, seed, want, result) in enumerate(zip(prompts, seeds, wants, results)):
            got = [(t.key, t.steps, t.step_scores) for t in result.trajectories]
            assert got == [(t["key"], t["steps"], t["scores"]) for t in want], (leaf_states, i)
            alone = tree_search(policy_model, prompt, hashed, SearchConfig(**config, seed=seed,
                                                                           leaf_states=leaf_states)).stats
            for key in ("verifier_calls", "steps", "step_tokens", "forwards", "replayed", "replay_tokens",
                        "replay_forwards", "peak_tree_bytes"):
                assert result.stats[key] == alone[key], (leaf_states, i, key)
            assert result.stats["peak_held_bytes"] >= max(r.stats["peak_tree_bytes"] for r in results) > 0
        if leaf_states == "replay":  # a level's replays of one step length share a pass
            assert all(r.stats["replay_forwards"] <= r.stats["replayed"] for r in results)
            assert any(r.stats["replay_forwards"] < r.stats["replayed"] for r in results)


def test_search_batch_rejects_bad_input(policy_model):
    config = SearchConfig(strategy="rebase", width=2, max_steps=1, step_delimiter_ids=(4,))
    with pytest.raises(ValueError, match="as many verifiers and seeds"):
        tree_search_batch(policy_model, [[1], [2]], [hashed], config)
    with pytest.raises(ValueError, match="at least one prompt"):
        tree_search_batch(policy_model, [], hashed, config)
    with pytest.raises(ValueError, match="seed"):
        tree_search_batch(policy_model, [[1], [2]], [hashed, hashed], config, seeds=[0, -1])


def tensors_under(obj, seen=None):
    """Every tensor reachable from obj through attributes, dicts, lists and tuples (brute force: no knowledge of
    where a cache keeps what)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_under(child, seen)]


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`, scalars left out: a 0-dim tensor holds no row's state (HF
    5.25's linear-attention cache layers keep their token count in one, cumulative_length_linear)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.dim()}.values())


@pytest.mark.parametrize("family", ["bamba", "zamba2"])
def test_tree_memory_sizes_are_a_snapshot_and_a_row(family):
    model = tiny_model(family, dtype=torch.float64, vocab_size=16, seed=1)
    batch, root = RowBatch.prefill(model, [1, 2, 3, 4, 5])
    memory = TreeMemory(root)
    assert storage_bytes(tensors_under([root.kv, root.states])) == memory.ssm_bytes + 5 * memory.kv_per_token
    batch.add([root])
    assert storage_bytes(tensors_under(batch.cache)) == batch.nbytes() == memory.ssm_bytes + 5 * memory.kv_per_token


@pytest.mark.parametrize("strategy, leaf_states", [("rebase", "keep"), ("ets", "replay"), ("spec_beam", "keep")])
def test_held_bytes_are_what_the_batch_and_the_live_snapshots_hold(policy_model, monkeypatch, strategy, leaf_states):
    """stats["peak_held_bytes"] against a brute-force count, at every point the search measures: every tensor
    reachable from the batch's HF cache, plus the cache tensors of every RowState ever made that is still alive."""
    alive = weakref.WeakSet()
    init = RowState.__init__

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        alive.add(self)

    measured = []
    held_bytes = RowBatch.held_bytes

    def checked_held_bytes(batch):
        brute = storage_bytes(tensors_under(batch.cache))
        brute += sum(storage_bytes(tensors_under([s.kv, s.states])) for s in list(alive) if s.states is not None)
        got = held_bytes(batch)
        assert got == brute
        measured.append(got)
        return got

    monkeypatch.setattr(RowState, "__init__", tracked_init)
    monkeypatch.setattr(RowBatch, "held_bytes", checked_held_bytes)
    config = SearchConfig(strategy=strategy, width=6, beam_width=2, max_steps=3, step_delimiter_ids=(4, 5),
                          step_max_tokens=4, eos_token_ids=(0,), seed=2, leaf_states=leaf_states)
    result = tree_search(policy_model, [1, 2, 3], hashed, config)
    decode_passes = result.stats["forwards"] - result.stats["replay_forwards"]
    assert len(measured) == decode_passes + 1 and result.stats["peak_held_bytes"] == max(measured)
