"""A recorder of what makes the host wait for the device, for tests on the CPU (where nothing waits)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncs(TorchDispatchMode):
    """Records what makes the host wait for the device: ops that read a value or size a result by the values (seen
    by dispatch), and the tensor methods that hand values to Python (.tolist() reads without dispatching)."""

    SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
                   "aten::_unique2", "aten::repeat_interleave"}
    READING_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy")

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen = []
        for name in self.READING_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._recording(name, getattr(torch.Tensor, name)))

    def _recording(self, name, method):
        def reading(tensor, *args, **kwargs):
            self.seen.append(name)
            return method(tensor, *args, **kwargs)
        return reading

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING_OPS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))
