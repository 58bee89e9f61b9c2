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

    @torch.no_grad()
    def add_rows(self, prompts, *, max_length=None, features=None):
        """TreeModel.add_rows for a head: each prompt (P_i >= 0 token ids) comes with its features (P_i,
        feature_size); an empty prompt (a one-token prompt leaves the head nothing to hold) starts its row from one
        placeholder entry that the row's length then leaves out. Returns the new rows' last logits (meaningless
        for empty prompts)."""
        if features is None or len(features) != len(prompts) or any(
                not isinstance(f, torch.Tensor) or f.shape != (p.numel(), self.feature_size)
                for p, f in zip(prompts, features)):
            raise ValueError(f"a head's add_rows needs one feature tensor (P_i, {self.feature_size}) per prompt, got "
                             f"{_described(features)} for prompts of {[p.numel() for p in prompts]} tokens")
        empty = [i for i, p in enumerate(prompts) if p.numel() == 0]
        prompts = [p.new_zeros(1) if p.numel() == 0 else p for p in prompts]
        features = [f.new_zeros(1, self.feature_size) if f.shape[0] == 0 else f for f in features]
        logits = super().add_rows(prompts, max_length=max_length, features=features)
        first = self._cache.batch - len(prompts)
        self._cache.lengths[[first + i for i in empty]] = 0
        return logits

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
        return torch.where(marked[..., None], self.fusion.reduced(values.to(features.dtype)), features)

    def _checked_features(self, features, shape):
        """(features padded to the pass's width (batch, width, feature_size), (batch, width) bool marking the rows
        they are given for), fixed shapes for a compiled pass, or None. `features`: a tensor (batch, n <= R,
        feature_size), the same n for every row, or a list of one tensor (n_b <= R, feature_size) per row (None:
        none for that row), as rows of a batch carry trunks of their own lengths."""
        if features is None:
            return None
        batch, R = shape
        uniform = isinstance(features, torch.Tensor) and features.dim() == 3 and features.shape[0] == batch
        rows = list(features) if uniform or isinstance(features, (list, tuple)) else []
        rows = [self.embed.weight.new_zeros(0, self.feature_size) if f is None else f for f in rows]
        if len(rows) != batch or not all(isinstance(f, torch.Tensor) and f.dim() == 2 and f.shape[0] <= R
                                         and f.shape[1] == self.feature_size for f in rows):
            raise ValueError(f"features must be a tensor (batch={batch}, n <= {R}, {self.feature_size}) or a list of "
                             f"{batch} tensors (n_b <= {R}, {self.feature_size}), got {_described(features)}")
        width, _ = self._shape(R, [])
        if uniform:  # one count for every row: no mask to copy
            n = features.shape[1]
            values = torch.cat([features.to(self.device), features.new_zeros(batch, width - n, self.feature_size)], 1)
            return values, (torch.arange(width, device=self.device) < n).expand(batch, width)
        values = self.embed.weight.new_zeros(batch, width, self.feature_size)
        for b, f in enumerate(rows):
            values[b, :f.shape[0]] = f
        counts = torch.tensor([[f.shape[0]] for f in rows])
        return values, (torch.arange(width) < counts).to(self.device)

    def _reserve(self, slots):
        outputs = self._outputs
        if outputs is not None and outputs.shape[0] != self._cache.batch:  # rows joined or left: a new tree's scratch
            outputs = None
        if outputs is None or outputs.shape[1] < slots:
            hidden = self.config.hidden_size
            new = self.embed.weight.new_zeros(self._cache.batch, slots, hidden)
            if outputs is not None:
                new[:, :outputs.shape[1]] = outputs
            self._outputs = new
        if self._static_buffers:
            torch._dynamo.mark_static_address(self._outputs)


def head_inputs(tokens, features):
    """What a head holds of a prompt the target has run: its entry for token t + 1 is fed the target's feature at t,
    so it holds tokens[1:] fed features[:-1], and the last feature starts the trunk. tokens (..., P), features
    (..., P, F) -> (tokens (..., P - 1), their features (..., P - 1, F), the trunk's first feature (..., 1, F))."""
    return tokens[..., 1:], features[..., :-1, :], features[..., -1:, :]


def _described(features):
    """What `features` is, for an error message."""
    if isinstance(features, torch.Tensor):
        return tuple(features.shape)
    if isinstance(features, (list, tuple)):
        return [None if f is None else tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
                for f in features]
    return type(features).__name__
