"""bench/gpu.py's own plumbing, on the CPU (``--cpu``): worker processes, interleaved
rounds, Fuyou through the stand-in for a device with its own memory (host weights and
host gradient accumulation, as on the GPU) on both schedules (block-major through
``engine.train_step``, and the loop), the capped ceiling's search and the same model in
memory, the fits' fallbacks (``--cpu-oom-above`` stands in for the cap), the FLOP counts,
the probes that run without CUDA, ``--profile``'s traces, ZeRO-Infinity's configuration
and restart, and the JSON keys issues 7 and 17 ask for. Its numbers mean nothing here;
they come from a GPU host. What this catches is a run that breaks before it measures,
which costs a GPU session its time."""
from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--cpu", "--width", "128", "--seq", "32", "--cap", "9MiB", "--iters", "1", "--ssd-probe", "64MiB",
         "--probe-bytes", "16MiB", "--host-budget", "256MiB", "--buffer-budget", "128MiB", "--grads", "host"]
HEADLINE = ("fuyou_tflops", "fuyou_hw_tflops", "inmem_ceiling_tflops", "inmem_ceiling_hw_tflops",
            "inmem_same_model_tflops", "inmem_same_model_tflops_rounds", "inmem_same_model_hw_tflops",
            "fuyou_over_ceiling", "fuyou_over_inmem_same_model", "zero_infinity_tflops", "zero_infinity_hw_tflops",
            "gpu_busy_fraction", "model_params", "model_flops_per_token", "gpu_cap_bytes", "ssd_read_GBps",
            "ssd_write_GBps", "pcie_h2d_GBps", "pcie_d2h_GBps", "host_add_GBps", "schedule", "why_null")


# A stand-in for DeepSpeed, for the ZeRO-Infinity case's own code on the CPU: it checks how the
# case calls it (zero.Init with the config's device and bf16; a step at each accumulation
# boundary, after that many backward passes, the set-up's probe counted in the first) and
# trains with torch's AdamW. What DeepSpeed itself does with the configuration needs a GPU.
DEEPSPEED = """
import contextlib, torch
__version__ = "stand-in"

class zero:
    @staticmethod
    @contextlib.contextmanager
    def Init(config_dict_or_path, remote_device, pin_memory, dtype):
        assert config_dict_or_path["zero_optimization"]["offload_param"]["device"] == remote_device
        assert pin_memory and dtype == torch.bfloat16
        yield

class Engine:
    def __init__(self, model, config):
        self.model, self.gas, self.micro_steps, self.backwards = model.to(torch.bfloat16), 0, 0, 0
        self.gas = config["gradient_accumulation_steps"]
        self.opt = torch.optim.AdamW(model.parameters(), **config["optimizer"]["params"])

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss):
        loss.backward()
        self.backwards += 1

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def step(self):
        if self.is_gradient_accumulation_boundary():
            assert self.backwards in (self.gas, self.gas + 1), (self.backwards, self.gas)
            self.opt.step()
            self.opt.zero_grad()
            self.backwards = 0
        self.micro_steps += 1

def initialize(model, model_parameters, config):
    assert config["zero_optimization"]["stage"] == 3
    return Engine(model, config), None, None, None
"""


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("gpu"), importlib.import_module("gpu_zero")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def start(tmp: Path, name: str, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"{name}.json"
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu.py"), *SMALL, "--json", str(out),
                             "--dir", str(tmp), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env), out


