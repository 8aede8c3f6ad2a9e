"""sizing/kernels.py, the GPU's time by shape: it reproduces every in-GPU run recorded
(bench/results/gpu-h100.json, bench/results/gpu-h200/), its constants are the fit and its
traffic what torch dispatches, its GEMMs are the model's, and on the paper's testbed
(one RTX 4090, 768 GiB, 12 NVMe) the planner's answer now depends on the batch and the
SSDs. Pure arithmetic on the CPU (the counts run small models on it); no timing asserted."""
from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import pytest

from fuyou_client import sizing
from fuyou_client.sizing import hardware, kernels
from fuyou_client.sizing import shape as S
from fuyou_client.sizing.estimate import estimate as estimate_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import kernel_fit  # noqa: E402  (bench/kernel_fit.py)

CASES = kernel_fit.cases()
FILES = sorted({c["file"] for c in CASES})
GPT3_13B = {"model_type": "gpt2", "n_embd": 5120, "n_layer": 40, "n_head": 40, "vocab_size": 50257,
            "n_positions": 2048, "tie_word_embeddings": True}
GPT3_175B = {"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96, "vocab_size": 50257,
             "n_positions": 2048, "tie_word_embeddings": True}


def papers_host(ssds: int) -> sizing.Host:
    """The paper's: one RTX 4090, 768 GB of DDR4, NVMe SSDs of 6.5 GB/s read and 3.4 write
    (the issue's ``--gpu rtx4090 --ram 768GiB --ssd 12x6.5/3.4GB/s``); its cores are not
    given there, 32 assumed here so that the answer does not depend on this machine's."""
    return sizing.host("rtx4090", ram="768GiB", ssd=f"{ssds}x6.5/3.4GB/s", cores=32)


def test_the_runs_are_all_there():
    assert len(FILES) == 7 and len(CASES) == 13
    assert {c["case"] for c in CASES} == {"ceiling", "inmem"} and {c["micro"] for c in CASES} == {2, 4, 8, 16}
    assert all(c["busy"] for c in CASES)


@pytest.mark.parametrize("name", FILES)
def test_every_in_gpu_run_is_reproduced_within_10_percent(name):
    """Per recorded in-GPU case: the time its kernels ran (NVML's busy share times the
    micro-batch's time) within 10%, and the micro-batch's time within 10%, but for the H200
    ceilings' time (below: one host's launch speed moved it by 24% between calls)."""
    for case in (c for c in CASES if c["file"] == name):
        t = kernel_fit.model(case)
        busy = case["busy"] * case["seconds"]
        assert t.busy == pytest.approx(busy, rel=0.10), (case["case"], t.busy, busy)
        if not (case["case"] == "ceiling" and case["profile"].name == "h200"):
            assert t.seconds == pytest.approx(case["seconds"], rel=0.10), (case["case"], t.seconds, case["seconds"])


def test_the_h200_ceilings_time_within_10_percent_of_their_median():
    """Six calls of the same capped ceiling on the H200: its kernels ran 11.2-11.6 ms a
    micro-batch, the micro-batch took 14.5-18.6 ms (the host's launches; SESSION.md). No one
    figure is within 10% of all six (the best is 12.3% off both ends); the model is within
    10% of their median and within 15% of each."""
    ceilings = [c for c in CASES if c["case"] == "ceiling" and c["profile"].name == "h200"]
    assert len(ceilings) == 6
    model = kernel_fit.model(ceilings[0]).seconds
    seconds = [c["seconds"] for c in ceilings]
    assert max(seconds) / min(seconds) > 1.2  # (why a looser bound for each)
    assert model == pytest.approx(statistics.median(seconds), rel=0.10)
    for s in seconds:
        assert model == pytest.approx(s, rel=0.15)


def test_the_constants_are_the_fit():
    edge, launch = kernel_fit.fit(CASES)
    assert kernels.GEMM_EDGE == pytest.approx(edge, rel=0.01) and kernels.LAUNCH_S == pytest.approx(launch, rel=0.01)
    for p in hardware.PROFILES.values():
        assert p.launch_s.value == kernels.LAUNCH_S and "kernel_fit" in p.launch_s.source


@pytest.mark.parametrize("key", [("gpt2", "bf16", "block"), ("gpt2-fused", "bf16", "block"),
                                 ("llama", "autocast", "block")])
