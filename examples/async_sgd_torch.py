"""The parameter server of ``async_sgd.py`` with its model as torch tensors.

The same wide linear model and training, but the shards, the weights and the
gradients are CPU torch tensors (a dict of them per model, as a
``state_dict`` holds its parameters), and each gradient is made by torch's
``index_add_``. ``dh.reduce`` sums the workers' dicts of tensors field by
field in one tree and gives back a dict of tensors. The trained weights are
checked against numpy's. Needs torch (the ``torch`` extra: the CPU build,
``pip install torch --index-url https://download.pytorch.org/whl/cpu``).

    python examples/async_sgd_torch.py [--emulated] [--params 33554432] [--k 6] [--steps 10]
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import async_sgd  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def to_torch(tree: Any) -> Any:
    """``tree`` with every numpy array a torch tensor sharing its memory."""
    if isinstance(tree, dict):
        return {k: to_torch(v) for k, v in tree.items()}
    return torch.from_numpy(tree) if isinstance(tree, np.ndarray) else tree


if __name__ == "__main__":
    sys.exit(async_sgd.main(convert=to_torch))
