"""Groups created from a whole state (CreateGroupRequest.with_state: master weights and
moments, at a step count), as a job resuming at another world size re-shards its
optimizer state: the new group steps on exactly as the old one would have, in memory
and in chunks (fuyoud/optimizer/chunks.py)."""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, private_daemon
from fuyou_client import SGD, AdamW
from fuyou_proto.contract import HEADER, ITEMSIZE, STATE_SLOTS, slot_bytes
from fuyoud.optimizer.group import Group
from fuyoud.optimizer.kernels import OptimizerSpec

MiB = 1 << 20
HYPER = dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
# (client spec, the daemon's, the layout's key in STATE_SLOTS)
SPECS = {
    "adamw-fp32": (AdamW(**HYPER), OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1), ("adamw", "fp32")),
    "adamw-int8": (AdamW(**HYPER, state_dtype="int8"),
                   OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1, state_dtype="int8"), ("adamw", "int8")),
    "sgd+momentum": (SGD(momentum=0.9, weight_decay=0.01), OptimizerSpec("sgd", weight_decay=0.01, momentum=0.9),
                     ("sgd+momentum", "fp32")),
}
# Two optimizer buffers of 40 MiB (as tests/test_state_dtype.py): a group of CHUNKED
# parameters does not fit one in any of SPECS' layouts, and is created and stepped in chunks.
PER_BUFFER = 40 * MiB
CHUNKED_CONFIG = merge(SMALL, {"optimizer": {"buffer_budget": f"{2 * PER_BUFFER // MiB}MiB", "buffers": 2},
                               "storage": {"capacity_per_device": "1GiB"}})
CHUNKED = 5_000_011
N = 100_003  # in one buffer; not a multiple of a page, nor of the int8 scales' 256


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(SMALL, "fy-gs-") as d:
        yield d


@pytest.fixture
def session(daemon):
    with fuyou_client.connect(daemon.socket) as s:
        yield s


def read_state(session, name: str, spec, n: int):
    """A group's state object after its header (every slot, padded): a new buffer."""
    buf = session.allocate(spec.state_bytes(n) - HEADER)
    session.swap_in(f"optim/{name}", buf, object_offset=HEADER)
    return buf


