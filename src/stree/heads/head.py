"""DraftHead: a draft that reads the target's hidden state (an MTP head shipped with the model, or an EAGLE-style head
trained by stree.distill) instead of being a model of its own.

For the entry of token x_{t+1}, with f_t the target's last hidden state (after its final norm) at t:

    input  = fc(cat([norm_embedding(embed(x_{t+1})), norm_hidden(f_t)]))     (embedding first)
    hidden = the head's decoder layers over the inputs so far, then its final norm
    logits = the target's LM head on hidden                                  (a distribution for x_{t+2})

When the target has not verified x_{t+1} yet (deeper draft levels), f_t is the head's own output hidden state at the
entry before. An EAGLE-3-style head reads several of the target's layers instead of its last hidden state: f_t is then
reduce(cat of those layers' outputs at t) (HeadFusion.reduce; `feature_layers` names the layers). The embedding and LM
head are the target's own modules (shared, never copied); the decoder layers are an HF model of their own (`inner`,
built from the target family's classes where it has them, so published weights load as they are), with whatever
embedding it was built with replaced by the target's.
"""
import copy

import torch
from torch import nn


class FeatureReduce(nn.Module):
    """Several target layers' features to one: fc(cat of each layer's output through `norm`), (..., k * H) ->
    (..., H), with fc (H, k * H) and norm a norm over H."""

    def __init__(self, norm, fc):
        super().__init__()
        self.norm, self.fc = norm, fc

    def forward(self, features):
        return self.fc(self.norm(features.unflatten(-1, (-1, self.fc.out_features))).flatten(-2))


class HeadFusion(nn.Module):
    """fc(cat([norm_embedding(embeds), norm_hidden(features)], -1)): (..., H) and (..., H) -> (..., H). reduce: a
    FeatureReduce when the target's features are several layers' (reduced() applies it), else None."""

    def __init__(self, norm_embedding, norm_hidden, fc, reduce=None):
        super().__init__()
        self.norm_embedding, self.norm_hidden, self.fc, self.reduce = norm_embedding, norm_hidden, fc, reduce

    def forward(self, embeds, features):
        return self.fc(torch.cat([self.norm_embedding(embeds), self.norm_hidden(features)], dim=-1))

    def reduced(self, features):
        """The target's features (..., feature_size) as the head's own features (..., H)."""
        return features if self.reduce is None else self.reduce(features)


