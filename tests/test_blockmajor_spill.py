"""train_step's kept inputs beyond host_budget go to the SSD array and come back
(client/fuyou_client/blockmajor/store.py over spill.py, the activation swapper's tier).

The spec: with a host_budget smaller than a step's kept inputs, train_step trains bitwise
as it does with all of them in memory and as the ordinary loop with accumulation does,
on the CPU and on the late-copy stand-in for a device with its own memory; the bytes
written to the SSD array are exactly the entries that did not fit, and all of them are
read back; a budget too small to run is refused before any work, with the numbers; a
spilled input that comes back damaged is an error naming its block and micro-batch; and
no transient object outlives a step, a failed step or the store.

The model: tiny GPT-2, 4 blocks, micro-batches of 2 x 16 tokens of width 64, so every kept
tensor is one fp32 hidden state of 8 KiB, one slot. A step of K = 3 keeps (4 + 2) x 3 = 18
of them at its peak (each block's input for every micro-batch, the last block's output,
the last block's gradients); block_store keeps 2 slots free for transfers in flight.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

import fuyou_client
from conftest import HYPER, in_process_config, make_engine, tiny_gpt2
from discrete_device import LateCopyDevice
from fuyou_client.blockmajor.store import Plan, Store
from fuyou_client.device.devices import HostDevice
from test_attach import daemon  # noqa: F401 (a module-scoped fuyoud)
from test_blockmajor import assert_same, loop_step

pytest.importorskip("transformers")
K, STEPS, SHAPE, LAYERS, WIDTH = 3, 2, (2, 16), 4, 64
SLOT = SHAPE[0] * SHAPE[1] * WIDTH * 4  # one hidden state: 8 KiB
ENTRIES = (LAYERS + 2) * K  # at the peak, the end of forward
FREE = 2  # slots block_store keeps for transfers in flight
PREFIX = "train_step/"


def batches(seed: int = 1, steps: int = STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, SHAPE, generator=gen) for _ in range(K)] for _ in range(steps)]


def attach(model, socket, device=None, **kwargs):
    return fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=socket, device=device, **kwargs)


@pytest.mark.parametrize("slots", [12, 5])  # some inputs go; every input goes (the least that runs)
@pytest.mark.parametrize("where", [pytest.param("cpu", marks=pytest.mark.slow), "stand-in"])  # (cpu: 9-12 s each)
def test_spilling_trains_bitwise_as_the_in_memory_arena_and_the_loop(daemon, where, slots):
    """host_budget of ``slots`` slots: ENTRIES - (slots - FREE) entries go to the SSD array
    each step (12: the last outputs, block 0's inputs and two of block 1's; 5: all 15
    inputs), every one comes back, nothing stays there; losses and weights are bitwise
    those of the same train_step with everything in memory and of the ordinary loop."""
    stand_in = where == "stand-in"
    torch.manual_seed(0)
    a = tiny_gpt2(layers=LAYERS, width=WIDTH)
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    spilling = attach(a, daemon.socket, LateCopyDevice(seed=slots) if stand_in else None, host_budget=slots * SLOT)
    in_memory = attach(b, daemon.socket, LateCopyDevice(seed=3) if stand_in else None)
    loop = attach(c, daemon.socket, LateCopyDevice(seed=4) if stand_in else None, accumulation_steps=K)
    spilled = (ENTRIES - (slots - FREE)) * SLOT
    for micro_batches in batches():
        got = spilling.train_step(micro_batches, lambda x: a(x, labels=x).loss / K)
        held = in_memory.train_step(micro_batches, lambda x: b(x, labels=x).loss / K)
        want = loop_step(c, loop, micro_batches)
        assert torch.equal(got, held) and torch.equal(got, want)
        stats = spilling._train_step_store.stats
        assert (stats.spilled, stats.read_back) == (spilled, spilled), stats
        assert stats.spilled_entries == stats.read_entries == spilled // SLOT
        if slots == 12:  # (room enough: every read started before backward asked for it)
            assert stats.read_ahead == stats.read_entries, stats
        assert stats.read_wait_s >= 0 and stats.write_wait_s >= 0
        assert in_memory._train_step_store.stats.spilled == 0
        assert spilling.session.objects(PREFIX) == []  # each used one deleted, the step waited for it
    assert spilling.part_steps() == in_memory.part_steps() == loop.part_steps() == {0: STEPS}
    for engine in (spilling, in_memory, loop):
        engine.close()
    assert_same(a, b)
    assert_same(a, c)


def test_the_plan_keeps_what_backward_needs_first():
    """Which go: the last block's outputs (the rest reads them after all of backward), then
    block 0's inputs, then block 1's, the last micro-batch first; they come back in the
    order backward takes them."""
    plan = Plan(SLOT, LAYERS, K, 12 * SLOT)
    assert plan.to_ssd == {("x", 4, 0), ("x", 4, 1), ("x", 4, 2), ("x", 0, 0), ("x", 0, 1), ("x", 0, 2),
                           ("x", 1, 2), ("x", 1, 1)}
    assert plan.reads == [("x", 1, 1), ("x", 1, 2), ("x", 0, 0), ("x", 0, 1), ("x", 0, 2),
                          ("x", 4, 0), ("x", 4, 1), ("x", 4, 2)]
    assert Plan(SLOT, LAYERS, K, ENTRIES * SLOT).to_ssd == frozenset()  # all fit: nothing goes
    assert len(Plan(SLOT, LAYERS, K, (ENTRIES - 1) * SLOT).to_ssd) == FREE + 1
    assert Plan(SLOT, LAYERS, K, 12 * SLOT, last=False).to_ssd == {  # (a frozen rest: no last outputs kept)
        ("x", 0, 0), ("x", 0, 1), ("x", 0, 2), ("x", 1, 2), ("x", 1, 1)}


@pytest.mark.parametrize("where", ["cpu", "stand-in"])
def test_a_budget_too_small_is_refused_before_any_work_with_the_numbers(daemon, where):
    torch.manual_seed(0)
    model = tiny_gpt2(layers=LAYERS, width=WIDTH)
    engine = attach(model, daemon.socket, LateCopyDevice() if where == "stand-in" else None,
                    host_budget=5 * SLOT - 1)
    written = daemon.status().bytes_written
    x = torch.randint(0, 256, SHAPE)
    with pytest.raises(ValueError, match=r"at least 5 of them in host memory at once \(3 micro-batches of one "
                                         r"block, plus 2 .*\): 40960 bytes, but host_budget is 40959; attach with "
                                         r"host_budget=40960 or more \(147456 keeps all 18 in memory.*fewer or "
                                         r"smaller micro-batches"):
        engine.train_step([x] * K, lambda b: model(b, labels=b).loss)
    assert engine.part_steps() == {0: 0}
    assert daemon.status().bytes_written == written and engine.session.objects(PREFIX) == []
    engine.close()


def test_a_failed_step_leaves_nothing_on_the_ssd(daemon):
    """A loss_fn that fails in the last micro-batch's forward, with spills written and
    in flight: nothing stays on the SSD array, and the engine trains on."""
    torch.manual_seed(0)
    model = tiny_gpt2(layers=LAYERS, width=WIDTH)
    engine = attach(model, daemon.socket, host_budget=5 * SLOT)
    calls = [0]

    def loss_fn(b):
        calls[0] += 1
        mine, loss = calls[0], model(b, labels=b).loss  # (the model returns in the micro-batch's tail)
        if mine == K:
            raise ArithmeticError("a test")
        return loss

    micro_batches = batches(steps=1)[0]
    with pytest.raises(ArithmeticError):
        engine.train_step(micro_batches, loss_fn)
    assert engine._train_step_store.stats.spilled > 0  # (it had spilled)
    assert engine.session.objects(PREFIX) == []
    engine.train_step(micro_batches, lambda b: model(b, labels=b).loss)
    assert engine.part_steps() == {0: 1} and engine.session.objects(PREFIX) == []
    engine.close()


def test_closing_the_store_deletes_what_it_spilled(daemon):
    """Store.close (engine.close) mid-step deletes the transient objects itself, while
    the session, which would drop them anyway, is still open."""
    with fuyou_client.connect(daemon.socket) as session:
        store = Store(session, HostDevice(), 12 * SLOT)
        store.reserve(SLOT, LAYERS, K)
        hidden = torch.randn(SLOT // 4)
        for l in range(LAYERS):  # forward, as blockmajor runs it
            for i in range(K):
                if l == 0:
                    store.put(("x", 0, i), [hidden + i])
                else:
                    store.take(("x", l, i), keep=True)
                store.put(("x", l + 1, i), [hidden + 10 * l + i])
                if l == LAYERS - 1:
                    store.put(("g", l, i), [hidden])
        deadline = time.monotonic() + 10
        while len(session.objects(PREFIX)) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(session.objects(PREFIX)) == 8
        assert torch.equal(store.take(("x", 0, 1))[0], hidden + 1)  # (read back)
        store.close()
        assert session.objects(PREFIX) == []


@pytest.mark.parametrize("where", ["cpu", "stand-in"])
def test_a_spilled_input_that_comes_back_damaged_names_its_block_and_micro_batch(short_tmp, where):
    """An in-process fuyoud whose I/O engine flips a bit in every read from the moment
    forward has finished (its spills written clean): backward's first take, block 3's
    input for micro-batch 0 (with the least budget every input went), fails its CRC32C
    and train_step raises DataLoss naming them, computing nothing from it; nothing stays
    on the SSD array, and with the disk healthy again the engine trains on."""
    from fuyoud.io.engine import Op
    from fuyoud.io.faults import Fault, FaultyEngine
    from fuyoud.server import Daemon

    io = FaultyEngine(make_engine("threadpool"))
    fuyoud = Daemon(in_process_config(short_tmp, ndirs=2, optimizer__buffer_budget="12MiB", optimizer__buffers=3),
                    engine=io)
    fuyoud.start()
    try:
        torch.manual_seed(0)
        model = tiny_gpt2(layers=LAYERS, width=WIDTH)
        engine = attach(model, str(fuyoud.config.daemon.control_path),
                        LateCopyDevice() if where == "stand-in" else None, host_budget=5 * SLOT, offload=False)
        calls = [0]

        def loss_fn(b):
            calls[0] += 1
            mine, loss = calls[0], model(b, labels=b).loss
            if mine == K:  # the last micro-batch's tail: forward's spills are all out
                assert engine._train_step_store.stats.spilled_entries == 15
                io.arm(Fault("corrupt", op=Op.READ, count=-1))
            return loss

        micro_batches = batches(steps=1)[0]
        with pytest.raises(fuyou_client.DataLoss,
                           match=r"train_step's input to block 3 for micro-batch 0, read back from the SSD array "
                                 r".*fails its CRC32C checksum"):
            engine.train_step(micro_batches, loss_fn)
        assert io.injected >= 1
        assert engine.part_steps() == {0: 0}
        assert engine.session.objects(PREFIX) == []
        io.clear()
        engine.train_step(micro_batches, lambda b: model(b, labels=b).loss)
        assert engine.part_steps() == {0: 1} and engine.session.objects(PREFIX) == []
        engine.close()
    finally:
        fuyoud.stop()


@pytest.mark.slow  # (a daemon with a small array of its own: about 8 s)
def test_a_step_whose_spilled_inputs_the_array_cannot_hold_is_refused_before_any_work(short_tmp):
    """A disk with room for the state but not for the step's spilled inputs: train_step
    refuses before anything is written, naming the bytes and what to change."""
    from conftest import SMALL, merge, private_daemon

    torch.manual_seed(0)
    model = tiny_gpt2(layers=LAYERS, width=WIDTH)
    shape = (64, 32)  # 512 KiB a kept input: 15 of them go with a budget of 5
    x = [torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(i)) for i in range(K)]
    with private_daemon(merge(SMALL, {"storage": {"capacity_per_device": "8MiB"}})) as d:
        engine = attach(model, d.socket, host_budget=5 * shape[0] * shape[1] * WIDTH * 4)
        written = engine.session.status().bytes_written
        with pytest.raises(ValueError, match=r"would spill 7864320 bytes .* can take \d+ bytes more: raise "
                                             r"host_budget"):
            engine.train_step(x, lambda b: model(b, labels=b).loss / K)
        assert engine.part_steps() == {0: 0} and engine.session.status().bytes_written == written
        assert not [o for o in engine.session.objects(PREFIX)]
        engine.close()
