"""A CPU stand-in for a device without float64 and complex128 (Apple's ``mps``): no Mac runs the tests, so the models'
float32 paths are tested on the CPU with `supports_float64` answering False and every float64 result refused."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

WIDE_DTYPES = (torch.float64, torch.complex128)


class RefuseFloat64(TorchDispatchMode):
    """Raises on any operation with a float64 or complex128 result, as ``mps`` does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in tree_leaves(result):
            if isinstance(value, torch.Tensor) and value.dtype in WIDE_DTYPES:
                raise TypeError(f"{func} made a {value.dtype} tensor, which a device without float64 cannot hold")
        return result


@contextlib.contextmanager
def without_float64(monkeypatch, *modules):
    """``supports_float64`` answers False in ``modules`` (not raising if one lacks it: then its float64 op fails
    under `RefuseFloat64`, as on the device), and float64 results raise."""
    with monkeypatch.context() as patch:
        for module in modules:
            patch.setattr(module, "supports_float64", lambda device: False, raising=False)
        with RefuseFloat64():
            yield
