"""The client's memory plan (budget.py): every shared buffer a training process takes from
fuyoud, worked out from the session's pinned budget before anything is allocated; and the
compute device's (device_plan.py), from the same plan, against the device's budget."""
from fuyou_client.memory.budget import (ARENA_DEFAULT, EXPORT_PIECE, DoesNotFit, GroupShape, Limits, MemoryPlan, Wanted,
                                        limits_of, pinned_bytes, plan)
from fuyou_client.memory.device_plan import (DEVICE_GRAD_BUFFERS, DeviceDoesNotFit, DevicePlan, Work, plan_device,
                                             refusal as device_refusal)

__all__ = ["plan", "MemoryPlan", "GroupShape", "Limits", "Wanted", "limits_of", "pinned_bytes", "DoesNotFit",
           "ARENA_DEFAULT", "EXPORT_PIECE", "plan_device", "DevicePlan", "DeviceDoesNotFit", "Work",
           "device_refusal", "DEVICE_GRAD_BUFFERS"]
