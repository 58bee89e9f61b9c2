"""A Mamba2 mixer over a token tree, with the module's own weights, and the commit of its cache.

All six HF families share the mixer layout (in_proj -> [gate | xBC | dt], depthwise conv on xBC, SSD, gated
norm, out_proj); FalconH1 adds an input multiplier, a per-segment mup_vector on in_proj's output and an optional
norm. The tree pass mirrors HF's single-token *decode* path (no dt clamp: the decode path has none), because
HF's greedy generate runs every new token through it.
"""
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ..triton_kernels import tree_conv1d, tree_conv_state, tree_scan, tree_states

MIXER_ATTRIBUTES = ("A_log", "dt_bias", "D", "conv1d", "in_proj", "out_proj", "norm", "layer_idx")


def is_mamba_mixer(module):
    return all(hasattr(module, name) for name in MIXER_ATTRIBUTES)


@dataclass
class MixerTreeInputs:
    """What a mixer's tree pass saw, kept until the commit (and for extending the tree). Shapes for batch b,
    T nodes."""
    xbc: torch.Tensor   # (b, T, conv_dim) pre-conv inputs
    x: torch.Tensor     # (b, T, nheads, headdim) post-conv SSM inputs
    dt: torch.Tensor    # (b, T, nheads) raw dt (before dt_bias / softplus)
    B: torch.Tensor     # (b, T, ngroups, dstate)
    C: torch.Tensor     # (b, T, ngroups, dstate)

    def extended(self, new):
        """These nodes followed by `new`'s, field by field."""
        return MixerTreeInputs(*(torch.cat([getattr(self, f.name), getattr(new, f.name)], dim=1)
                                 for f in fields(self)))


def mixer_tree_forward(mixer, hidden_states, cache_layer, tree, previous=None):
    """Run `mixer` over a tree's new nodes on top of its cached prefix state, without writing the cache.

    hidden_states (b, T_new, hidden) of the tree's last T_new nodes; previous: the MixerTreeInputs of the
    T_old = T - T_new nodes before them (None when T_old = 0); cache_layer holds conv_states[0] (b, conv_dim, K)
    and recurrent_states[0] (b, nheads, headdim, dstate); tree: the TreeIndex of the whole tree (T nodes).
    Returns (output (b, T_new, hidden), MixerTreeInputs of all T nodes).
    """
    batch, T_new, _ = hidden_states.shape
    T_old = 0 if previous is None else previous.x.shape[1]
    dtype = hidden_states.dtype
    falcon = hasattr(mixer, "mup_vector")
    if falcon:
        hidden_states = hidden_states * mixer.ssm_in_multiplier
    projected = mixer.in_proj(hidden_states)
    if falcon:
        projected = projected * mixer.mup_vector
    gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    if previous is not None:
        xbc = torch.cat([previous.xbc, xbc], dim=1)
    # Old nodes' conv outputs and SSM outputs are recomputed and dropped: the O(T) and O(T^2) parts are cheap
    # next to the projections, which only the new nodes go through.
    conv_out = tree_conv1d(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, tree, cache_layer.conv_states[0],
                           activation=mixer.activation)[:, T_old:]
    group_width = mixer.n_groups * mixer.ssm_state_size
    x, B, C = conv_out.split([mixer.intermediate_size, group_width, group_width], dim=-1)
    new = MixerTreeInputs(xbc[:, T_old:], x.reshape(batch, T_new, mixer.num_heads, mixer.head_dim), dt,
                          B.reshape(batch, T_new, mixer.n_groups, mixer.ssm_state_size),
                          C.reshape(batch, T_new, mixer.n_groups, mixer.ssm_state_size))
    seen = new if previous is None else previous.extended(new)
    A = -torch.exp(mixer.A_log.float())
    y = tree_scan(seen.x, seen.dt, A, seen.B, seen.C, tree, D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True,
                  initial_states=cache_layer.recurrent_states[0])[:, T_old:]
    y = y.reshape(batch, T_new, mixer.intermediate_size)
    if falcon and not mixer.mamba_rms_norm:
        y = y * F.silu(gate)
    else:
        y = mixer.norm(y, gate)
    return mixer.out_proj(y.to(dtype)), seen


def commit_mixers(mixers, cache, stash, tree, nodes):
    """Overwrite every mixer's cached conv and SSM states, in place, with those after path(nodes[b]).

    cache: the HF cache (layers[m.layer_idx] holds conv_states[0] / recurrent_states[0]); stash: {layer_idx:
    MixerTreeInputs} of the tree pass. Heads are independent in the SSM and channels in the depthwise conv, so
    layers whose states have equal shapes are stacked along those axes: the model commits in one tree_states and
    one tree_conv_state call per group of equal layers instead of two per layer.
    """
    groups = {}
    for m in mixers:
        layer = cache.layers[m.layer_idx]
        conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
        key = (conv.shape, conv.dtype, conv.device, ssm.shape, ssm.dtype, stash[m.layer_idx].B.shape[2])
        groups.setdefault(key, []).append((m, layer, stash[m.layer_idx]))
    for group in groups.values():
        _commit_group(*zip(*group), tree, nodes)


def _commit_group(mixers, cache_layers, inputs, tree, nodes):
    def stacked(tensors, dim):
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)

    ssm_states = [layer.recurrent_states[0] for layer in cache_layers]
    conv_states = [layer.conv_states[0] for layer in cache_layers]
    A = stacked([-torch.exp(m.A_log.float()) for m in mixers], 0)
    new_ssm = tree_states(stacked([i.x for i in inputs], 2), stacked([i.dt for i in inputs], 2), A,
                          stacked([i.B for i in inputs], 2), tree, nodes,
                          dt_bias=stacked([m.dt_bias for m in mixers], 0), dt_softplus=True,
                          initial_states=stacked(ssm_states, 1))
    new_conv = tree_conv_state(stacked([i.xbc for i in inputs], 2), tree, nodes, stacked(conv_states, 1))
    for state, new in zip(ssm_states, new_ssm.split(ssm_states[0].shape[1], dim=1)):
        state.copy_(new)
    for state, new in zip(conv_states, new_conv.split(conv_states[0].shape[1], dim=1)):
        state.copy_(new)
