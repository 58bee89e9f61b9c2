"""Rows of forked states for tree search: RowState (one row's snapshot) and RowBatch (many rows decoded together).

The rows live in an HF cache (transformers' DynamicCache), whose per-row tensors they read and replace through
stree.models.hf_cache (the one module that knows where an HF cache keeps them).

A RowBatch decodes many forked states one token per forward pass, one batch row each. SSM states have a fixed size,
so rows stack; rows differ in length, so the K/V of all rows live in one padded tensor (B, kv_heads, W, head_dim)
with a (B, W) mask of each row's valid columns; the model gets that mask as an additive 4D attention mask and each
row's own position ids. A row's columns need not be contiguous or aligned with other rows': attention does not
depend on where a key sits, only on the mask, and RoPE was applied with the row's own positions when the key was
written. The batch is re-packed (valid columns moved to the front) when padding outgrows the data.

    batch, root = RowBatch.prefill(model, prompt)  # an empty batch, and the prompt's state (a RowState)
    batch.add([root, state_b])                     # rows from snapshots (copies)
    batch.select(torch.tensor([0, 0, 1]))          # fork row 0, keep row 1, drop the rest
    logits = batch.advance([5, 7, 2])              # one token per row -> (B, vocab); commits each row's new K/V
    snapshot = batch.row(1)                        # a RowState to park, verify, or add again later
    batch.held_bytes()                             # the batch's cache tensors + every snapshot still alive
"""
import copy
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..models.hf_cache import cache_slots


def nbytes(tensors):
    """Bytes of a list of tensors."""
    return sum(t.nbytes for t in tensors)


@dataclass(eq=False)
class RowState:
    """One row's state outside a batch (a forked snapshot), batch dimension 1. Released (kv and states None) once
    nothing will fork from it; its hidden state stays (a step embedding)."""
    kv: list                 # K/V tensors (1, kv_heads, length, head_dim) in slot order, only this row's columns
    states: list             # SSM conv / recurrent state tensors (1, ...) in slot order
    length: int              # tokens consumed (the next token's position)
    logits: torch.Tensor     # (vocab,) next-token logits
    hidden: torch.Tensor     # (hidden,) last layer's hidden state at the latest token

    @property
    def held(self):
        return self.states is not None

    def nbytes(self):
        """Bytes of the cache tensors this snapshot holds (0 once released)."""
        return nbytes(self.kv) + nbytes(self.states) if self.held else 0

    def release(self):
        self.kv = self.states = self.logits = None


