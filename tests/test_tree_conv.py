import pytest
import torch
from transformers.models.mamba2.modeling_mamba2 import causal_conv1d_update

from loops import BACKENDS, KINDS, conv_loop, conv_windows_loop, random_rows
from stree.triton_kernels import tree_conv1d, tree_conv_state

def make_inputs(rows, dim=12, width=4, state_len=4, seed=0, dtype=torch.float32, device="cpu", bias=True):
    g = torch.Generator().manual_seed(seed)
    batch, T = len(rows), len(rows[0])
    return dict(x=torch.randn(batch, T, dim, generator=g).to(device, dtype),
                weight=torch.randn(dim, width, generator=g).to(device, dtype),
                bias=torch.randn(dim, generator=g).to(device, dtype) if bias else None,
                parents=torch.tensor(rows, device=device),
                conv_state=torch.randn(batch, dim, state_len, generator=g).to(device, dtype))


def cpu(args):
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 6, 37])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_conv1d_matches_loop(backend, kind, T, seed, device):
    args = make_inputs(random_rows(kind, T, batch=2, seed=seed), dim=70, seed=seed, device=device)
    y = tree_conv1d(**args, backend=backend)
    assert y.shape == args["x"].shape and y.dtype == args["x"].dtype
    torch.testing.assert_close(y.double().cpu(), conv_loop(**cpu(args)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width, state_len, bias, activation", [
    (4, 3, True, "silu"), (2, 5, False, None), (1, 1, True, "identity"), (3, 2, False, "swish")])
