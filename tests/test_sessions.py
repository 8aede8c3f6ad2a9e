"""Session registry: tokens, exclusive namespaces, ownership by uid, reclaim callback."""
import pytest

from fuyoud.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated,
                           Unavailable)
from fuyoud.sessions.registry import SessionRegistry


@pytest.fixture
def world():
    owners, closed = {}, []
    reg = SessionRegistry(lambda s, reason: closed.append(s), owners.get,
                          lambda ns, uid, unnamed: owners.__setitem__(ns, uid))
    return reg, owners, closed


def test_tokens_authenticate_until_close(world):
    reg, _, closed = world
    s = reg.open(uid=1000, pid=42, namespace=None)
    assert reg.authenticate(s.token) is s
    reg.close(s, "test")
    reg.close(s, "again")  # idempotent
    assert closed == [s]
    with pytest.raises(Unauthenticated):
        reg.authenticate(s.token)
    with pytest.raises(Unauthenticated):
        reg.authenticate(None)


def test_namespaces_are_exclusive_and_owned_once_persistent(world):
    reg, owners, _ = world
    a = reg.open(uid=1000, pid=1, namespace="job")
    with pytest.raises(AlreadyExists, match="held by live session"):
        reg.open(uid=1000, pid=2, namespace="job")
    assert owners == {}  # nothing persistent yet: no trace
    reg.claim_namespace(a)
    assert owners == {"job": 1000}
    reg.close(a, "done")
    with pytest.raises(PermissionDenied, match="belongs to uid 1000"):
        reg.open(uid=1001, pid=3, namespace="job")
    b = reg.open(uid=1000, pid=4, namespace="job")
    assert b.namespace_claimed
    anon = reg.open(uid=1001, pid=5, namespace=None)
    assert anon.namespace.startswith("session-") and anon.namespace not in owners


def test_bad_namespaces_and_shutdown(world):
    reg, _, _ = world
    for bad in ("", "../x", "a/b", "x" * 200, "-lead"):
        with pytest.raises(InvalidArgument):
            reg.open(uid=0, pid=1, namespace=bad)
    # The daemon's own form for sessions that name none: a client naming one could take
    # over, or lose, what an unnamed session holds.
    anon = reg.open(uid=0, pid=1, namespace=None)
    with pytest.raises(InvalidArgument, match="keeps for sessions that name no namespace"):
        reg.open(uid=0, pid=2, namespace=anon.namespace.replace(anon.namespace.split("-")[1], "99", 1))
    assert reg.open(uid=0, pid=3, namespace="session-7").namespace == "session-7"  # (other forms are free)
    reg.accepting = False
    with pytest.raises(Unavailable):
        reg.open(uid=0, pid=1, namespace=None)


def test_a_namespace_being_deleted_cannot_be_opened_nor_one_held_deleted(world):
    reg, _, _ = world
    with reg.withheld("job"):
        with pytest.raises(Unavailable, match="being deleted by the operator"):
            reg.open(uid=0, pid=1, namespace="job")
        with pytest.raises(FailedPrecondition, match="being deleted already"):
            with reg.withheld("job"):
                pass
    held = reg.open(uid=0, pid=1, namespace="job")
    with pytest.raises(FailedPrecondition, match=f"held by live session {held.id}"):
        with reg.withheld("job"):
            pass
    reg.close(held, "done")
    with reg.withheld("job"):
        pass
