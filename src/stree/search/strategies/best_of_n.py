"""Best-of-N: N independent samples, scored step by step, the answer voted among them."""


def best_of_n(live, width, config, context):
    """Every live trajectory gets one continuation (the prompt got config.width): no trajectory is chosen over
    another, each runs until it finishes or reaches max_steps. Returns [(trajectory, 1)] for every live one."""
    return [(t, 1) for t in live]
