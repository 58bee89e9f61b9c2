"""End-to-end decoding: stree.generate against HF generate, the draft's share of a round, tree-sizing policies."""
