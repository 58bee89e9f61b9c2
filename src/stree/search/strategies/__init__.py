"""The search strategies, one module each, and the two dicts that name them (one SearchConfig picks from them).

    best_of_n, beam, dvts, rebase, ets   level rules, run level by level by stree.search.levels
    spec_beam                            beam search on its own schedule, synchronous or speculative

ALLOCATIONS: name -> level rule(children, answers, config, context, last) -> (expansions [(trajectory, count)],
answers) of each level-synchronous strategy (strategies.common describes the protocol).
STRATEGIES: name -> search(policy, prompts, verifiers, config, seeds, answer_fn, embedder) -> one SearchResult per
problem, for every strategy (SearchConfig.strategy names one; stree.search.tree_search dispatches to it).
"""
from functools import partial

from ..levels import level_searches
from . import beam, best_of_n, dvts, ets, rebase, spec_beam
from .common import shared_width

ALLOCATIONS = {"best_of_n": shared_width(best_of_n.best_of_n), "beam": shared_width(beam.beam), "dvts": dvts.dvts,
               "rebase": shared_width(rebase.rebase), "ets": shared_width(ets.ets)}

STRATEGIES = {**{name: partial(level_searches, level_rule=rule) for name, rule in ALLOCATIONS.items()},
              "spec_beam": spec_beam.spec_beam_searches}
