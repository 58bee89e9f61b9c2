"""Chi-square goodness-of-fit helpers for the statistical tests (seeded samples, able to fail)."""
import math


def chi_square_critical(df, z=3.719):
    """Upper quantile of chi-square(df) at the normal quantile z (3.719: alpha = 1e-4), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts, probs):
    """(statistic, df) of observed counts (dict outcome -> n) against exact probs (dict outcome -> p).

    Outcomes with expected count < 5 are pooled into one cell. An observation of a zero-probability outcome makes
    the statistic infinite."""
    n = sum(counts.values())
    if any(probs.get(k, 0.0) == 0.0 for k in counts):
        return float("inf"), 1
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for k, p in probs.items():
        if n * p >= 5:
            cells.append((counts.get(k, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(k, 0), pooled_exp + n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    return sum((o - e) ** 2 / e for o, e in cells), max(len(cells) - 1, 1)


def assert_matches(counts, probs):
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df), f"chi-square {stat:.1f} > {chi_square_critical(df):.1f} (df {df})"
