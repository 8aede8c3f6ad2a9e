"""The out-of-core optimizer: parameter groups whose fp32 master weights and optimizer
moments live on the SSD array, stepped on the CPU by the daemon."""
from fuyoud.optimizer.buffers import StateBuffers
from fuyoud.optimizer.group import Group
from fuyoud.optimizer.groups import Optimizer
from fuyoud.optimizer.kernels import OptimizerSpec

__all__ = ["Group", "Optimizer", "OptimizerSpec", "StateBuffers"]
