"""The step coordinator (coordinator.py): counting gradients, submitting each group's
step when they are final, the barrier, errors."""
from fuyou_client.steps.coordinator import StepCoordinator

__all__ = ["StepCoordinator"]