def test_the_traffic_is_what_torch_dispatches(key):
    """The model's memory-bound bytes and launches are bench/kernel_counts.py's count of the
    operators torch runs (counted again here, on the CPU, at small shapes)."""
    pytest.importorskip("transformers")
    import kernel_counts
    assert kernel_counts.coefficients(*key) == kernels.TRAFFIC[key]


def test_the_saved_activations_are_what_autograd_saves():
    """The device plan's and the planner's bytes per token of a block's activations (what a
    block computing with a graph holds, what a swapped block sends to the host) are
    bench/kernel_counts.py's count of what autograd saves in the families' blocks, counted
    again here; a GPT-2 block's (GELU written out, as HF's gelu_new) are 29 bytes per token
    and unit of width per byte of the compute dtype at MLP 4 x width, Korthikanti et al.'s
    fused-kernel 17 being well under it."""
    pytest.importorskip("transformers")
    import kernel_counts
    from fuyou_client.memory import device_plan
    assert {f: kernel_counts.activation_coefficients(f, "bf16") for f in ("gpt2", "gpt2-fused", "llama")} == \
        device_plan.SAVED_ACTIVATIONS
    assert device_plan.activation_bytes("gpt2", 1024, 4096, 2) / (1024 * 2) == pytest.approx(29.06, abs=0.01)
    # an fp32 model's are twice a 16-bit one's (the planner's rule; counted: within 10%)
    fp32 = (kernel_counts.saved("llama", "fp32", 128, 512, 2, 64) - kernel_counts.saved("llama", "fp32", 128, 512, 1, 64))
    assert fp32 / 64 == pytest.approx(device_plan.activation_bytes("llama", 128, 512, 4), rel=0.1)


@pytest.mark.slow  # (counts eight models' passes: about 25 s)
def test_the_whole_traffic_table_is_what_torch_dispatches():
    pytest.importorskip("transformers")
    import kernel_counts
    assert kernel_counts.table() == kernels.TRAFFIC


@pytest.mark.parametrize("cfg", [GPT3_13B, {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 2,
                                            "num_attention_heads": 32, "num_key_value_heads": 8,
                                            "intermediate_size": 14336, "vocab_size": 1000}])
def test_a_blocks_gemms_are_its_matrices(cfg):
    """Forward: one multiply-add per matrix parameter per token; backward two."""
    shape = S.from_config(cfg)
    tokens = 3000
    fwd = kernels.block_gemms(shape, tokens)
    flops = sum(2 * m * n * k for m, n, k in fwd)
    assert flops == 2 * tokens * shape.block_matmul_params
    assert sum(2 * m * n * k for m, n, k in kernels.backward_gemms(fwd)) == 2 * flops
    assert all(m == tokens for m, _, _ in fwd)


def test_a_gemms_efficiency_rises_with_its_size_to_the_published_one():
    k = hardware.PROFILES["rtx4090"].kernels
    wide = hardware.PROFILES["rtx4090"].gemm_efficiency.value
    shapes = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 5120, 5120), (16384, 15360, 5120), (65536, 65536, 65536)]
    effs = [k.gemm_efficiency_at(*s) for s in shapes]
    assert effs == sorted(effs) and effs[-1] == pytest.approx(wide, rel=0.05) and effs[-1] < wide
    for m, n, kk in shapes:  # more of any dimension never slower per FLOP
        for grown in ((2 * m, n, kk), (m, 2 * n, kk), (m, n, 2 * kk)):
            assert k.gemm_efficiency_at(*grown) >= k.gemm_efficiency_at(m, n, kk)
    # a GEMM of few rows and a large matrix is memory-bound: its operands' bytes at the bandwidth
    m, n = 64, 65536
    assert k.gemm_s(m, n, n) == pytest.approx(2 * (2 * m * n + n * n) / k.hbm, rel=1e-9)


def test_short_kernels_wait_for_their_launches():
    """A block of a small model at one short sequence is launch-bound: its time is about its
    launches times the floor; a wide block's is its kernels'."""
    k = hardware.PROFILES["h100"].kernels
    tiny = S.from_config({"model_type": "gpt2", "n_embd": 256, "n_layer": 1, "n_head": 4, "vocab_size": 1000,
                          "n_positions": 64})
    t = k.block_pass(tiny, 1, 64, "forward")
    launches = sum(kernels.TRAFFIC[("gpt2", "bf16", "block")]["launches"]["forward"].values())
    assert t.idle > 10 * t.busy and t.seconds == pytest.approx(launches * kernels.LAUNCH_S, rel=0.05)
    wide = k.block_pass(S.from_config(GPT3_175B), 4, 1024, "forward")
    assert wide.idle < 1e-3 * wide.busy


