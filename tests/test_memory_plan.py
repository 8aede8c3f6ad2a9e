"""The memory plan (client/fuyou_client/memory/budget.py): the shared buffers of a training
process derived from the session's budget before anything is allocated.

The plan as a function (counts for small and large blocks, what a tight budget gives up
and in which order, refusals with the numbers), and through attach against real daemons:
a budget smaller than the default counts need trains bitwise as a large one with fewer
buffers, within the budget and as much as the plan says; a budget below the smallest plan
is refused before anything is allocated; chunked fp32 blocks hand their master weights to
their steps (4 SSD bytes per parameter fewer), counted by cause."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, SMALL, merge, private_daemon, tiny_llama
from fuyou_client.memory import budget as mp
from fuyou_proto.units import format_size

MiB, GiB = 1 << 20, 1 << 30


def blocks(n: int, numel: int, chunked: bool = False, strategy: str = "pooled") -> list[mp.GroupShape]:
    return [mp.GroupShape(f"block{i}", numel, 4, chunked=chunked, offload=True, strategy=strategy) for i in range(n)]


def test_small_blocks_get_the_counts_that_keep_small_transfers_deep():
    plan = mp.plan(blocks(8, 1_000_000), mp.Limits(4 * GiB))
    assert (plan.prefetch, plan.weight_slots, plan.grad_buffers, plan.shrunk) == (2, 4, 5, ())  # 2 ahead, a spare
    assert plan.slot_bytes == plan.grad_bytes == 4_000_000 and plan.host_budget == mp.ARENA_DEFAULT


def test_large_blocks_get_one_ahead_and_one_step_in_flight():
    """A Llama-7B block in fp32 (772 MiB): one ahead fills the SSD's window, so does one
    step in flight; its steps (in chunks) hold the slot their block computed with, which
    the prefetch then waits for (both are SSD-bound)."""
    plan = mp.plan(blocks(32, 202_383_360, chunked=True), mp.Limits(12 * GiB))
    assert (plan.prefetch, plan.grad_buffers, plan.handoff, plan.weight_slots) == (1, 2, True, 2)
    unchunked = mp.plan(blocks(32, 202_383_360), mp.Limits(12 * GiB))
    assert (unchunked.handoff, unchunked.weight_slots) == (False, 2)  # computing, one ahead, no spare


def test_a_tight_budget_gives_up_in_order_and_always_fits():
    shapes = blocks(8, 10_000_000) + [mp.GroupShape("rest", 1_000_000, 4)]  # (each buffer a segment)
    full = mp.plan(shapes, mp.Limits(8 * GiB))
    seen, last = [], full.total
    for room in range(full.total, 0, -(4 * MiB)):
        try:
            plan = mp.plan(shapes, mp.Limits(room))
        except mp.DoesNotFit:
            break
        assert plan.total <= room and plan.total <= last
        last = plan.total
        seen = [s for s in plan.shrunk]
    order = [what for what, _, _ in mp._ladder(mp.Wanted())]
    assert seen == [w for w in order if w in seen] and len(seen) >= 5  # a prefix of the ladder, in its order
    assert "prefetch" in seen and "the spare weight slot" in seen


def test_a_budget_below_the_smallest_plan_is_refused_with_the_numbers():
    shapes = blocks(4, 50_000_000)
    with pytest.raises(mp.DoesNotFit) as err:
        mp.plan(shapes, mp.Limits(100 * MiB))
    msg = str(err.value)
    smallest = 2 * mp.segment_bytes(200_000_000, 64 * MiB) + mp.ARENA_FLOOR + mp.EXPORT_PIECE  # slot, buffer, arena
    assert f"smallest plan takes {format_size(smallest)}" in msg and "session may take 100.0 MiB" in msg
    assert "[memory] pinned_budget" in msg and isinstance(err.value, fuyou_client.ResourceExhausted)


def test_gradients_kept_until_the_step_are_named_when_they_do_not_fit():
    """Accumulation (or clipping) keeps every block's gradients until the step: at a 7B size
    more than a host has; the refusal says so and names the way out."""
    shapes = blocks(32, 202_383_360, strategy="resident")
    with pytest.raises(mp.DoesNotFit, match=r"Every block keeps its gradients until the step \(24.1 GiB.*"
                                            r"engine.train_step"):
        mp.plan(shapes, mp.Limits(12 * GiB))


def test_what_the_caller_fixed_is_kept_or_refused_by_name():
    shapes = blocks(8, 50_000_000)
    roomy = mp.plan(shapes, mp.Limits(4 * GiB), mp.Wanted(prefetch=3, keep=1, host_budget=8 * MiB))
    assert (roomy.prefetch, roomy.keep, roomy.host_budget, roomy.weight_slots) == (3, 1, 8 * MiB, 6)
    tight = mp.plan(shapes, mp.Limits(1200 * MiB), mp.Wanted(prefetch=2))
    assert tight.prefetch == 2 and tight.weight_slots == 3 and "prefetch" not in tight.shrunk
    with pytest.raises(mp.DoesNotFit, match="or leave prefetch=2 to the plan"):
        mp.plan(shapes, mp.Limits(850 * MiB), mp.Wanted(prefetch=2))
    assert mp.plan(shapes, mp.Limits(850 * MiB)).prefetch < 2


def train(model, engine, batches):
    for x in batches:
        model(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()


def session_pinned(engine) -> int:
    """What the daemon counts against this session."""
    mine = [s for s in engine.session.status().session_list]
    assert len(mine) == 1
    return mine[0].pinned_bytes


@pytest.mark.slow  # (two trainings under two budgets: about 18 s)
def test_a_small_budget_trains_bitwise_as_a_large_one_with_fewer_buffers(short_tmp):
    """The same model attached to a daemon whose session budget holds its default counts and
    to one whose budget does not: the second plans fewer slots and gradient buffers, holds
    no more than its budget and than its plan says, and trains bitwise alike."""
    torch.manual_seed(0)
    model = tiny_llama(layers=6, width=256, vocab=256)
    batches = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    results = []
    for budget in ("256MiB", "24MiB"):
        ours = copy.deepcopy(model)
        with private_daemon(merge(SMALL, {"memory": {"session_budget": budget}})) as d:
            engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=d.socket, host_budget=MiB)
            plan = engine.memory_plan()
            train(ours, engine, batches)
            held = session_pinned(engine)
            assert held <= plan.training <= plan.total <= int(budget[:-3]) * MiB, (held, plan)
            assert plan.training - held <= 2 * (8 * MiB), (held, plan)  # (the packing's slack: SMALL's segments)
            engine.close()
        results.append((plan, [p.detach().clone() for p in ours.parameters()]))
    (large, w_large), (small, w_small) = results
    assert large.shrunk == () and (large.weight_slots, large.grad_buffers) == (4, 5)
    assert small.shrunk and small.weight_slots + small.grad_buffers < 9, small
    assert all(torch.equal(a, b) for a, b in zip(w_large, w_small))


def test_a_budget_below_the_smallest_plan_is_refused_before_anything_is_allocated(short_tmp):
    model = tiny_llama(layers=2, width=256, vocab=256)
    with private_daemon(merge(SMALL, {"memory": {"session_budget": "8MiB"}})) as d:
        with pytest.raises(fuyou_client.ResourceExhausted, match="smallest plan takes") as err:
            fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=d.socket, host_budget=MiB)
        assert "at least" in str(err.value) and "session may take 8.0 MiB" in str(err.value)
        with fuyou_client.connect(d.socket) as s:
            status = s.status()
            assert status.objects == 0 and status.pinned_used_bytes == 0  # (no group created, nothing held)
    assert all(p.numel() for p in model.parameters())  # (the model as it came)


# Blocks whose AdamW state (16 bytes per parameter with the step's weights room) is larger
# than one optimizer buffer (40 MiB / 2: 20 MiB, the least a chunked fp32 step works in):
# their steps go in chunks.
CHUNKED = merge(SMALL, {"optimizer": {"buffer_budget": "40MiB", "buffers": 2},
                        "storage": {"capacity_per_device": "1GiB"}})


def step_bytes(engine, model, x) -> dict:
    """One iteration's SSD bytes: the daemon's, and the client's weight reads and the
    master weights its steps took from it."""
    before, off = engine.session.status(), engine.offloader
    fetched = off.fetched_bytes
    model(x, labels=x).loss.backward()
    engine.step()
    engine.zero_grad()
    after = engine.session.status()
    return {"read": after.bytes_read - before.bytes_read, "written": after.bytes_written - before.bytes_written,
            "client_reads": off.fetched_bytes - fetched,
            "masters": sum(i.masters_bytes for i in engine.last_step_infos)}


@pytest.mark.slow  # (chunked steps counted by cause: about 17 s; the unchunked count runs by default)
def test_chunked_blocks_hand_their_masters_to_their_steps_counted_by_cause(short_tmp):
    """fp32 blocks stepped in chunks: each step takes the master weights backward read
    (StepInfo.masters_bytes: 4 bytes per block parameter) instead of reading them from the
    SSD again; the daemon's reads are then the client's weight reads plus each group's state
    less those masters, its writes each group's state: 4 + 4 + 8 + 12 bytes per block
    parameter in fp32 (the forward read, backward's, the moments, the new state). Without
    the handoff (a budget too small for its slots) each block's masters are read twice: 4
    bytes more. Both train bitwise as torch's fused AdamW."""
    torch.manual_seed(0)
    model = tiny_llama(layers=3, width=448, vocab=256)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    for _ in range(2):
        ref(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    counts = {}
    for handoff in (True, False):
        ours = copy.deepcopy(model)
        with private_daemon(merge(CHUNKED, {"memory": {"session_budget": "256MiB" if handoff else "52MiB"}})) as d:
            engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=d.socket, host_budget=MiB,
                                         prefetch=1)
            assert engine.memory_plan().handoff is handoff, engine.memory_plan()
            chunked = [g for g in engine.groups if g.chunked]
            assert [g.spec.name for g in chunked] == ["block0000", "block0001", "block0002"]
            state = sum(engine.session.group(part.name).state_bytes for g in engine.groups for part in g.spec.parts)
            counts[handoff] = [step_bytes(engine, ours, x) for _ in range(2)]
            engine.close()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    block = sum(g.numel for g in chunked)
    for c in counts[True]:
        assert c["masters"] == 4 * block
        assert c["written"] == state  # (every group's new state, once)
        # The optimizer's reads: each group's state less the masters handed over, give or
        # take the checksum blocks (1 MiB) at the edges of the slots a chunked step reads.
        optimizer_read = c["read"] - c["client_reads"]
        assert 0 <= optimizer_read - (state - c["masters"]) <= 3 * len(chunked) * MiB, (optimizer_read, state, c)
    for with_, without in zip(counts[True], counts[False]):
        assert without["masters"] == 0 and without["written"] == with_["written"]
        assert without["read"] - with_["read"] >= 4 * block - 3 * len(chunked) * MiB  # the masters, read again


def test_unchunked_blocks_read_their_state_once_counted_by_cause(short_tmp):
    """Blocks whose state fits an optimizer buffer: backward's weights are served from a
    read-ahead of the state their step then uses, or read by the client when no buffer is
    spare; either way the daemon's reads are the client's weight reads plus each group's
    state once (less what the state cache kept: StepInfo.cached_bytes), its writes each
    group's state: 4 + 12 + 12 bytes per parameter in fp32 at most. (A read of a part of a
    persistent object reads the checksum blocks, 1 MiB, it lies in: the daemon counts those.)"""
    torch.manual_seed(0)
    model = tiny_llama(layers=3, width=128, vocab=256)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with private_daemon(SMALL) as d:
        engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=d.socket, host_budget=MiB)
        assert not any(g.chunked for g in engine.groups) and not engine.memory_plan().handoff
        state = sum(engine.session.group(part.name).state_bytes for g in engine.groups for part in g.spec.parts)
        for _ in range(3):
            c = step_bytes(engine, model, x)
            cached = sum(i.cached_bytes for i in engine.last_step_infos)
            assert c["masters"] == 0 and c["written"] == state
            edges = c["read"] - c["client_reads"] - (state - cached)
            assert 0 <= edges <= 2 * 3 * MiB, (c, state, cached)  # (3 blocks, read at most twice each)
        engine.close()
