"""A two-sample chi-square test, for checking that speculation leaves the sampled distribution as is."""

import torch


def chi_square_pvalue(a: list, b: list, min_count: int = 5) -> float:
    """p-value of "a and b are draws from one categorical distribution". A test that cannot be
    computed (fewer than two categories with `min_count` draws in all) fails instead of passing."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[sum(x == c for x in s) for c in cats] for s in (a, b)], dtype=torch.float64)
    table = table[:, table.sum(0) >= min_count]
    dof = table.shape[1] - 1
    assert dof >= 1, (f"chi-square: {len(a)} + {len(b)} draws leave {table.shape[1]} categories with >= "
                      f"{min_count} draws; the test cannot be computed (draw more, or widen the distribution)")
    exp = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