@pytest.mark.slow  # (10-13 s: the default suite's 10 minutes)
def test_the_planner_now_depends_on_the_batch_and_the_ssds():
    """The issue's complaint: 27 model TFLOPS whatever the batch and the SSD count."""
    got = {(ssds, seqs): sizing.plan(GPT3_13B, on=papers_host(ssds), seq=1024, tokens_per_step=seqs * 1024).best
           for ssds in (1, 12) for seqs in (8, 64)}
    rate = {k: e.time["model_tflops"] for k, e in got.items()}
    assert rate[(1, 8)] < rate[(1, 64)] and rate[(1, 8)] < rate[(12, 8)]
    assert got[(1, 8)].binds == "SSD" and got[(12, 64)].binds == "GPU"


def test_13b_with_one_ssd_binds_the_ssd_and_another_ssd_helps():
    """The issue's check: 32 sequences a step, one SSD: the SSD array binds, and "another
    SSD" is worth more than 1.00x."""
    plan = sizing.plan(GPT3_13B, on=papers_host(1), seq=1024, tokens_per_step=32 * 1024)
    assert plan.fits and plan.best.binds == "SSD"
    advice = dict(plan.advice)
    assert advice["another SSD"] > 1.2
    assert "binds   SSD" in str(plan) and "another SSD: 1." in str(plan)


def test_fp16_moves_the_bytes_bf16_does():
    """An fp16 model's memory-bound traffic is bf16's (the same operators on 2-byte
    elements): counted again on the CPU, so the table keeps bf16's for both."""
    pytest.importorskip("transformers")
    import kernel_counts
    assert kernel_counts.coefficients("gpt2", "fp16", "block") == kernels.TRAFFIC[("gpt2", "bf16", "block")]
    assert kernels.TRAFFIC_AS["fp16"] == "bf16"


def test_every_profile_prices_fp16_gemms_at_its_fp16_peak_with_its_source():
    """fp16 GEMMs as torch runs them: accumulated in fp32 (allow_fp16_accumulation is False by
    default), so each datasheet's fp16 peak is its bf16 one, and the share large GEMMs reach
    is a published torch.matmul fp16 measurement where one is named (else bf16's, said so)."""
    for name, p in hardware.PROFILES.items():
        fp16 = p.gemms("fp16")
        assert fp16.peak_tflops == pytest.approx(p.peak_tflops, rel=1e-3), name
        assert "fp32 accumulate" in fp16.source, name
        assert fp16.efficiency.source.startswith(("published", "assumed")) and 0 < fp16.efficiency.value <= 1, name
        k = p.kernels_for("fp16")
        assert (k.compute, k.peak_tflops, k.gemm_efficiency) == ("fp16", fp16.peak_tflops, fp16.efficiency.value)
    rtx = hardware.PROFILES["rtx4090"]
    assert rtx.gemms("fp16").efficiency.value == pytest.approx(155.50 / 165.2)  # 8192^3, bf16 160.17 in that run
    assert "330.3 with fp16 accumulate" in rtx.gemms("fp16").source
    with pytest.raises(sizing.HostError, match="compute dtype 'fp8'"):
        rtx.gemms("fp8")
    given = sizing.host("rtx4090", gpu_efficiency=0.6, ram="64GiB", ssd="1x3GB/s", cores=8).gpu  # (either dtype)
    assert given.gemms("bf16").efficiency == given.gemms("fp16").efficiency == hardware.Rate(0.6, "given")


