"""Distillation losses. Logits are (batch, length, vocab); a mask (batch, length) selects the positions that count.

Teacher logits may be cached as their top-k (values, indices): the KL terms are then taken over the teacher's
top-k support, with the teacher renormalised there and the student's full-vocabulary log-probabilities gathered
at those ids (the usual sparse knowledge distillation).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checks import check_float, check_ids, check_int


@dataclass
class TopK:
    """A teacher's cached top-k logits: values and indices (batch, length, k)."""
    values: torch.Tensor
    indices: torch.Tensor

    @classmethod
    def of(cls, logits, k):
        check_int("teacher top-k", k, 1)
        top = logits.topk(min(k, logits.shape[-1]), dim=-1)
        return cls(top.values, top.indices)


def _masked_mean(per_position, mask):
    if mask is None:
        return per_position.mean()
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp(min=1.0)


def _log_probs(student_logits, teacher, temperature):
    """(student log-probs, teacher log-probs) on the teacher's support, both at `temperature`."""
    check_float("temperature", temperature, 0.0, strict=True)
    vocab = student_logits.shape[-1]
    if isinstance(teacher, TopK):
        if teacher.indices.shape[:-1] != student_logits.shape[:-1] or teacher.values.shape != teacher.indices.shape:
            raise ValueError(f"teacher top-k values {tuple(teacher.values.shape)} / indices "
                             f"{tuple(teacher.indices.shape)} do not fit student logits {tuple(student_logits.shape)}")
        check_ids("the teacher's top-k indices", teacher.indices, vocab)
    elif teacher.shape != student_logits.shape:
        raise ValueError(f"teacher logits {tuple(teacher.shape)} and student logits {tuple(student_logits.shape)} "
                         f"differ in shape (the student must share the teacher's vocabulary)")
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if isinstance(teacher, TopK):
        return student.gather(-1, teacher.indices), F.log_softmax(teacher.values.float() / temperature, dim=-1)
    return student, F.log_softmax(teacher.float() / temperature, dim=-1)


def forward_kl(student_logits, teacher, mask=None, temperature=1.0):
    """KL(teacher || student), scaled by temperature**2 as is usual for distillation."""
    student, teach = _log_probs(student_logits, teacher, temperature)
    per_position = (teach.exp() * (teach - student)).sum(-1)
    return _masked_mean(per_position, mask) * temperature ** 2


def reverse_kl(student_logits, teacher, mask=None, temperature=1.0):
    """KL(student || teacher); with a top-k teacher the student is renormalised over that support."""
    student, teach = _log_probs(student_logits, teacher, temperature)
    if isinstance(teacher, TopK):
        student = student - student.logsumexp(-1, keepdim=True)
    per_position = (student.exp() * (student - teach)).sum(-1)
    return _masked_mean(per_position, mask) * temperature ** 2


def cross_entropy(student_logits, labels, mask=None):
    """Next-token cross-entropy: labels (batch, length) are the tokens each position should predict (ids in
    [0, vocab) where the mask counts; labels at masked-out positions are ignored)."""
    if mask is not None:
        labels = labels.masked_fill(~mask.bool(), 0)
    check_ids("labels", labels, student_logits.shape[-1])
    per_position = F.cross_entropy(student_logits.float().transpose(1, 2), labels, reduction="none")
    return _masked_mean(per_position, mask)


LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "cross_entropy": cross_entropy}


def check_weights(weights):
    """weights: a non-empty dict of LOSSES names to finite weights >= 0, not all 0; ValueError otherwise."""
    if not isinstance(weights, dict) or not weights:
        raise ValueError(f"losses must be a non-empty dict of loss names to weights, got {weights!r}")
    unknown = set(weights) - set(LOSSES)
    if unknown:
        raise ValueError(f"unknown losses {sorted(unknown)}; choose from {sorted(LOSSES)}")
    for name, weight in weights.items():
        check_float(f"the weight of {name}", weight, 0.0, strict=False)
    if not any(weights.values()):
        raise ValueError(f"every loss weight is 0: {weights}")


def mixture_loss(weights, student_logits, teacher, labels, mask=None, temperature=1.0):
    """Weighted sum of named losses, e.g. {"forward_kl": 0.9, "cross_entropy": 0.1}. Returns (loss, parts)."""
    check_weights(weights)
    parts = {}
    for name, weight in weights.items():
        if name == "cross_entropy":
            parts[name] = cross_entropy(student_logits, labels, mask)
        else:
            if teacher is None:
                raise ValueError(f"{name} needs teacher logits")
            parts[name] = LOSSES[name](student_logits, teacher, mask, temperature)
    return sum(w * parts[n] for n, w in weights.items()), {n: float(v.detach()) for n, v in parts.items()}
