"""A batched step decoder: many forked states advanced one token per forward pass, one batch row each.

Every row has its own state: SSM conv / recurrent states (fixed size, so rows stack) and, for hybrid models,
attention K/V. Rows differ in length, so the K/V of all rows live in one padded tensor (B, kv_heads, W, head_dim)
with a (B, W) mask of each row's valid columns; the model gets that mask as an additive 4D attention mask and each
row's own position ids. A row's columns need not be contiguous or aligned with other rows': attention does not
depend on where a key sits, only on the mask, and RoPE was applied with the row's own positions when the key was
written. The batch is re-packed (valid columns moved to the front) when padding outgrows the data.

    batch = RowBatch(model, root)                  # empty; root: a batch-1 PolicyState (Policy.prefill)
    batch.add([RowBatch.snapshot(root), state_b])  # rows from snapshots (RowStates)
    batch.select(torch.tensor([0, 0, 1]))          # fork row 0, keep row 1, drop the rest
    logits = batch.advance([5, 7, 2])              # one token per row -> (B, vocab)
    snapshot = batch.row(1)                        # a RowState to park, verify, or add again later
"""
import copy
from dataclasses import dataclass

import torch


@dataclass
class RowState:
    """One row's state outside the batch (a forked snapshot), batch dimension 1."""
    tensors: list            # per-row cache tensors in _slots order; K/V hold only this row's valid columns
    length: int              # tokens consumed (the next token's position)
    logits: torch.Tensor     # (vocab,) next-token logits
    hidden: torch.Tensor     # (hidden,) last layer's hidden state at the latest token


def _slots(cache):
    """Where the per-row tensors of an HF cache live: (container, key, is_kv) for every tensor whose dim 0 is
    the batch. Containers are the conv / recurrent state dicts of SSM layers and the attention layers themselves."""
    slots = []
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None) or {}
            slots += [(states, key, False) for key, t in states.items() if isinstance(t, torch.Tensor)]
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                slots.append((layer, name, True))
    return slots


def _get(slot):
    container, key, _ = slot
    return container[key] if isinstance(container, dict) else getattr(container, key)


def _put(slot, tensor):
    container, key, _ = slot
    if isinstance(container, dict):
        container[key] = tensor
    else:
        setattr(container, key, tensor)


class RowBatch:
    """Rows of forked states decoded together; starts empty. `template` (a batch-1 PolicyState, e.g. the prompt's)
    supplies the cache layout."""

    def __init__(self, model, template):
        self.model = model
        self.cache = copy.deepcopy(template.cache)
        self.slots = _slots(self.cache)
        self.has_kv = any(is_kv for *_, is_kv in self.slots)
        self.mask = torch.ones(1, template.length if self.has_kv else 0, dtype=torch.bool, device=model.device)
        self.lengths = torch.tensor([template.length], device=model.device)
        self.logits, self.hidden = template.logits[None], template.hidden[None]
        self.select(torch.zeros(0, dtype=torch.long))  # mask (B, W) valid K/V columns; lengths (B,); logits (B, V)

    def __len__(self):
        return self.lengths.shape[0]

    @staticmethod
    def snapshot(state):
        """A RowState from a batch-1 PolicyState (e.g. Policy.prefill's)."""
        return RowState([_get(s).clone() for s in _slots(state.cache)], state.length, state.logits, state.hidden)

    def row(self, i):
        """Row i as a RowState (copies; the batch is unchanged)."""
        valid = self.mask[i]
        tensors = [_get(s)[i:i + 1][:, :, valid] if s[2] else _get(s)[i:i + 1].clone() for s in self.slots]
        return RowState(tensors, int(self.lengths[i]), self.logits[i].clone(), self.hidden[i].clone())

    def select(self, index):
        """Keep rows `index` (LongTensor (B',), repeats fork a row, omissions drop it), in that order."""
        index = index.to(self.lengths.device)
        for slot in self.slots:
            _put(slot, _get(slot).index_select(0, index))
        self.mask, self.lengths = self.mask[index], self.lengths[index]
        self.logits, self.hidden = self.logits[index], self.hidden[index]
        self._pack()

    def add(self, states):
        """Append rows from RowStates (their K/V go to the first columns, padding the batch if it is narrower)."""
        if not states:
            return
        width = max([self.mask.shape[1]] + [s.tensors[self._kv_index()].shape[2] for s in states if self.has_kv])
        self._widen(width)
        for i, slot in enumerate(self.slots):
            parts = [_pad_columns(s.tensors[i], width) if slot[2] else s.tensors[i] for s in states]
            _put(slot, torch.cat([_get(slot)] + parts))
        masks = [torch.arange(width, device=self.mask.device) < (s.tensors[self._kv_index()].shape[2]
                                                                  if self.has_kv else 0) for s in states]
        self.mask = torch.cat([self.mask] + [m[None] for m in masks])
        self.lengths = torch.cat([self.lengths, torch.tensor([s.length for s in states], device=self.lengths.device)])
        self.logits = torch.cat([self.logits, torch.stack([s.logits for s in states])])
        self.hidden = torch.cat([self.hidden, torch.stack([s.hidden for s in states])])

    @torch.no_grad()
    def advance(self, tokens):
        """Feed one token per row (list or LongTensor (B,)); returns the new next-token logits (B, vocab)."""
        ids = torch.as_tensor(tokens, device=self.model.device).view(-1, 1)
        if ids.shape[0] != len(self):
            raise ValueError(f"advance needs one token per row: {len(self)} rows, got {ids.shape[0]} tokens")
        kwargs = {}
        if self.has_kv:
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(self), 1)], dim=1)
            additive = torch.zeros(self.mask.shape, dtype=self.model.dtype, device=self.mask.device)
            kwargs["attention_mask"] = additive.masked_fill(~self.mask, torch.finfo(self.model.dtype).min)[:, None, None]
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=self.lengths[:, None],
                         output_hidden_states=True, **kwargs)
        self.lengths = self.lengths + 1
        self.logits, self.hidden = out.logits[:, -1], out.hidden_states[-1][:, -1]
        return self.logits

    def nbytes(self):
        """Bytes the batch's cache tensors occupy, padding included."""
        return sum(_get(s).nbytes for s in self.slots)

    def _kv_index(self):
        return next(i for i, (*_, is_kv) in enumerate(self.slots) if is_kv)

    def _widen(self, width):
        extra = width - self.mask.shape[1]
        if extra > 0:
            for slot in self.slots:
                if slot[2]:
                    _put(slot, _pad_columns(_get(slot), width))
            self.mask = torch.cat([self.mask, self.mask.new_zeros(len(self), extra)], dim=1)

    def _pack(self):
        """Move every row's valid K/V columns to the front and cut the all-padding tail, once padding is more than
        half the width (amortised: each column is moved O(1) times on average)."""
        if not self.has_kv or not len(self):
            return
        keep = int(self.mask.sum(1).max())
        if 2 * keep >= self.mask.shape[1]:
            return
        order = torch.sort((~self.mask).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # (B, keep)
        for slot in self.slots:
            if slot[2]:
                t = _get(slot)
                _put(slot, t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])))
        self.mask = self.mask.gather(1, order)


def _pad_columns(kv, width):
    """K/V (B, heads, L, head_dim) zero-padded to `width` columns."""
    return torch.nn.functional.pad(kv, (0, 0, 0, width - kv.shape[2]))
