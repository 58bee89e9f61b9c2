"""Trees of many rows grown in lockstep: every level's draft pass is one batched pass of the draft TreeModel over all
rows' new nodes, and every level's choices come to the host in one copy.

Each row's tree is grown by its own grow function (drafting/host.py), a generator whose Growth.expand asks for a
draft pass (a Feed) and then for a copy to the host. drive() answers the asks of all rows at once. Rows that ask for
fewer nodes are padded with nodes that no node descends from (children of the committed sequence, never kept), and
a row whose tree is finished only pads the passes that the others still need.
"""
import numpy as np
import torch

from .growth import Feed


def drive(draft, programs):
    """Run `programs` (one grow generator per row of `draft`'s batch, in row order) to their ends, answering each
    level's asks of all rows together. Returns what each program returns (DraftedTrees), in row order."""
    results = [None] * len(programs)

    def send(b, answer):
        try:
            return programs[b].send(answer)
        except StopIteration as stop:
            results[b] = stop.value
            return None

    asks = [send(b, None) for b in range(len(programs))]
    while any(ask is not None for ask in asks):
        assert all(ask is None or isinstance(ask, Feed) for ask in asks)
        logits = _feed(draft, asks)
        copies = [None if ask is None else send(b, logits[b]) for b, ask in enumerate(asks)]
        host = _to_host(copies)
        asks = [None if copy is None else send(b, host[b]) for b, copy in enumerate(copies)]
    return results


def _feed(draft, asks):
    """One draft pass over every row's new nodes (Feeds; None: the row only pads). Returns, per asking row, the
    logits (len(ask.nodes), vocab) of the nodes it asked about."""
    first = draft.tree is None  # the round's first pass: a new tree
    first_id = 0 if first else draft.tree.n
    fed = [([], []) if ask is None else ask.growth.feed(ask.new, first_id) for ask in asks]
    width = max(len(tokens) for tokens, _ in fed)
    tokens = np.zeros((len(asks), width), dtype=np.int64)
    parents = np.full((len(asks), width), -1, dtype=np.int64)
    for b, (row_tokens, row_parents) in enumerate(fed):
        tokens[b, :len(row_tokens)], parents[b, :len(row_parents)] = row_tokens, row_parents
    wanted = [None if ask is None else [ask.new.index(n) for n in ask.nodes] for ask in asks]
    asked = [w for w in wanted if w is not None]
    rows = asked[0] if all(w == asked[0] for w in asked) else sorted({p for w in asked for p in w})
    features = None  # a head's first pass: each row's trunk features (the Growth's (1, n_b, feature_size))
    if first and any(ask is not None and ask.growth.features is not None for ask in asks):
        features = (asks[0].growth.features if len(asks) == 1 else
                    [None if ask is None or ask.growth.features is None else ask.growth.features[0] for ask in asks])
    run = draft.tree_forward if first else draft.extend
    logits = run(tokens, parents, logits_for=rows, features=features)                    # (batch, K, vocab)
    if rows is asked[0]:
        return [None if w is None else logits[b] for b, w in enumerate(wanted)]
    where = {p: k for k, p in enumerate(rows)}
    return [None if w is None else logits[b, [where[p] for p in w]] for b, w in enumerate(wanted)]


def _to_host(tensors):
    """Nested lists of `tensors` (None stays None), copied to the host in one transfer."""
    present = [t for t in tensors if t is not None]
    if len(present) == 1:
        flat = [present[0].tolist()]
    else:
        values = torch.cat([t.reshape(-1) for t in present]).tolist()
        sizes = np.cumsum([0] + [t.numel() for t in present])
        flat = [np.asarray(values[a:b]).reshape(t.shape).tolist() for a, b, t in zip(sizes, sizes[1:], present)]
    out = iter(flat)
    return [None if t is None else next(out) for t in tensors]
