"""Block-major training (``engine.train_step``): the schedule (schedule.py) and the
tensors it keeps between its passes (store.py)."""
from fuyou_client.blockmajor.schedule import StepTimes, check_micro_batches, micro_batch_rng, run
from fuyou_client.blockmajor.store import Store

__all__ = ["run", "StepTimes", "check_micro_batches", "micro_batch_rng", "Store"]
