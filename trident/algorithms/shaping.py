"""Reward shaping by response length.

DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13; the formula as given in
``shared/reference/peers-mechanisms.md`` §1.2 (iv)): with ``L_max`` the response budget and
``L_cache`` the soft window at its end, a response of ``L`` tokens earns

    R_len(L) = 0                               if L <= L_max - L_cache
               ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max
               -1                              if L > L_max

added to its task reward: a linear ramp from 0 to -1 over the last ``L_cache`` tokens, so a
response nearing the limit is discouraged before it is cut off.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO's R_len for each response length in ``lengths`` ([B], any dtype) -> [B] float."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    lengths = lengths.to(torch.float64)
    start = max_len - buffer
    ramp = (start - lengths) / buffer
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, torch.full_like(lengths, -1.0), penalty)
