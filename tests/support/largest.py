"""How large the largest tensor an operator makes is: what the chunked loss and evaluation promise to bound."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """The most elements any operator's output holds while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