class DraftHead(nn.Module):
    """A feature-conditioned draft head (module docstring). inner: an HF causal LM whose layers and final norm are the
    head's; fusion: a HeadFusion; target: the model it drafts for (its embedding and LM head are set on `inner`).
    kind: where it comes from ("eagle" for heads stree trains, "<family>_mtp" for published ones). feature_layers:
    None when the head reads the target's last hidden state, else the indices of the target's decoder layers whose
    outputs it reads (fusion.reduce fuses them)."""

    def __init__(self, inner, fusion, target, kind="eagle", feature_layers=None):
        super().__init__()
        count = 1 if fusion.reduce is None else fusion.reduce.fc.in_features // inner.config.hidden_size
        if (feature_layers is None) != (fusion.reduce is None) or (feature_layers and len(feature_layers) != count):
            raise ValueError(f"the fusion reduces {count} layers' features, feature_layers is {feature_layers!r}")
        self.inner, self.fusion, self.kind = inner, fusion, kind
        self.feature_layers = None if feature_layers is None else tuple(feature_layers)
        share_embeddings(inner, target)

    @property
    def feature_size(self):
        """The size of the target's features the head reads: hidden_size per feature layer."""
        return self.config.hidden_size * len(self.feature_layers or (None,))

    @property
    def config(self):
        return self.inner.config

    @property
    def device(self):
        return self.fusion.fc.weight.device

    @property
    def dtype(self):
        return self.fusion.fc.weight.dtype

    def _shared(self):
        """ids of the target's embedding and LM head parameters, which the head uses but does not own."""
        return {id(p) for m in (self.inner.get_input_embeddings(), self.inner.get_output_embeddings())
                for p in m.parameters()}

    def own_parameters(self):
        """The head's parameters without the target's embedding and LM head (what training updates)."""
        shared = self._shared()
        return [p for p in self.parameters() if id(p) not in shared]

    def own_state_dict(self):
        """state_dict() without the target's embedding and LM head (what a checkpoint holds)."""
        shared = self._shared()
        return {k: v for k, v in self.state_dict(keep_vars=True).items() if id(v) not in shared}

    def forward(self, input_ids, features, own=None, **kwargs):
        """The head run sequentially over input_ids (batch, n), entry j fed token input_ids[:, j] and a feature: the
        first n1 entries the target's features (batch, n1, feature_size), the other n - n1 the head's own output
        hidden states `own` (batch, n - n1, H) (kwargs go to the inner base model: cache, positions, mask).
        Returns (logits (batch, n, vocab), hidden (batch, n, H): the output hidden states, which the next level
        is fed)."""
        fed = self.fusion.reduced(features.to(self.dtype))
        if own is not None:
            fed = torch.cat([fed, own.to(self.dtype)], 1)
        embeds = self.fusion(self.inner.get_input_embeddings()(input_ids), fed)
        hidden = self.inner.base_model(inputs_embeds=embeds, **kwargs).last_hidden_state
        return self.inner.get_output_embeddings()(hidden), hidden

    @classmethod
    def from_pretrained(cls, path, *, target):
        """The head in folder `path` for `target` (a loaded HF causal LM): a head trained by stree.distill (its
        folder holds stree_head.json), or the MTP head a Qwen3-Next, Qwen3.5 or Nemotron-H checkpoint folder ships
        (its `mtp.*` weights, which HF's loader skips). ValueError when the folder holds neither."""
        from .published import load_head
        return load_head(path, target)

    def save_pretrained(self, path, **_):
        """Write the head (not the target's shared embedding and LM head) to folder `path`, for from_pretrained."""
        from .published import save_head
        save_head(self, path)


def share_embeddings(inner, target):
    """Make `inner` use the target's input embedding and LM head modules (the very objects)."""
    inner.set_input_embeddings(target.get_input_embeddings())
    inner.set_output_embeddings(target.get_output_embeddings())
    inner.config.tie_word_embeddings = False


def final_norm(base):
    """A base model's final norm module (HF names it `norm` or `norm_f`)."""
    for name in ("norm", "norm_f", "final_layernorm"):
        if isinstance(getattr(base, name, None), nn.Module):
            return getattr(base, name)
    raise ValueError(f"{type(base).__name__} has no final norm named norm / norm_f / final_layernorm")


def new_fusion(inner, feature_layers=None):
    """An untrained HeadFusion for `inner`: its norms copies of its final norm's class at their initial weights
    (ones, or zeros for 1 + weight norms: the class's own initialisation), fc (H, 2H) with HF's initialisation; for
    a head reading the target's `feature_layers` (a tuple) a FeatureReduce too (fc (H, len(feature_layers) * H))."""
    norm = final_norm(inner.base_model)
    hidden, std = inner.config.hidden_size, getattr(inner.config, "initializer_range", 0.02)
    reduce = None
    if feature_layers is not None:
        reduce = FeatureReduce(copy.deepcopy(norm), nn.Linear(len(feature_layers) * hidden, hidden, bias=False))
    fusion = HeadFusion(copy.deepcopy(norm), copy.deepcopy(norm), nn.Linear(2 * hidden, hidden, bias=False), reduce)
    initial = _initial_norm_weight(norm)
    extra = [reduce] if reduce is not None else []
    for module in [fusion.norm_embedding, fusion.norm_hidden] + [r.norm for r in extra]:
        module.weight.data.copy_(initial)
    for linear in [fusion.fc] + [r.fc for r in extra]:
        nn.init.normal_(linear.weight, std=std)
    return fusion.to(dtype=norm.weight.dtype, device=norm.weight.device)


def _initial_norm_weight(norm):
    """The weight a new module of the norm's class starts with (ones where the class wants more arguments)."""
    try:
        return type(norm)(norm.weight.shape[0]).weight.data
    except TypeError:
        return torch.ones_like(norm.weight.data)
