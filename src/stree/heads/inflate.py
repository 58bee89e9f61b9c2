"""A Bamba target's draft head inflated with its target (models.inflate.inflate_bamba): the same function at a
realistic cost. The head's Bamba block is inflated as the target's blocks are; the fusion's fc keeps its two halves
in the corners of the embedding's and the feature's halves (both zero-padded, as the inflated target's embeddings
and features are), and its norms are rescaled as inflate_bamba rescales norms."""
import math

import torch

from ..models.inflate import inflate_bamba
from .head import DraftHead, new_fusion


def inflate_head(head, target, **sizes):
    """A DraftHead for `target` (inflate_bamba(head's target, **sizes)) whose drafts equal `head`'s up to float
    rounding: head.inner inflated with the same sizes but one layer."""
    if head.config.model_type != "bamba":
        raise ValueError(f"inflate_head takes a head of Bamba blocks, got {head.config.model_type!r}")
    if head.feature_layers is not None:  # inflation adds layers: which of the new ones the head should read is open
        raise ValueError("inflate_head takes a head that reads the target's last hidden state, not feature_layers")
    inner = inflate_bamba(head.inner, **{**sizes, "num_layers": head.config.num_hidden_layers})
    fusion = new_fusion(inner)
    H, H2 = head.config.hidden_size, inner.config.hidden_size
    factor = H2 / H
    with torch.no_grad():
        fc = fusion.fc.weight.zero_()
        fc[:H, :H] = head.fusion.fc.weight[:, :H]
        fc[:H, H2:H2 + H] = head.fusion.fc.weight[:, H:]
        for new, old in ((fusion.norm_embedding, head.fusion.norm_embedding),
                         (fusion.norm_hidden, head.fusion.norm_hidden)):
            new.weight.zero_()[:H] = old.weight / math.sqrt(factor)
            new.variance_epsilon = old.variance_epsilon / factor
    return DraftHead(inner, fusion, target, kind=head.kind)