def test_tree_conv1d_shapes_and_options(backend, width, state_len, bias, activation, device):
    args = make_inputs(random_rows("random", 15, batch=3, seed=2), width=width, state_len=state_len, bias=bias,
                       seed=2, device=device)
    y = tree_conv1d(**args, activation=activation, backend=backend)
    want = conv_loop(**cpu(args), silu=activation in ("silu", "swish"))
    torch.testing.assert_close(y.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_conv1d_low_precision(backend, dtype, device):
    args = make_inputs(random_rows("random", 10, batch=2, seed=3), seed=3, dtype=dtype, device=device)
    y = tree_conv1d(**args, backend=backend)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double().cpu(), conv_loop(**cpu(args)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_equals_hf_causal_conv(backend, device):
    """On a chain, the tree conv is HF's own causal conv continuing from the conv state."""
    T = 9
    args = make_inputs([list(range(-1, T - 1))] * 2, seed=4, device=device)
    y = tree_conv1d(**args, backend=backend)
    state = args["conv_state"].clone()
    y_hf = causal_conv1d_update(args["x"].transpose(1, 2), state, args["weight"], args["bias"], "silu")
    torch.testing.assert_close(y, y_hf.transpose(1, 2))
    # HF's update also leaves the state after the whole chain in `state`: that is the commit of the last node.
    new = tree_conv_state(args["x"], args["parents"], torch.full((2,), T - 1, device=device),
                          args["conv_state"], backend=backend)
    torch.testing.assert_close(new, state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("state_len", [3, 4, 6])
def test_tree_conv_state_matches_loop(backend, kind, state_len, device):
    T = 13
    args = make_inputs(random_rows(kind, T, batch=4, seed=state_len), dim=70, state_len=state_len, seed=state_len,
                       device=device)
    nodes = [-1, 0, T - 1, 5]
    new = tree_conv_state(args["x"], args["parents"], torch.tensor(nodes, device=device), args["conv_state"],
                          backend=backend)
    assert new.shape == args["conv_state"].shape and new.dtype == args["conv_state"].dtype
    want = conv_windows_loop(args["x"].cpu(), args["parents"].cpu(), args["conv_state"].cpu(), state_len,
                             [[n] for n in nodes])[:, 0].transpose(1, 2)
    torch.testing.assert_close(new.double().cpu(), want)
    torch.testing.assert_close(new[0], args["conv_state"][0])


@pytest.mark.parametrize("change, message", [
    (dict(parents=torch.tensor([[-1, 1, 0]])), "topological"),
    (dict(weight=torch.zeros(5, 4)), "weight must have shape"),
    (dict(conv_state=torch.zeros(1, 4, 2)), "needs at least 3"),
    (dict(conv_state=torch.zeros(2, 4, 4)), "conv_state must have shape"),
    (dict(bias=torch.zeros(3)), "bias must have shape"),
    (dict(activation="gelu"), "activation"),
])
def test_tree_conv1d_rejects_bad_input(change, message):
    args = dict(x=torch.zeros(1, 3, 4), weight=torch.zeros(4, 4), bias=None, parents=torch.tensor([[-1, 0, 1]]),
                conv_state=torch.zeros(1, 4, 4))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_conv1d(**args)


def test_tree_conv_state_rejects_bad_nodes():
    with pytest.raises(ValueError, match="out of range"):
        tree_conv_state(torch.zeros(1, 3, 4), torch.tensor([[-1, 0, 1]]), torch.tensor([3]), torch.zeros(1, 4, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_permuted_inputs(backend, device):
    args = make_inputs(random_rows("random", 9, batch=2, seed=8), seed=8, device=device)
    permuted = args["x"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous strides
    torch.testing.assert_close(tree_conv1d(**dict(args, x=permuted), backend=backend),
                               tree_conv1d(**args, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_tree_conv1d_rows_match_loop(backend, kind, device):
    """rows= computes the chosen nodes only, per batch row or shared, each equal to the naive loop."""
    T = 19
    args = make_inputs(random_rows(kind, T, batch=2, seed=4), dim=20, seed=4, device=device)
    want = conv_loop(**cpu(args))
    shared = torch.tensor([18, 3, 3, 0])
    per_row = torch.tensor([[1, 2, 17], [16, 0, 9]])
    torch.testing.assert_close(tree_conv1d(**args, rows=shared.to(device), backend=backend).double().cpu(),
                               want[:, shared], rtol=1e-5, atol=1e-5)
    got = tree_conv1d(**args, rows=per_row.to(device), backend=backend).double().cpu()
    torch.testing.assert_close(got, torch.stack([want[b, per_row[b]] for b in range(2)]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_tree_conv(backend, device):
    """T = 0: no outputs, and the conv state comes back unchanged."""
    args = make_inputs([[-1]], seed=9, device=device)
    empty = dict(args, x=args["x"][:, :0], parents=args["parents"][:, :0])
    assert tree_conv1d(**empty, backend=backend).shape == (1, 0, 12)
    state = tree_conv_state(empty["x"], empty["parents"], torch.tensor([-1], device=device), args["conv_state"],
                            backend=backend)
    torch.testing.assert_close(state, args["conv_state"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lfm2_short_conv_is_a_tree_conv_without_activation(backend, device):
    """LFM2's gated short conv (Lfm2ShortConv: in_proj -> B, C, x; depthwise conv of B*x with a conv_L_cache-wide
    kernel, no activation; y = C * conv; out_proj) on a chain equals tree_conv1d(B*x, activation=None) gated by C,
    continuing from HF's own conv state after a prefix (which holds conv_L_cache = width columns); the commit of the
    chain's last node is HF's conv state after decoding it token by token."""
    from transformers import DynamicCache, Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    config = Lfm2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, conv_L_cache=3, conv_bias=True,
                        layer_types=["conv", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=32)
    torch.manual_seed(0)
    mixer = Lfm2ShortConv(config, layer_idx=0).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prefix, chain = (torch.randn(2, n, 16, generator=g).to(device) for n in (5, 7))
    cache = DynamicCache(config=config)
    with torch.no_grad():
        mixer(prefix, cache=cache)
        conv_state = cache.layers[0].conv_states[0].clone()
        want = torch.cat([mixer(chain[:, t:t + 1], cache=cache) for t in range(chain.shape[1])], dim=1)
        B, C, x = mixer.in_proj(chain).chunk(3, dim=-1)
        parents = torch.arange(chain.shape[1], device=device).expand(2, -1) - 1
        conv = tree_conv1d(B * x, mixer.conv.weight[:, 0], mixer.conv.bias, parents, conv_state, activation=None,
                           backend=backend)
        torch.testing.assert_close(mixer.out_proj(C * conv), want)
        new_state = tree_conv_state(B * x, parents, torch.full((2,), chain.shape[1] - 1, device=device), conv_state,
                                    backend=backend)
    assert conv_state.shape[2] == config.conv_L_cache == mixer.conv.weight.shape[2]
    torch.testing.assert_close(new_state, cache.layers[0].conv_states[0])