@pytest.mark.slow  # (10-13 s: the default suite's 10 minutes)
def test_an_fp16_plan_prices_its_gemms_at_the_fp16_rate():
    """The planner's compute dtype: bf16 by default, fp16 where asked (fuyouctl plan
    --compute fp16); the same bytes and memory, the GEMMs at the fp16 share, which on the
    4090 is 155.5 TFLOPS against bf16's 160.2 (so fp16 is at most that much slower), and the
    plan says the model's dtype it assumed; a model's own 16-bit dtype is the default."""
    host = papers_host(12)
    bf16, fp16 = (sizing.plan(GPT3_13B, on=host, seq=1024, tokens_per_step=64 * 1024, compute=c) for c in
                  ("bf16", "fp16"))
    assert bf16.best.settings.compute == "bf16" and fp16.best.settings.compute == "fp16"
    assert fp16.best.memory["gpu"] == bf16.best.memory["gpu"] and fp16.best.ssd == bf16.best.ssd
    ratio = bf16.best.tokens_per_second / fp16.best.tokens_per_second
    assert 1 < ratio <= 160.17 / 155.50
    assert fp16.to_dict()["plan"]["model_dtype"] == "torch.float16" and "model in torch.float16" in str(fp16)
    assert "GPU 165.2 dense fp16 TFLOPS" in str(fp16) and "at 155.5 of 165.2 TFLOPS" in str(fp16)
    with pytest.raises(ValueError, match="compute dtype must be one of bf16, fp16"):
        sizing.plan(GPT3_13B, on=host, seq=1024, compute="fp32")
    torch = pytest.importorskip("torch")
    assert sizing.model_compute(torch.nn.Linear(2, 2).to(torch.float16)) == "fp16"
    assert sizing.model_compute(torch.nn.Linear(2, 2)) is None and sizing.model_compute(GPT3_13B) is None
    # attach(model, plan=...): a 16-bit model in another dtype than the plan's GPU computes in is refused
    from fuyou_client.sizing.apply import apply
    with pytest.raises(ValueError, match="computes in torch.float16 and the model is in torch.bfloat16"):
        apply(fp16, torch.nn.Linear(2, 2).to(torch.bfloat16), None, {})
    options, _, _ = apply(fp16, torch.nn.Linear(2, 2).to(torch.float16), None, {})
    assert options == fp16.attach_options()


@pytest.mark.slow  # (6-11 s: the default suite's 10 minutes)
def test_hardware_flops_count_the_recomputation():
    """Hardware TFLOPS (what the GPU executes) beside model TFLOPS (6 N tokens): block-major
    runs each block's forward twice (once more before its backward) and the tail's forward
    twice (its replay); a block whose activations are swapped runs its forward once. So on a
    wide model recomputing every block, hardware FLOPs are a little over 4/3 of the model's
    (attention's S x S products and the head add to both); swapping every block, a little
    over the model's."""
    from fuyou_client.sizing import iteration
    shape = S.from_config(GPT3_13B)
    s = iteration.Schedule(seq=1024, micro=32, accum=2)
    f = shape.flops(1024, 32)
    assert iteration.executed_flops(shape, s) == 2 * (40 * (2 * f["block_fwd"] + f["block_bwd"]) + 2 * f["tail_fwd"]
                                                       + f["tail_bwd"])
    loop = iteration.executed_flops(shape, iteration.Schedule(schedule="loop", seq=1024, micro=32, accum=2))
    assert loop == iteration.executed_flops(shape, s) - 2 * f["tail_fwd"]
    swapped = iteration.Schedule(seq=1024, micro=32, accum=2, swapped=10)
    assert iteration.executed_flops(shape, swapped) == iteration.executed_flops(shape, s) - 2 * 10 * f["block_fwd"]
    plan = sizing.plan(GPT3_13B, on=papers_host(12), seq=1024, tokens_per_step=64 * 1024)
    e = plan.best
    recomputed = estimate_of(plan.shape, dataclasses.replace(e.settings, swap_blocks=0), plan.host)
    ratio = recomputed.time["hardware_tflops"] / recomputed.time["model_tflops"]
    assert 4 / 3 < ratio < 1.45, ratio
    everything = estimate_of(plan.shape, dataclasses.replace(e.settings, swap_blocks=40), plan.host)
    assert 1 < everything.time["hardware_tflops"] / everything.time["model_tflops"] < 1.1
    assert 1.1 < e.time["hardware_tflops"] / e.time["model_tflops"] < ratio  # (29 of 40 swapped: between)
    assert e.to_dict()["hardware_tflops"] == e.time["hardware_tflops"]
    assert "hardware TFLOPS (what the GPU executes, recomputation included)" in str(plan)


PAPERS_13B = 156  # model TFLOPS (as the issue quotes it) of GPT-3 13B on the 4090, 12 SSDs


