"""HeadTreeModel: a TreeModel of a draft head (stree.heads.DraftHead), whose every input is a token and a feature.

A head's entry for token x_{t+1} is fuse(embed(x_{t+1}), f) run through the head's decoder layers, where f is the
target's hidden state at t (its last hidden state after the final norm, or several layers' fused) when the target has
verified x_{t+1}, and otherwise the head's own output hidden state at its parent node. So a pass takes the features
of its first nodes from outside (the trunk: tokens the target has verified since the head's cache last grew, the
speculation's root last), and every other node reads its parent's output from a buffer over the tree's node slots,
written by the pass that computed the parent. The head's layers hold no recurrent state (attention, MLP and MoE
blocks only), so its committed state is its attention cache alone.
"""
import torch

from .tree_model import TreeModel


class HeadTreeModel(TreeModel):
    """TreeModel(head.inner) whose passes fuse each node's token embedding with its feature (head.fusion).

    prefill(input_ids, features=...) and tree_forward(..., features=...) take the features (batch, n, feature_size)
    of their first n tokens; tree nodes after those read their parent's output. A node without either (parent -1
    and no feature given) reads node slot 0's: only the adaptive tree's timing passes make such nodes."""
    IS_HEAD = True

    def __init__(self, head, *, nodes=16, pass_width=None):
        super().__init__(head.inner, nodes=nodes, pass_width=pass_width)
        if self.mixers:
            raise ValueError(f"a draft head's layers must be attention, MLP or MoE blocks; "
                             f"{head.inner.config.model_type} layers {sorted(self.mixers)} hold recurrent states")
        self.fusion, self.feature_size = head.fusion, head.feature_size
        self.embed = self.base.get_input_embeddings()
        self._outputs = None  # (batch, slots, hidden): each tree node's output hidden state, its children's feature

    @torch.no_grad()
    def prefill(self, input_ids, *, max_length=None, features=None):
        """Start the head's cache with input_ids (batch, P) and their features (batch, P, feature_size); P may be 0
        (a one-token prompt leaves the head nothing to hold). Returns the last entry's logits (batch, vocab), or None
        when P = 0."""
        if features is None or features.shape[:2] != input_ids.shape or features.shape[-1] != self.feature_size:
            raise ValueError(f"a head's prefill needs features of shape {(*input_ids.shape, self.feature_size)}, got "
                             f"{None if features is None else tuple(features.shape)}")
        if input_ids.shape[1] > 0:
            return super().prefill(input_ids, max_length=max_length, features=features)
        # nothing to hold: start the cache from one placeholder entry and forget it (attention alone reads it, and
        # only positions below the committed length)
        super().prefill(input_ids.new_zeros(input_ids.shape[0], 1), max_length=max_length,
                        features=features.new_zeros(input_ids.shape[0], 1, self.feature_size))
        self._cache.length = 0
        return None

    def _hidden(self, tokens, cache, kwargs, features=None, inputs=None):
        if inputs is not None:  # a tree pass: features from outside first, then the parents' outputs
            features = self._node_features(inputs, features)
        else:  # the prefill: the target's features only
            features = self.fusion.reduced(features.to(self.embed.weight.dtype))
        embeds = self.fusion(self.embed(tokens), features.to(self.embed.weight.dtype))
        hidden = self.base(inputs_embeds=embeds, cache=cache, use_cache=True, **kwargs).last_hidden_state
        if inputs is not None:
            self._outputs.index_copy_(1, inputs["rows"], hidden)
        return hidden

    def _node_features(self, inputs, given):
        """Features (batch, width, hidden) of a pass's rows: where given = (the target's features (batch, width,
        feature_size), rows (width,) bool) marks a row, its given feature (reduced), else its parent's output."""
        rows, outputs = inputs["rows"], self._outputs
        parents = inputs["parents"].index_select(1, rows).clamp(min=0)
        features = outputs.gather(1, parents[..., None].expand(-1, -1, outputs.shape[-1]))
        if given is None:
            return features
        values, marked = given
        return torch.where(marked[None, :, None], self.fusion.reduced(values.to(features.dtype)), features)

    def _checked_features(self, features, shape):
        """(features padded to the pass's width, (width,) bool marking the rows they are given for), fixed shapes
        for a compiled pass, or None."""
        if features is None:
            return None
        batch, R = shape
        if (not isinstance(features, torch.Tensor) or features.dim() != 3 or features.shape[0] != batch
                or features.shape[1] > R or features.shape[2] != self.feature_size):
            raise ValueError(f"features must be a tensor (batch={batch}, n <= {R}, {self.feature_size}), got "
                             f"{tuple(features.shape) if isinstance(features, torch.Tensor) else type(features)}")
        width, _ = self._shape(R, [])
        n = features.shape[1]
        values = torch.cat([features.to(self.device), features.new_zeros(batch, width - n, self.feature_size)], 1)
        return values, torch.arange(width, device=self.device) < n

    def _reserve(self, slots):
        outputs = self._outputs
        if outputs is None or outputs.shape[1] < slots:
            hidden = self.config.hidden_size
            new = self.embed.weight.new_zeros(self._cache.batch, slots, hidden)
            if outputs is not None:
                new[:, :outputs.shape[1]] = outputs
            self._outputs = new
        if self._static_buffers:
            torch._dynamo.mark_static_address(self._outputs)
