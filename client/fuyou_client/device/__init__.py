"""The compute device (devices.py: one interface, the CPU's and CUDA's) and giving the
training process's freed heap back to the system (heap.py)."""
from fuyou_client.device.devices import DONE, CudaDevice, Device, HostDevice, after, call_into, cuda_reserve, resolve

__all__ = ["Device", "HostDevice", "CudaDevice", "resolve", "after", "call_into", "DONE", "cuda_reserve"]
