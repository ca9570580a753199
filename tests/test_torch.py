"""The memory meter's scan of live tensors survives any tensor."""
import torch

from instruments import live_tensor_bytes


def test_live_tensor_scan_survives_a_tensor_without_device():
    """torch 2.8 and 2.9 hold tensors whose .device raises; the gc walk of the memory meter meets them on every rank."""
    class NoDevice(torch.Tensor):
        @property
        def device(self):
            raise RuntimeError("tensor does not have a device")

    cpu = torch.device("cpu")
    before = live_tensor_bytes(cpu)
    odd = torch.Tensor._make_subclass(NoDevice, torch.zeros(4))
    counted = torch.zeros(2**20, dtype=torch.uint8)  # 1 MiB that the scan must still count
    grown = live_tensor_bytes(cpu) - before
    assert 2**20 <= grown < 2**20 + 2**16, grown
    del odd, counted
