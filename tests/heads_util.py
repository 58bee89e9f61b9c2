"""Tiny targets and heads for the draft-head tests: a target whose next token depends mostly on the current one,
and a head that echoes the token it is fed, so that its drafts are often accepted and sometimes not."""
import torch

from stree.heads import new_head
from stree.models import tiny_model

OUTPUT_PROJECTIONS = ("out_proj", "o_proj", "down_proj")


def scale_outputs(model, factor):
    """Scale every block's output projection (mixer, attention, MLP) by `factor`: the residual stream stays near
    the token's embedding."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS and hasattr(module, "weight"):
                module.weight.mul_(factor)


def echo_pair(family, context=0.3, noise=0.05, sharpness=4.0, vocab=None, seed=1, feature_layers=None):
    """(target, head): a tiny float64 target whose blocks add `context` times their usual output, its LM head scaled
    by `sharpness`, and a head (reading the target's `feature_layers`, new_head's argument) whose layers add `noise`
    times theirs and whose fusion passes the token's embedding (plus `noise`): its drafts follow the target's
    next-token distribution up to the context's effect."""
    kwargs = {} if vocab is None else {"vocab_size": vocab}
    target = tiny_model(family, dtype=torch.float64, seed=seed, **kwargs)
    scale_outputs(target, context)
    target.get_output_embeddings().weight.data.mul_(sharpness)
    target.generation_config.eos_token_id = None
    torch.manual_seed(seed)
    head = new_head(target, feature_layers=feature_layers)
    scale_outputs(head.inner, noise)
    hidden = head.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1).double()
        head.fusion.fc.weight.copy_(fc + noise * torch.randn(fc.shape, generator=g, dtype=fc.dtype))
    return target, head
