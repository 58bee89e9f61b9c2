"""Verifiers score a trajectory's latest step: any callable (prompt_tokens, steps) -> float, or a PRM.

A verifier may also offer `batch(prompt_tokens, steps_list) -> list[float]`, scoring many trajectories at once
(PRMVerifier: one padded forward pass); score_batch uses it when present and loops otherwise.
"""
import torch


class PRMVerifier:
    """An HF process reward model that reads prompt + step_1 + tag + step_2 + tag + ... and, at each tag, scores
    the step before it by P(good) among the two label tokens (Math-Shepherd style).

    Returns the latest step's score in [0, 1].
    """

    def __init__(self, model, *, step_tag_id, good_token_id, bad_token_id):
        self.model = model.eval()
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
        width = max(len(s) for s in sequences)
        ids = torch.tensor([s + [self.step_tag_id] * (width - len(s)) for s in sequences], device=self.model.device)
        last = torch.tensor([len(s) - 1 for s in sequences], device=self.model.device)
        logits = self.model(input_ids=ids).logits[torch.arange(len(sequences), device=ids.device), last]
        return logits[:, self.labels].float().softmax(-1)[:, 0].tolist()


def score_batch(verifier, prompt, steps_list):
    """Scores (list of floats) of the latest step of each trajectory in steps_list, in one batch if the verifier
    has a `batch` method."""
    if hasattr(verifier, "batch"):
        return [float(s) for s in verifier.batch(prompt, steps_list)]
    return [float(verifier(prompt, steps)) for steps in steps_list]
