"""ETS (efficient tree search): prune the tree by an exact integer program that trades the leaves' REBASE weight
against the nodes they keep alive and the diversity clusters they cover (stree.search.allocation.ets_select)."""
import torch

from ..allocation import ets_select
from ..clusters import cluster_embeddings
from .common import scores, shares


def ets(live, width, config, context):
    """ETS (ets_select) over distinct search-tree nodes: copies of a node (siblings that drew the same step) share one
    state, so they are one leaf of the ILP, kept or pruned together, with REBASE counted per copy; a kept node's count
    is then shared evenly among its copies. Costs: one per node (ETS) or, with ets_costs="bytes", the bytes each node
    keeps alive (TreeMemory)."""
    nodes = {}
    for t in live:
        nodes.setdefault(t.node, []).append(t)
    copies = list(nodes.values())
    heads = [group[0] for group in copies]
    clusters = cluster_embeddings(torch.stack([context.embed(t) for t in heads]).numpy(), config.cluster_threshold)
    costs = {}
    if config.ets_costs == "bytes":
        memory = context.memory
        costs = dict(node_costs={at.node: memory.node_bytes(at) for t in heads for at in list(t.lineage())[1:]},
                     leaf_costs=[memory.leaf_bytes(t) for t in heads])
    counts = ets_select([t.ancestors() for t in heads], scores(heads, config), clusters, width,
                        lambda_b=config.lambda_b, lambda_d=config.lambda_d, temperature=config.rebase_temperature,
                        steps=[tuple(t.steps[-1]) for t in heads], copies=[len(group) for group in copies],
                        weights=config.ets_weights, **costs)
    return [(t, n) for group, count in zip(copies, counts) for t, n in zip(group, shares(count, len(group)))]
