"""bench/gpu.py's ZeRO-Infinity case: its DeepSpeed configuration (a pure function, tested on
the CPU: tests/test_gpu_bench.py) and the case that runs it (DeepSpeed on a GPU; on the CPU
only through the smoke test's stand-in for DeepSpeed, which checks how the case calls it).

Configured as a user of ZeRO-Infinity would for this model and a capped GPU:

* ``--zero-params cpu`` (the default): the bf16 parameters offloaded to pinned CPU memory
  (``offload_param.device = "cpu"``), the fp32 masters and Adam moments on NVMe
  (``offload_optimizer.device = "nvme"``, ``pipeline_read``/``pipeline_write``, and
  ``buffer_count`` = 3 swap operations in flight (the tile read ahead, the tile stepped,
  the tile written behind) x 4 tensors each (fp32 parameter, two moments, gradient):
  DeepSpeed's pipelined swapper asserts when it runs out); prefetch on (one block's
  parameters ahead, DeepSpeed's default 5e7 at width 2048); ``stage3_max_reuse_distance``
  two blocks' parameters, so that a block's parameters fetched for its recompute in backward
  are still there for its backward (between the two uses lie the block's other
  parameters, twice); ``stage3_max_live_parameters`` four blocks; the model built under
  ``deepspeed.zero.Init``.
* ``--zero-params nvme``: the parameters on NVMe too, as Fuyou's ``offload=True`` keeps
  them. What it costs: DeepSpeed accumulates micro-batch by micro-batch, so every
  micro-batch reads every block's parameters from NVMe in forward and again in backward
  (2 x 2 bytes per parameter, 4.4 GB a micro-batch for 1.09B parameters, about 2 s at
  2 GB/s). And its NVMe prefetch cannot be used: with activation checkpointing the trace
  lists a block's parameters twice (forward replay and backward) and
  ``__prefetch_nvme_param_partitions`` (partitioned_param_coordinator.py, DeepSpeed 0.19)
  queues such a parameter twice ("param ... already assigned swap buffer id", the H100
  run). So prefetch is off (``stage3_prefetch_bucket_size: 0``, which skips that path,
  unless ``--zero-prefetch`` says otherwise): each read waits for the SSD while the GPU
  idles. Fuyou's block-major schedule reads each block once per step and direction.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from gpu_cases import LR, VOCAB, WD, Case, MicroTooLarge, checkpoint_activations, config

SWAP_OPS_IN_FLIGHT, TENSORS_PER_SWAP = 3, 4  # pipelined read + step + pipelined write; fp32 param, 2 moments, grad


def block_params(width: int) -> int:
    """Parameters of one GPT-2 block (attention 4w^2 + MLP 8w^2, biases and norms 13w)."""
    return 12 * width * width + 13 * width


def zero_config(*, micro: int, accum: int, width: int, nvme_path: str, params: str = "cpu",
                prefetch: int | None = None) -> dict:
    """The DeepSpeed configuration of the ZeRO-Infinity case (see the module's docstring).
    ``params``: where the parameters live, "cpu" or "nvme"; ``prefetch``: the prefetch
    bucket in parameters (default: one block on "cpu", 0 on "nvme")."""
    if params not in ("cpu", "nvme"):
        raise ValueError(f"params must be 'cpu' or 'nvme', not {params!r}")
    block = block_params(width)
    if prefetch is None:
        prefetch = max(int(5e7), block) if params == "cpu" else 0
    offload_param = {"device": params, "pin_memory": True}
    if params == "nvme":
        # Each parameter swapped in from NVMe takes one pinned buffer of buffer_size elements
        # until it is released: room for the largest tensor (the head) and for the parameters
        # the reuse distance keeps (two blocks, four large matrices each) with margin.
        offload_param.update(nvme_path=nvme_path, buffer_count=32, buffer_size=VOCAB * width, max_in_cpu=0)
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
        "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": int(1e8),
            "reduce_bucket_size": int(5e7),  # (default 5e8: a 1 GB bf16 bucket does not fit the cap)
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": int(1e5),
            "stage3_max_reuse_distance": 2 * block,
            "stage3_max_live_parameters": 4 * block,
            "offload_param": offload_param,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                  "buffer_count": SWAP_OPS_IN_FLIGHT * TENSORS_PER_SWAP,
                                  "pipeline_read": True, "pipeline_write": True}},
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
    }


class Zero(Case):
    """DeepSpeed ZeRO-3 with the optimizer on NVMe (ZeRO-Infinity) on Fuyou's model: bf16,
    activation checkpointing, ``--zero-accum`` micro-batches of ``--zero-micro`` a step."""
    plain_flops = True  # (its FLOPs counted without FlopCounterMode's module hooks: gpu_cases.Flops)

    def __init__(self, spec):
        super().__init__(spec)
        self.micro, self.accum = spec["zero_micro"], spec["zero_accum"]
        with socket.socket() as s:  # (a free port: a worker started again must not meet its predecessor's)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import deepspeed
        import transformers
        torch, nvme = self.torch, Path(spec["dir"]) / "zero-nvme"
        shutil.rmtree(nvme, ignore_errors=True)  # (a predecessor's swap files)
        nvme.mkdir(parents=True)
        cfg = zero_config(micro=self.micro, accum=self.accum, width=spec["width"], nvme_path=str(nvme),
                          params=spec["zero_params"], prefetch=spec["zero_prefetch"])
        self.cap()
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=spec["zero_params"], pin_memory=True,
                                 dtype=torch.bfloat16):
            torch.manual_seed(0)
            net = transformers.GPT2LMHeadModel(config(spec["width"], spec["layers"], spec["seq"]))
        checkpoint_activations(net)
        self.engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        self.probe()
        self.info = {"layers": spec["layers"], "params": spec["params"], "micro": self.micro, "accum": self.accum,
                     "deepspeed": deepspeed.__version__, "config": cfg}

    def probe(self) -> None:
        """One forward and backward within 90% of the cap (its gradients join the first
        step's; DeepSpeed counts a micro-batch at engine.step(), so the steps stay aligned).
        Out of memory: MicroTooLarge, and the run starts a new worker with half the micro-batch."""
        try:
            self.cap(0.9)
            x = self.batch()
            loss = self.engine(x, labels=x).loss
            self.engine.backward(loss)
            self.sync()
            self.cap()
        except self.torch.OutOfMemoryError as exc:
            raise MicroTooLarge(str(exc).splitlines()[0][:300]) from exc

    def micro_batch(self, x) -> None:
        loss = self.engine(x, labels=x).loss
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # (counts the micro-batch; the boundary's step is step() below)
        self.loss = loss.detach()

    def step(self) -> None:
        self.engine.step()  # the optimizer step: state read from and written to NVMe
