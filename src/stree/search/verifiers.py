"""Verifiers score a trajectory's latest step: any callable (prompt_tokens, steps) -> float, or a PRM.

A verifier may also offer `batch(prompt_tokens, steps_list) -> list[float]`, scoring many trajectories at once
(PRMVerifier: one padded forward pass); score_batch uses it when present and loops otherwise. Scores must be
finite (check_score raises ValueError otherwise).
"""
import math

import torch

from ..checks import check_token_ids, vocab_size


def check_score(score):
    """`score` as a float; ValueError unless it is a finite number (NaN or infinite scores would silently break
    every ranking and allocation)."""
    value = float(score)
    if not math.isfinite(value):
        raise ValueError(f"a verifier returned the score {value}: scores must be finite numbers")
    return value


class PRMVerifier:
    """An HF process reward model that reads prompt + step_1 + tag + step_2 + tag + ... and, at each tag, scores
    the step before it by P(good) among the two label tokens (Math-Shepherd style).

    Returns the latest step's score in [0, 1].
    """

    def __init__(self, model, *, step_tag_id, good_token_id, bad_token_id):
        self.model = model.eval()
        self.vocab = vocab_size(model)
        for name, value in (("step_tag_id", step_tag_id), ("good_token_id", good_token_id),
                            ("bad_token_id", bad_token_id)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab:
                raise ValueError(f"{name} is {value!r}, not a token id of the PRM's vocabulary of {self.vocab} ids")
        self.step_tag_id, self.labels = step_tag_id, [good_token_id, bad_token_id]

    def __call__(self, prompt, steps):
        return self.batch(prompt, [steps])[0]

    @torch.no_grad()
    def batch(self, prompt, steps_list):
        """Scores of several trajectories from one forward pass over their right-padded token sequences (B, L):
        the model is causal, so the padding after a sequence's last tag never reaches its score."""
        sequences = []
        for steps in steps_list:
            tokens = list(prompt)
            for step in steps:
                tokens += list(step) + [self.step_tag_id]
            sequences.append(tokens)
        check_token_ids("the PRM's input", [t for s in sequences for t in s], self.vocab, owner="its")
        width = max(len(s) for s in sequences)
        ids = torch.tensor([s + [self.step_tag_id] * (width - len(s)) for s in sequences], device=self.model.device)
        last = torch.tensor([len(s) - 1 for s in sequences], device=self.model.device)
        logits = self.model(input_ids=ids).logits[torch.arange(len(sequences), device=ids.device), last]
        return logits[:, self.labels].float().softmax(-1)[:, 0].tolist()


def score_batch(verifier, prompt, steps_list):
    """Scores (list of floats) of the latest step of each trajectory in steps_list, in one batch if the verifier
    has a `batch` method."""
    if hasattr(verifier, "batch"):
        return [check_score(s) for s in verifier.batch(prompt, steps_list)]
    return [check_score(verifier(prompt, steps)) for steps in steps_list]