@pytest.mark.slow  # (10-13 s: the default suite's 10 minutes)
def test_13b_at_64_sequences_and_12_ssds_against_the_papers_156():
    """The issue's check: GPT-3 13B on the paper's box at 64 sequences of 1024 a step, within
    25% of the paper's 156 TFLOPS (117 to 195). Not met, and this is what the planner says:

    * Precision: the paper's as read here (not confirmed against its text), fp16 mixed
      precision (``compute="fp16"``), and bf16 beside it. torch accumulates
      fp16 GEMMs in fp32 (``allow_fp16_accumulation`` is False by default and did not exist
      before torch 2.7, after the paper), so the 4090's fp16 peak is 165.2 TFLOPS, as bf16's
      (the whitepaper's 330.3 is with fp16 accumulate); a published torch.matmul fp16 run
      reaches 155.5 at 8192^3, bf16 160.2.
    * Recomputation: recomputing every block caps model TFLOPS at 3/4 of the GEMMs' rate
      (3/4 x 155.5 = 116.6 < 117); the planner recomputing every block gives 78 (fp16).
      Swapping the activations of blocks instead (the paper's method, ``swap_blocks``),
      as many as host memory holds the activations of: 17 of 40 here (what autograd saves
      of an HF GPT-2 block, GELU written out: 19.5 GB a block a step), 81.6 model TFLOPS in
      fp16 (83 in bf16). Each swapped micro-batch's 9.75 GB cross PCIe 4.0 in 390 ms each
      way, against its forward's 208 ms: the link, not the GPU, sets a swapped block's pace,
      and swapping all 40 (433 GB a step through the SSD array) would be slower than 17.
    * What is left: the GPU's own time. The kernel model prices these 5120-wide blocks'
      kernels at 105 model TFLOPS with no wait at all, every block swapped (the GEMMs at
      about 72% of the peak, fitted on 2048-wide runs, where square torch.matmul GEMMs are
      published at 94-100%: docs/design/iteration-model.md)."""
    rtx = hardware.PROFILES["rtx4090"].gemms("fp16")
    assert 0.75 * rtx.peak_tflops * rtx.efficiency.value < 0.75 * PAPERS_13B  # (116.6 < 117)
    for compute in ("fp16", "bf16"):
        plan = sizing.plan(GPT3_13B, on=papers_host(12), seq=1024, tokens_per_step=64 * 1024, compute=compute)
        e = plan.best
        assert e.binds == "GPU" and e.settings.tokens == 64 * 1024 and e.settings.compute == compute
        recomputed = estimate_of(plan.shape, dataclasses.replace(e.settings, swap_blocks=0), plan.host)
        assert 0 < e.settings.swap_blocks < 40 and e.activations["pcie_bytes"] > 0
        assert e.activations["ssd_bytes"] == 0  # (what host memory holds: no activation through the SSD)
        # swapping gains on recomputing every block ...
        assert recomputed.time["model_tflops"] < 0.75 * rtx.peak_tflops * rtx.efficiency.value
        assert e.time["model_tflops"] > 1.03 * recomputed.time["model_tflops"]
        # ... but not 117, nor would swapping every block through the SSD array (PCIe and the SSD
        # array bind it: slower than the plan): the GPU's kernels alone, with no wait, are under it
        everything = estimate_of(plan.shape, dataclasses.replace(e.settings, swap_blocks=40), plan.host)
        assert everything.activations["ssd_bytes"] > 0
        gpu_bound = 6 * plan.shape.params * e.settings.tokens / everything.time["seconds"]["gpu compute"] / 1e12
        assert everything.time["model_tflops"] < e.time["model_tflops"] < gpu_bound < 0.75 * PAPERS_13B, \
            (compute, e.time["model_tflops"], everything.time["model_tflops"], gpu_bound)



@pytest.mark.parametrize("compute", ["fp16", "bf16"])
def test_175b_at_16_sequences_against_the_papers_87(compute):
    """The issue's check: GPT-3 175B on the paper's box at 16 sequences of 1024 a step, model
    TFLOPS within 25% of the paper's 87 (65 to 109), in the paper's precision (fp16) and in
    bf16: 87 (89). Every block recomputed: one block's activations a step (11.7 GB: what
    autograd saves of an HF GPT-2 block) do not fit what the default pinned budget leaves
    beside the blocks' 349 GB of weights, and the planner puts no activation through the SSD
    array. Swapping every block that way would be 97 (11% over the paper's), for 1,123 GB of
    activations written and read back a step."""
    plan = sizing.plan(GPT3_175B, on=papers_host(12), seq=1024, tokens_per_step=16 * 1024, compute=compute)
    assert plan.fits
    e = plan.best
    assert e.time["model_tflops"] == pytest.approx(87, rel=0.25) and e.binds == "GPU"
    assert e.settings.swap_blocks == 0
    everything = estimate_of(plan.shape, dataclasses.replace(e.settings, swap_blocks=96), plan.host)
    assert everything.activations["ssd_bytes"] > 0
    assert e.time["model_tflops"] < everything.time["model_tflops"] < 1.35 * 87
