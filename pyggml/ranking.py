"""The one order of TOP_K: largest first, equal values lowest index first, NaN below every
number.  Every device's TOP_K keeps it, and so does the sampler over a whole row, so that
both pick the same k tokens in the same order wherever the head is computed."""
from __future__ import annotations

import numpy as np


def top_k_indices(row: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest values of a 1-D row, in the order above."""
    n = row.size
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    row = np.where(np.isnan(row), np.float32(-np.inf), row) if np.isnan(row).any() else row
    if k < n:  # a partition, then a sort of k
        kth = row[np.argpartition(-row, k - 1)[k - 1]]  # the k-th largest value
        above = np.flatnonzero(row > kth)
        ids = np.concatenate([above, np.flatnonzero(row == kth)[:k - above.size]])
    else:
        ids = np.arange(n)
    return ids[np.lexsort((ids, -row[ids]))].astype(np.int64)
