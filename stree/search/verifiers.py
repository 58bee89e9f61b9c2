"""Verifiers score a trajectory's latest step: any callable (prompt_tokens, steps) -> float, or a PRM."""
import torch


class PRMVerifier:
    """An HF process reward model that reads prompt + step_1 + tag + step_2 + tag + ... and, at each tag, scores
    the step before it by P(good) among the two label tokens (Math-Shepherd style).

    Returns the latest step's score in [0, 1].
    """

    def __init__(self, model, *, step_tag_id, good_token_id, bad_token_id):
        self.model = model.eval()
        self.step_tag_id, self.labels = step_tag_id, [good_token_id, bad_token_id]

    @torch.no_grad()
    def __call__(self, prompt, steps):
        tokens = list(prompt)
        for step in steps:
            tokens += list(step) + [self.step_tag_id]
        logits = self.model(input_ids=torch.tensor([tokens], device=self.model.device)).logits[0, -1]
        return float(logits[self.labels].float().softmax(-1)[0])
