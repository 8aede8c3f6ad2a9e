"""Shared pinned memory: memfd segments, the pool with budgets and generation-checked
handles (and the extent allocator it and the storage devices cut space with), huge pages,
the staging (bounce) buffers."""
from fuyoud.memory.allocator import ExtentAllocator, OutOfSpace
from fuyoud.memory.hugepages import HugePagePolicy
from fuyoud.memory.pool import BufferRef, Pool, PoolUsage
from fuyoud.memory.staging import StagingPool

__all__ = ["BufferRef", "ExtentAllocator", "HugePagePolicy", "OutOfSpace", "Pool", "PoolUsage", "StagingPool"]
