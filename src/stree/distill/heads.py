"""Training draft heads (stree.heads.DraftHead) EAGLE-style: on the target's own features, with soft cross-entropy to
the target's next-token distribution plus feature regression, unrolled so that deeper draft levels train on the
head's own features ("training-time test").

A sequence x_0 .. x_{n-1} gives the head m = n - 1 entries: entry t is token x_{t+1} with the target's feature h_t,
and it predicts x_{t+2}, whose distribution the target gives at position t + 1 (and whose feature is h_{t+1}).
Unroll step s feeds entry t the head's own output of step s - 1 at entry t - 1 instead of h_t, and lets it attend as
it would while drafting s levels below a root at t - s: to the true entries up to t - s and to its own draft path
(step s' at entry t - s + s', for 1 <= s' <= s). All steps run in one forward over their concatenation with that mask
(each step's inputs come from the previous forward, so step s costs a forward over s + 1 copies of the sequence).
"""
import torch
import torch.nn.functional as F

from ..checks import check_float, check_ids, check_int
from ..models.families import LOGIT_SCALE
from ..models.hf_forward import capturing_forwards, swapped
from .losses import forward_kl
from .trainer import Trainer


def unrolled_visibility(entries, steps, device=None):
    """(steps * entries, steps * entries) bool: whether row (s, t) (step s, entry t; rows step-major) attends to
    column (s', u): u <= t - s when s' = 0, u = t - s + s' when 1 <= s' <= s; and always itself."""
    step = torch.arange(steps, device=device).repeat_interleave(entries)
    entry = torch.arange(entries, device=device).repeat(steps)
    qs, qt, ks, kt = step[:, None], entry[:, None], step[None, :], entry[None, :]
    true_prefix = (ks == 0) & (kt <= qt - qs)
    own_path = (ks >= 1) & (ks <= qs) & (kt == qt - qs + ks)
    return true_prefix | own_path | torch.eye(steps * entries, dtype=torch.bool, device=device)


@torch.no_grad()
def target_outputs(target, input_ids, feature_layers=None):
    """(logits (batch, n, vocab), last hidden states after the final norm (batch, n, H), features) of the target:
    the features a head with these feature_layers reads (the last hidden states when None, else those decoder
    layers' outputs concatenated, (batch, n, len(feature_layers) * H))."""
    outputs = {}
    with swapped(capturing_forwards(target.base_model, feature_layers or (), outputs)):
        hidden = target.base_model(input_ids=input_ids).last_hidden_state
    logits = target.get_output_embeddings()(hidden)
    scale = LOGIT_SCALE.get(target.config.model_type)
    features = hidden if feature_layers is None else torch.cat([outputs[i] for i in feature_layers], -1)
    return (logits if scale is None else scale(logits, target.config, target.base_model)), hidden, features


def unrolled_head(model, input_ids, features, steps):
    """The head's outputs over `steps` unroll steps, (logits, hidden) each a list of (batch, m, ...) per step, for
    tokens input_ids (batch, m) and the target's features (batch, m, feature_size) of step 0. model: the DraftHead
    (or a DDP wrapping it). The features a step feeds the next are detached (no gradient through the unroll): the
    steps before the last run without gradients, the last one recomputes them all with (one forward with gradients,
    as DDP wants)."""
    batch, m = input_ids.shape
    positions = torch.arange(m, device=input_ids.device).repeat(steps).expand(batch, -1)
    allowed = unrolled_visibility(m, steps, input_ids.device)
    feeds, dtype = [], features.dtype
    for step in range(steps):
        n = (step + 1) * m
        mask = torch.zeros(n, n, dtype=dtype, device=input_ids.device).masked_fill_(~allowed[:n, :n],
                                                                                    torch.finfo(dtype).min)
        with torch.set_grad_enabled(step + 1 == steps and torch.is_grad_enabled()):
            own = torch.cat(feeds, 1) if feeds else None
            logits, hidden = model(input_ids.repeat(1, step + 1), features, own, position_ids=positions[:, :n],
                                   attention_mask=mask.expand(batch, 1, n, n))
        if step + 1 < steps:  # the next step's entry t is fed this step's output at entry t - 1
            last = hidden[:, step * m:].detach()
            feeds.append(torch.cat([last[:, :1], last[:, :-1]], 1))
    return list(logits.split(m, 1)), list(hidden.split(m, 1))


def head_loss(head, target, input_ids, mask=None, steps=3, feature_weight=0.1, decay=0.8, dtype=None):
    """EAGLE-style loss of `head` (a DraftHead, or a DDP wrapping one; dtype: its features' dtype) on sequences
    input_ids (batch, n) (module docstring): over unroll steps s with weight decay**s, forward KL from the target's
    next-token distribution plus feature_weight times SmoothL1 to the target's next last hidden state (which the
    head's output stands in for at the next level, whatever features the head reads), on entries t >= s whose
    predicted position counts in `mask` (batch, n). Returns (loss, {name: float})."""
    feature_layers = getattr(head, "module", head).feature_layers  # (DDP keeps the head as .module)
    logits_t, hidden_t, features_t = target_outputs(target, input_ids, feature_layers)
    dtype = dtype or hidden_t.dtype
    logits_h, hidden_h = unrolled_head(head, input_ids[:, 1:], features_t[:, :-1].to(dtype), steps)
    m = input_ids.shape[1] - 1
    counts = torch.ones_like(input_ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:].bool()
    total, parts = 0.0, {}
    for step, (logits, hidden) in enumerate(zip(logits_h, hidden_h)):
        valid = counts & (torch.arange(m, device=input_ids.device) >= step)
        kl = forward_kl(logits, logits_t[:, 1:], valid)
        feature = F.smooth_l1_loss(hidden.float(), hidden_t[:, 1:].float(), reduction="none").mean(-1)
        feature = (feature * valid).sum() / valid.sum().clamp(min=1)
        total = total + decay ** step * (kl + feature_weight * feature)
        parts[f"kl_{step}"], parts[f"feature_{step}"] = float(kl.detach()), float(feature.detach())
    return total, parts


class HeadTrainer(Trainer):
    """stree.distill.Trainer for a DraftHead: the same schedule, progress, evaluation (tau with the head drafting
    for the target), checkpoints (save_pretrained + trainer_state.pt) and resume, with head_loss as the loss.
    `config.losses` is not used. unroll: training-time-test steps; feature_weight, decay: as head_loss's."""

    def __init__(self, head, config, dataset, target, eval_prompts=None, unroll=3, feature_weight=0.1, decay=0.8):
        check_int("unroll", unroll, 1)
        check_float("feature_weight", feature_weight, 0.0, strict=False)
        check_float("decay", decay, 0.0, strict=True)
        self.unroll, self.feature_weight, self.decay = unroll, feature_weight, decay
        super().__init__(head, config, dataset, teacher=target, eval_prompts=eval_prompts)

    def _loss(self, batch):
        check_ids("a batch of the dataset", batch["input_ids"], self.vocab)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return head_loss(self.model, self.teacher, batch["input_ids"], batch.get("mask"), self.unroll,
                             self.feature_weight, self.decay, self.student.dtype)

    def _load_weights(self, path):
        from ..heads.published import load_weights
        load_weights(self.student, path)
