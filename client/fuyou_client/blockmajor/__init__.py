"""Block-major training (``engine.train_step``): the schedule (schedule.py) and the
tensors it keeps between its passes (store.py), the blocks it swaps instead of recomputing
(swapped.py), whose turn it is (turns.py), what it refuses before any work (checks.py)."""
from fuyou_client.blockmajor.checks import check_micro_batches
from fuyou_client.blockmajor.schedule import StepTimes, run
from fuyou_client.blockmajor.store import Store
from fuyou_client.blockmajor.swapped import swapped_blocks
from fuyou_client.blockmajor.turns import micro_batch_rng

__all__ = ["run", "StepTimes", "check_micro_batches", "micro_batch_rng", "Store", "swapped_blocks"]