def finish(proc: subprocess.Popen, out: Path) -> dict:
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text[-5000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {}, res["errors"]
    return res


@pytest.mark.slow  # (two runs of bench/gpu.py with their workers: about 100 s)
def test_the_gpu_benchmark_runs_end_to_end_on_the_cpu(short_tmp):
    pytest.importorskip("transformers")
    from fuyou_client.engine.engine import Engine
    assert hasattr(Engine, "train_step")
    prof, stand_in = short_tmp / "prof", short_tmp / "stand-in"
    stand_in.mkdir()
    (stand_in / "deepspeed.py").write_text(DEEPSPEED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stand_in), os.environ.get("PYTHONPATH", "")]))
    # Both runs at once (each is mostly waiting on its workers): block-major with every case
    # and the weights on SSD, and the loop with the weights in host memory.
    main = start(short_tmp, "main", "--profile", str(prof), "--micro", "4", "--accum", "2", "--weights", "ssd",
                 "--ceiling-micro-max", "4", "--cpu-oom-above", "2", "--cases", "ceiling,inmem,fuyou,zero",
                 "--zero-micro", "2", "--zero-accum", "4", env=env)
    loop = start(short_tmp, "loop", "--schedule", "loop", "--cases", "fuyou", "--micro", "2", "--accum", "3",
                 "--weights", "host")
    res, other = finish(*main), finish(*loop)

    for key in HEADLINE:
        assert key in res, key
    assert res["schedule"] == "block-major" and res["state_over_cap"] >= 4 and res["gpu_cap_bytes"] == 9 << 20
    assert [r["warmup"] for r in res["rounds"]] == [True, False]
    assert all({"fuyou", "ceiling", "inmem", "zero", "host_add_GBps", "ssd_read_GBps"} <= set(r)
               for r in res["rounds"])
    for key in ("fuyou_tflops", "fuyou_hw_tflops", "inmem_ceiling_tflops", "inmem_ceiling_hw_tflops",
                "inmem_same_model_tflops", "inmem_same_model_hw_tflops", "fuyou_over_inmem_same_model",
                "zero_infinity_tflops", "zero_infinity_hw_tflops", "fuyou_over_zero_infinity", "host_add_GBps"):
        assert res[key] > 0, key
    assert len(res["inmem_same_model_tflops_rounds"]) == 1
    # What needs CUDA is null, and says why.
    for key in ("pcie_h2d_GBps", "pcie_d2h_GBps", "gpu_busy_fraction"):
        assert res[key] is None and "CUDA" in res["why_null"][key], key
    assert set(res["why_null"]) == {k for k, v in res.items() if v is None}
    # ZeRO-Infinity (through the stand-in; its restart on running out of memory: the test below).
    zero = res["zero_info"]
    assert res["zero_micro_fallbacks"] == [] and (zero["micro"], zero["accum"]) == (2, 4)
    assert zero["config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert res["results"]["zero"]["modelled_at_accum"]["micro_batches_per_step"] == 4
    assert res["results"]["zero"]["hw_flops_per_token"] == res["results"]["inmem"]["hw_flops_per_token"]

    # Block-major: every step one engine.train_step over the step's micro-batches; the fit
    # halved --micro 4 (over --cpu-oom-above 2) and doubled the micro-batches, and the
    # same-model case took Fuyou's fitted micro-batch.
    fuyou = res["fuyou_info"]
    assert (fuyou["schedule"], fuyou["offload"], fuyou["micro"], fuyou["accum"]) == ("block-major", True, 2, 4)
    assert [f["micro"] for f in fuyou["micro_fallbacks"]] == [4] and fuyou["arena_bytes"] > 0
    for r in res["rounds"]:
        assert r["fuyou"]["via"] == "engine.train_step" and len(r["fuyou"]["losses"]) == 4
        assert r["fuyou"]["tokens"] == 4 * 2 * 32 and r["fuyou"]["checkpoint_bytes_down"] > 0
    assert (res["inmem_info"]["micro"], res["inmem_info"]["accum"]) == (2, 4)
    assert res["inmem_info"]["params"] == res["model_params"] == fuyou["params"]
    # The ceiling searched its micro-batch (4 did not fit) and keeps the step's tokens.
    ceiling = res["ceiling_info"]
    assert {t["micro"] for t in ceiling["tried"] if t["tokens_per_s"] is None} == {4}
    assert ceiling["micro"] in (1, 2) and ceiling["micro"] * ceiling["accum"] == 8
    # Hardware FLOPs, counted: below, the loop's recompute (the engine's) counts as the same
    # model's checkpointing does; block-major, whose forward runs in threads, counts at least
    # that (it replays the head for the rest's gradients).
    for name in ("fuyou", "ceiling", "inmem"):
        assert res["results"][name]["hw_flops_per_token"] > 0
    assert res["results"]["fuyou"]["hw_flops_per_token"] >= res["results"]["inmem"]["hw_flops_per_token"]

    for name, micro_batches in (("fuyou", 4), ("inmem", 3), ("ceiling", 3)):
        assert res["profiles"][name]["profile"]["micro_batches"] == micro_batches
        with gzip.open(prof / f"{name}-trace.json.gz") as f:
            assert json.load(f)["traceEvents"]
        assert "Self CPU" in (prof / f"{name}-ops.txt").read_text()

    # The loop: today's schedule (weights in host memory: offload="host"), FlopCounterMode on a micro-batch.
    f = other["fuyou_info"]
    assert (f["schedule"], f["offload"], f["micro"], f["accum"], f["arena_bytes"]) == ("loop", "host", 2, 3, None)
    assert all("via" not in r["fuyou"] and r["fuyou"]["micro_batches"] == 3 for r in other["rounds"])
    assert other["results"]["fuyou"]["hw_flops_per_token"] == res["results"]["inmem"]["hw_flops_per_token"]
    assert other["fuyou_hw_tflops"] > 0 and other["inmem_same_model_tflops"] is None
    assert "inmem" in other["why_null"]["inmem_same_model_tflops"]
    assert other["zero_infinity_tflops"] is None and "DeepSpeed" in other["why_null"]["zero_infinity_tflops"]
    assert not list(short_tmp.glob("gpu-*"))  # the work directories are gone


def test_zero_infinity_is_configured_as_its_users_would(bench):
    gpu, zero = bench
    block = zero.block_params(2048)
    cfg = zero.zero_config(micro=8, accum=4, width=2048, nvme_path="/nvme")
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and cfg["bf16"]["enabled"] and cfg["train_micro_batch_size_per_gpu"] == 8
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    opt = z["offload_optimizer"]
    assert (opt["device"], opt["nvme_path"], opt["pipeline_read"], opt["pipeline_write"]) == \
        ("nvme", "/nvme", True, True)
    assert opt["buffer_count"] >= 12  # (read ahead + stepped + written behind) x (param, two moments, gradient)
    assert z["stage3_prefetch_bucket_size"] >= block  # prefetch on: a block ahead
    # One fetch serves a block's recompute and its backward: between the two uses lie the
    # block's other parameters twice (the rest of the recompute, then their backward).
    assert z["stage3_max_reuse_distance"] >= 2 * (block - 3 * 2048 * 2048)
    assert z["stage3_max_live_parameters"] >= z["stage3_max_reuse_distance"] + z["stage3_prefetch_bucket_size"]
    assert gpu.params_of(2048, 21, 1024) - gpu.params_of(2048, 20, 1024) == block

    nvme = zero.zero_config(micro=8, accum=4, width=2048, nvme_path="/nvme", params="nvme")["zero_optimization"]
    assert nvme["offload_param"]["device"] == "nvme" and nvme["offload_param"]["nvme_path"] == "/nvme"
    assert nvme["stage3_prefetch_bucket_size"] == 0  # (DeepSpeed's NVMe prefetch fails under checkpointing)
    assert nvme["offload_param"]["buffer_count"] * nvme["offload_param"]["buffer_size"] >= 2 * block
    assert zero.zero_config(micro=1, accum=1, width=64, nvme_path="/n", params="nvme",
                            prefetch=7)["zero_optimization"]["stage3_prefetch_bucket_size"] == 7
    with pytest.raises(ValueError):
        zero.zero_config(micro=1, accum=1, width=64, nvme_path="/n", params="gpu")


def test_a_zero_worker_out_of_memory_starts_again_with_half_the_micro_batch(bench, tmp_path, monkeypatch):
    gpu, _ = bench
    started = []

    class FakeWorker:
        def __init__(self, name, spec, log):
            self.name, self.spec = name, spec
            started.append(spec)

        def read(self):
            if self.spec["zero_micro"] > 2:
                return {"ready": False, "micro_too_large": f"{self.spec['zero_micro']} sequences"}
            return {"ready": True, "micro": self.spec["zero_micro"]}

        def close(self):
            pass

    monkeypatch.setattr(gpu, "Worker", FakeWorker)
    fallbacks = []
    w, info = gpu.ready(FakeWorker("zero", {"zero_micro": 8, "zero_accum": 4}, None), tmp_path, fallbacks)
    assert info == {"ready": True, "micro": 2} and (w.spec["zero_micro"], w.spec["zero_accum"]) == (2, 16)
    assert [f["micro"] for f in fallbacks] == [8, 4] and len(started) == 3

    class NeverFits(FakeWorker):
        def read(self):
            return {"ready": False, "micro_too_large": "even one"}

    with pytest.raises(RuntimeError, match="one sequence"):
        gpu.ready(NeverFits("zero", {"zero_micro": 1, "zero_accum": 4}, None), tmp_path, [])


def test_the_block_major_arena_holds_what_train_step_reserves(bench):
    gpu, _ = bench
    # (blocks + 2) x micro-batches slots of one bf16 hidden state: 46 GiB at the default run's sizes.
    assert gpu.arena_bytes(21, 16, 32, 1024, 2048) == 23 * 32 * 16 * 1024 * 2048 * 2
    # A fit that halves the micro-batch needs no more than was reserved, alignment included.
    for micro, accum in ((3, 5), (5, 2), (16, 32)):
        need = gpu.arena_bytes(2, micro, accum, 7, 3)
        while micro > 1:
            micro, accum = micro // 2, accum * 2
            assert -(-micro * 7 * 3 * 2 // 4096) * 4096 * 4 * accum <= need


def test_swapped_blocks_add_their_activations_to_the_arena_and_drop_their_inputs(bench):
    """--swap-blocks N: the arena keeps the other blocks' inputs (at most half of it, as
    train_step splits host_budget) and holds the swapped blocks' activations, what the
    device plan counts an HF GPT-2 block saving."""
    from fuyou_client.memory.device_plan import activation_bytes
    gpu, _ = bench
    kept = (21 - 5 + 2) * 32 * 16 * 1024 * 2048 * 2
    acts = 5 * 32 * 16 * 1024 * activation_bytes("gpt2", 2048, 4 * 2048, 2)
    assert gpu.arena_bytes(21, 16, 32, 1024, 2048, swap=5) == max(kept + acts, 2 * kept) == kept + acts


@pytest.mark.slow  # (6-11 s: the default suite's 10 minutes)
def test_the_gpu_benchmark_swaps_blocks_on_the_cpu(short_tmp):
    """--swap-blocks on the stand-in: attach gets swap_blocks, and each round reports the
    swapped activations' bytes (down, back, and what went past the arena to the SSD array);
    --swap-blocks is refused with the loop, or beyond the model's blocks."""
    pytest.importorskip("transformers")
    res = finish(*start(short_tmp, "swap", "--cases", "fuyou", "--micro", "2", "--accum", "2", "--weights", "host",
                        "--swap-blocks", "2"))
    assert res["fuyou_info"]["swap_blocks"] == 2 and res["fuyou_tflops"] > 0
    for r in res["rounds"]:
        moved = r["fuyou"]["activations"]
        assert moved["activations_to_host"] == moved["activations_back"] > 0
        assert moved["activations_to_ssd"] == moved["activations_from_ssd"]
    for args, says in ((["--schedule", "loop"], "--swap-blocks is engine.train_step's"),
                       (["--swap-blocks", "99"], "--swap-blocks must be 0 to the model's")):
        bad = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), *SMALL, "--json", str(short_tmp / "x.json"),
                              "--swap-blocks", "2", *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr[-2000:]


def test_the_h100_runs_command_reruns_that_run():
    """bench/results/gpu-h100.json ran the loop (its commit's only schedule); today's default
    is block-major, so its recorded command names the schedule and every option whose
    default changed since: parsed by today's bench/gpu.py, it gives the run's own settings."""
    sys.path.insert(0, str(ROOT / "bench"))
    gpu = importlib.import_module("gpu")
    run = json.loads((ROOT / "bench" / "results" / "gpu-h100.json").read_text())
    command = run["command"].split()
    assert command[:2] == ["python", "bench/gpu.py"]
    args = vars(gpu.parse(command[2:]))
    assert args["schedule"] == run["schedule"] == "loop"
    for key, value in run["args"].items():
        assert str(args[key]) == str(value), (key, args[key], value)
