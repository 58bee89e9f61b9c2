"""Draft heads: drafts that read the target's hidden state (published MTP heads, EAGLE-style heads trained by
stree.distill). `stree.generate(model, ids, draft_model=head)` drafts trees from one."""
from .head import DraftHead, HeadFusion
from .published import new_head

__all__ = ["DraftHead", "HeadFusion", "new_head"]
