"""The client's memory plan (budget.py): every shared buffer a training process takes from
fuyoud, worked out from the session's pinned budget before anything is allocated."""
from fuyou_client.memory.budget import (ARENA_DEFAULT, EXPORT_PIECE, DoesNotFit, GroupShape, Limits, MemoryPlan, Wanted,
                                        limits_of, pinned_bytes, plan)

__all__ = ["plan", "MemoryPlan", "GroupShape", "Limits", "Wanted", "limits_of", "pinned_bytes", "DoesNotFit",
           "ARENA_DEFAULT", "EXPORT_PIECE"]
