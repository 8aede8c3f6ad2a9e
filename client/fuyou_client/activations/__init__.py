"""Activations: keep, swap or recompute per block (policy.py, swapper.py), host memory that spills
to the SSD array (spill.py), and ``activations="auto"`` (autoplan.py, planner.py)."""
from fuyou_client.activations.autoplan import AutoPlanner
from fuyou_client.activations.policy import ActivationPolicy
from fuyou_client.activations.swapper import TREATMENTS, WORDS, ActivationSwapper, treatments

__all__ = ["ActivationSwapper", "ActivationPolicy", "treatments", "TREATMENTS", "WORDS", "AutoPlanner"]