class RowBatch:
    """Rows of forked states of `model`, decoded together. Made by `prefill` (the cache layout comes from the
    prompt's HF cache); every snapshot it makes is tracked so that held_bytes counts what is really kept."""

    def __init__(self, model, cache, mask, lengths, logits, hidden, snapshots=None):
        """cache: an HF cache of B rows (its per-row tensors become kv_slots and state_slots, CacheSlots); mask
        (B, W) bool: each row's valid K/V columns; lengths (B,) tokens consumed; logits (B, vocab), hidden (B,
        hidden) at each row's latest token; snapshots: the WeakSet that tracks the snapshots made (shared with side
        batches)."""
        self.model, self.cache = model, cache
        slots = cache_slots(cache)
        self.kv_slots = [s for s in slots if s.is_kv]
        self.state_slots = [s for s in slots if not s.is_kv]
        self.mask = mask if self.kv_slots else mask[:, :0]
        self.lengths, self.logits, self.hidden = lengths, logits, hidden
        self.snapshots = weakref.WeakSet() if snapshots is None else snapshots
        self._empty = None                   # (an empty copy of the cache, its (0, W) mask): side batches' layout

    @classmethod
    @torch.no_grad()
    def prefill(cls, model, tokens):
        """(an empty RowBatch, the RowState after `tokens`) for a prompt (list of ids or a (1, P) / (P,) tensor)."""
        tokens = torch.as_tensor(tokens).flatten().tolist()
        if not tokens:
            raise ValueError("the prompt needs at least one token")
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([tokens], device=model.device), cache=cache, use_cache=True,
                    position_ids=torch.arange(len(tokens), device=model.device)[None], output_hidden_states=True,
                    logits_to_keep=1)
        batch = cls(model, cache, torch.ones(1, len(tokens), dtype=torch.bool, device=model.device),
                    torch.tensor([len(tokens)], device=model.device), out.logits[:, -1], out.hidden_states[-1][:, -1])
        root = batch.row(0)
        batch.select(torch.zeros(0, dtype=torch.long))
        batch._cut_columns(0)  # no rows, no columns: a row added to a copy (extend's side batch) has no padding
        batch._empty = (copy.deepcopy(batch.cache), batch.mask.clone())
        return batch, root

    @torch.no_grad()
    def extend(self, states, tokens):
        """The RowStates after feeding tokens[i] on top of snapshot states[i], for every i, in one forward pass of a
        side batch (this batch is unchanged). tokens: one list of ids per state, all of one length L >= 1."""
        if len(states) != len(tokens) or not states or len({len(t) for t in tokens}) != 1 or not tokens[0]:
            raise ValueError(f"extend needs one token list per state, all of one length >= 1: {len(states)} states, "
                             f"token lists of lengths {sorted({len(t) for t in tokens})}")
        cache, mask = self._empty
        side = RowBatch(self.model, copy.deepcopy(cache), mask, self.lengths[:0], self.logits[:0], self.hidden[:0],
                        self.snapshots)
        side.add(states)
        n, L, device = len(states), len(tokens[0]), self.model.device
        positions = side.lengths[:, None] + torch.arange(L, device=device)[None]
        kwargs = {}
        if side.kv_slots:
            padded = not side.mask.all()
            side.mask = torch.cat([side.mask, side.mask.new_ones(n, L)], dim=1)
            if padded:  # rows of different widths: each sees its own valid columns, then the new tokens causally
                W = side.mask.shape[1]
                allowed = side.mask[:, None, :].expand(n, L, W).clone()
                allowed[:, :, W - L:] = torch.ones(L, L, dtype=torch.bool, device=device).tril()
                dtype = self.model.dtype
                kwargs["attention_mask"] = torch.zeros(n, 1, L, W, dtype=dtype, device=device).masked_fill(
                    ~allowed[:, None], torch.finfo(dtype).min)
            # (without padding the model's own causal mask is the right one)
        out = self.model(input_ids=torch.tensor([list(t) for t in tokens], device=device), cache=side.cache,
                         use_cache=True, position_ids=positions, output_hidden_states=True, logits_to_keep=1,
                         **kwargs)
        side._advanced(out, L)
        return [side.row(i) for i in range(n)]

    def __len__(self):
        return self.lengths.shape[0]

    def row(self, i):
        """Row i as a RowState (a fork: copies; the batch is unchanged)."""
        valid = self.mask[i]
        state = RowState([s.get()[i:i + 1][:, :, valid] for s in self.kv_slots],
                         [s.get()[i:i + 1].clone() for s in self.state_slots],
                         int(self.lengths[i]), self.logits[i].clone(), self.hidden[i].clone())
        self.snapshots.add(state)
        return state

    def select(self, index):
        """Keep rows `index` (LongTensor (B',), repeats fork a row, omissions drop it), in that order."""
        index = index.to(self.lengths.device)
        for slot in self.kv_slots + self.state_slots:
            slot.put(slot.get().index_select(0, index))
        self.mask, self.lengths = self.mask[index], self.lengths[index]
        self.logits, self.hidden = self.logits[index], self.hidden[index]
        self._pack()

    def add(self, states):
        """Append rows copied from RowStates (their K/V go to the first columns, padding the batch if narrower)."""
        if not states:
            return
        columns = [s.kv[0].shape[2] if self.kv_slots else 0 for s in states]
        width = max([self.mask.shape[1]] + columns)
        self._widen(width)
        for i, slot in enumerate(self.kv_slots):
            slot.put(torch.cat([slot.get()] + [_pad_columns(s.kv[i], width) for s in states]))
        for i, slot in enumerate(self.state_slots):
            slot.put(torch.cat([slot.get()] + [s.states[i] for s in states]))
        columns = torch.tensor(columns, device=self.mask.device)
        self.mask = torch.cat([self.mask, torch.arange(width, device=self.mask.device)[None] < columns[:, None]])
        self.lengths = torch.cat([self.lengths, torch.tensor([s.length for s in states], device=self.lengths.device)])
        self.logits = torch.cat([self.logits, torch.stack([s.logits for s in states])])
        self.hidden = torch.cat([self.hidden, torch.stack([s.hidden for s in states])])

    @torch.no_grad()
    def advance(self, tokens):
        """Feed one token per row (list or LongTensor (B,)); the model appends each row's new K/V column (committed
        here: the mask grows by one valid column) and SSM states in place. Returns the next-token logits (B, vocab)."""
        ids = torch.as_tensor(tokens, device=self.model.device).view(-1, 1)
        if ids.shape[0] != len(self):
            raise ValueError(f"advance needs one token per row: {len(self)} rows, got {ids.shape[0]} tokens")
        kwargs = {}
        if self.kv_slots:
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(self), 1)], dim=1)
            additive = torch.zeros(self.mask.shape, dtype=self.model.dtype, device=self.mask.device)
            additive = additive.masked_fill(~self.mask, torch.finfo(self.model.dtype).min)
            kwargs["attention_mask"] = additive[:, None, None]  # (B, 1, 1, W)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=self.lengths[:, None],
                         output_hidden_states=True, **kwargs)
        self._advanced(out, 1)
        return self.logits

    def _advanced(self, out, n):
        """After a forward of n tokens per row (their K/V columns already in the mask): lengths, logits, hidden."""
        self.lengths = self.lengths + n
        self.logits, self.hidden = out.logits[:, -1], out.hidden_states[-1][:, -1]

    def nbytes(self):
        """Bytes the batch's cache tensors occupy, padding included."""
        return nbytes(s.get() for s in self.kv_slots + self.state_slots)

    def held_bytes(self):
        """Bytes of cache state really kept: the batch's tensors plus every snapshot it made that is still alive
        and not released."""
        return self.nbytes() + sum(s.nbytes() for s in list(self.snapshots))

    def _cut_columns(self, width):
        """Cut every K/V tensor and the mask to their first `width` columns (the batch's rows must fit in them)."""
        for slot in self.kv_slots:
            slot.put(slot.get()[:, :, :width])
        self.mask = self.mask[:, :width]

    def _widen(self, width):
        extra = width - self.mask.shape[1]
        if extra > 0:
            for slot in self.kv_slots:
                slot.put(_pad_columns(slot.get(), width))
            self.mask = torch.cat([self.mask, self.mask.new_zeros(len(self), extra)], dim=1)

    def _pack(self):
        """Move every row's valid K/V columns to the front and cut the all-padding tail, once padding is more than
        half the width (amortised: each column is moved O(1) times on average)."""
        if not self.kv_slots or not len(self):
            return
        keep = int(self.mask.sum(1).max())
        if 2 * keep >= self.mask.shape[1]:
            return
        order = torch.sort((~self.mask).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # (B, keep)
        for slot in self.kv_slots:
            t = slot.get()
            slot.put(t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])))
        self.mask = self.mask.gather(1, order)


def _pad_columns(kv, width):
    """K/V (B, heads, L, head_dim) zero-padded to `width` columns."""
    return torch.nn.functional.pad(kv, (0, 0, 0, width - kv.shape[2]))
