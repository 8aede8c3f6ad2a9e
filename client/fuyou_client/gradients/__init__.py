"""Gradients between backward and the step: one interface with a class per strategy
(strategy.py), the pool of offloaded groups' buffers (pool.py), accumulation in host
memory (host.py), exact clipping (clipping.py) and the read-only guard on submitted
gradients (guard.py)."""
from fuyou_client.gradients.clipping import Clipper, coefficient_of
from fuyou_client.gradients.strategy import GradientStrategy, HostAccumulated, Pooled, Resident, Start

__all__ = ["GradientStrategy", "Resident", "Pooled", "HostAccumulated", "Start", "Clipper", "coefficient_of"]