def slot_tensors(area: torch.Tensor, key: tuple[str, str], n: int) -> list[torch.Tensor]:
    """Each slot's elements in a state area (uint8), in its own dtype."""
    out, at = [], 0
    for _, dtype, per in STATE_SLOTS[key]:
        count = -(-n // per)
        out.append(area[at:at + count * ITEMSIZE[dtype]].view(getattr(torch, dtype)))
        at += slot_bytes(dtype, per, n)
    return out


def resumes_bitwise(session, spec, key, n: int) -> None:
    """Group A stepped three times; B created from A's state at step 3; one more step
    of each with the same gradients leaves the same state, bytes and step count."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    with session.allocate(n * 4) as w, session.allocate(n * 4) as g:
        w.tensor(torch.float32)[:n].copy_(torch.randn(n, generator=gen))
        session.create_group("A", w, spec)
        for lr, grad in zip((1e-2, 8e-3, 6e-3), grads):
            g.tensor(torch.float32)[:n].copy_(grad)
            session.step_group("A", g, lr)
        with read_state(session, "A", spec, n) as state:
            moments = slot_tensors(state.tensor(), key, n)[1:]
            assert all(m.count_nonzero() for m in moments)  # (zero moments would pass trivially)
            info = session.create_group("B", state, spec, numel=n, state=True, step=3)
            assert info.step == 3 == session.group("B").step and info.numel == n
        g.tensor(torch.float32)[:n].copy_(grads[3])
        assert [session.step_group(name, g, 5e-3).step for name in "AB"] == [4, 4]
    with read_state(session, "A", spec, n) as a:
        after = a.tensor().clone()
    with read_state(session, "B", spec, n) as b:
        assert torch.equal(b.tensor(), after)
    assert session.group("A").step == session.group("B").step == 4
    session.delete("optim/A", "optim/B")


@pytest.mark.parametrize("which", list(SPECS))
def test_a_group_created_from_a_state_steps_on_bitwise(session, which):
    spec, daemon_spec, key = SPECS[which]
    assert Group("ns", "A", daemon_spec, N, 0).buffer_bytes < PER_BUFFER
    resumes_bitwise(session, spec, key, N)


@pytest.fixture(scope="module")
def chunked_daemon():
    with private_daemon(CHUNKED_CONFIG, "fy-gsc-") as d:
        yield d


@pytest.mark.parametrize("which", list(SPECS))
def test_a_chunked_group_created_from_a_state_steps_on_bitwise(chunked_daemon, which):
    spec, daemon_spec, key = SPECS[which]
    group = Group("ns", "A", daemon_spec, CHUNKED, 0)
    assert group.buffer_bytes > PER_BUFFER and len(group.chunk_plan(PER_BUFFER).ranges()) > 1
    with fuyou_client.connect(chunked_daemon.socket) as session:
        resumes_bitwise(session, spec, key, CHUNKED)


def test_a_state_resharded_in_two_steps_as_the_whole(session):
    """The use: one group's state cut into two groups (slot by slot), stepped with the
    halves of the same gradients, holds the halves of the whole's state."""
    spec, key, n, half = AdamW(**HYPER), ("adamw", "fp32"), 20_011, 9_000
    gen = torch.Generator().manual_seed(2)
    with session.allocate(n * 4) as w, session.allocate(n * 4) as g:
        w.tensor(torch.float32)[:n].copy_(torch.randn(n, generator=gen))
        session.create_group("whole", w, spec)
        for lr in (1e-2, 5e-3):
            g.tensor(torch.float32)[:n].copy_(torch.randn(n, generator=gen))
            session.step_group("whole", g, lr)
        parts = {"lo": (0, half), "hi": (half, n)}
        with read_state(session, "whole", spec, n) as whole:
            src = slot_tensors(whole.tensor(), key, n)
            for name, (a, b) in parts.items():
                with session.allocate(spec.state_bytes(b - a) - HEADER) as part:
                    part.tensor().zero_()
                    for dst, s in zip(slot_tensors(part.tensor(), key, b - a), src):
                        dst.copy_(s[a:b])
                    session.create_group(name, part, spec, numel=b - a, state=True, step=2)
        g.tensor(torch.float32)[:n].copy_(torch.randn(n, generator=gen))
        session.step_group("whole", g, 2e-3)
        for name, (a, b) in parts.items():
            with session.allocate((b - a) * 4) as gp:
                gp.tensor(torch.float32)[:b - a].copy_(g.tensor(torch.float32)[a:b])
                assert session.step_group(name, gp, 2e-3).step == 3
    with read_state(session, "whole", spec, n) as whole:
        expect = slot_tensors(whole.tensor(), key, n)
        for name, (a, b) in parts.items():
            with read_state(session, name, spec, b - a) as part:
                for got, want in zip(slot_tensors(part.tensor(), key, b - a), expect):
                    assert torch.equal(got, want[a:b])
    session.delete("optim/whole", "optim/lo", "optim/hi")


def test_bad_requests_are_refused(session):
    spec, n = AdamW(state_dtype="int8"), 10_007
    with session.allocate(n * 4) as w:
        with pytest.raises(fuyou_client.InvalidArgument, match="step 5 without with_state"):
            session.create_group("bad", w, spec, step=5)
        with pytest.raises(fuyou_client.InvalidArgument,
                           match=rf"the whole state of {n} parameters \(adamw, state dtype int8\) take "
                                 rf"{spec.state_bytes(n) - HEADER} bytes from offset 0: .*outside the buffer"):
            session.create_group("bad", w, spec, numel=n, state=True, step=5)
        with pytest.raises(ValueError, match="needs numel"):
            session.create_group("bad", w, spec, state=True)
    with pytest.raises(fuyou_client.ObjectNotFound):
        session.group("bad")
