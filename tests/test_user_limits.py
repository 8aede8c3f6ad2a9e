"""What one user may take of the daemon over all its sessions ([limits],
fuyoud/sessions/user_limits.py): sessions, pinned memory and SSD bytes counted per uid,
refused by name with what that user holds, another user untouched; and the fair turns
going round users, then each user's jobs."""
from __future__ import annotations

import grp
import mmap
import pwd
import threading

import pytest

import fuyou_client
from conftest import SMALL, merge, private_daemon, scrape, wait_until
from fuyoud.concurrency.fairness import FairTurns
from fuyoud.config import AUTO_SHARE, Share, from_dict
from fuyoud.errors import UserLimitExceeded
from fuyoud.io.threadpool import ThreadPoolEngine
from fuyoud.memory.pool import Pool
from fuyoud.memory.staging import StagingPool
from fuyoud.sessions.registry import SessionRegistry
from fuyoud.sessions.user_limits import UserLimits, tenant, training_users
from fuyoud.storage.device import Device
from fuyoud.storage.index import IndexDB
from fuyoud.storage.store import Store, WriteItem

MiB = 1 << 20
ALICE, BOB = 1000, 1001


def limits(refused: list, sessions: int = 64, pinned: Share = Share(), ssd: Share = Share(), budget: int = 256 * MiB):
    return UserLimits(sessions, pinned, ssd, budget, shared=True, on_refused=refused.append)


def test_shares_parse_and_resolve():
    assert Share.parse("auto") == Share() and Share.parse("50%") == Share(fraction=0.5)
    assert Share.parse("2GiB") == Share(nbytes=2 << 30) and Share.parse(4096) == Share(nbytes=4096)
    for bad in ("0%", "150%", 0, "lots"):
        with pytest.raises(ValueError):
            Share.parse(bad)
    assert Share().of(1000, shared=True) == int(1000 * AUTO_SHARE) and Share().of(1000, shared=False) == 0
    assert Share(fraction=1.0).of(1000, shared=True) == 0  # (100%: no limit)
    assert Share(fraction=0.25).of(1000, shared=False) == 250 and Share(nbytes=7).of(1000, shared=True) == 7


def test_auto_limits_a_user_only_where_several_users_train():
    """"auto" is 75% on a shared host (two users besides root and the daemon's may open a
    session), no limit where one may."""
    try:
        nogroup = grp.getgrnam("nogroup")
    except KeyError:
        pytest.skip("no group 'nogroup' here")
    members = {p.pw_uid for p in pwd.getpwall() if p.pw_gid == nogroup.gr_gid}
    assert training_users([], "nogroup") >= members - {0}
    base = {"memory": {"pinned_budget": "1GiB"}, "daemon": {"allow_group": "nogroup"}}
    alone = [u for u in range(64200, 64300) if u not in members][:2]
    one = from_dict(merge(base, {"daemon": {"allow_uids": alone[:1]}})) if not members - {0} else None
    if one is not None:  # (the group has no member: one allowed uid is one training user)
        assert UserLimits.from_config(one).pinned == 0
    two = from_dict(merge(base, {"daemon": {"allow_uids": alone}}))
    assert UserLimits.from_config(two).pinned == int((1 << 30) * AUTO_SHARE)
    fixed = from_dict(merge(base, {"daemon": {"allow_uids": alone}, "limits": {"user_pinned": "100MiB"}}))
    assert UserLimits.from_config(fixed).pinned == 100 * MiB


def test_pinned_memory_is_counted_per_user_over_its_sessions():
    refused: list[str] = []
    pool = Pool(256 * MiB, 256 * MiB, 8 * MiB, lock="no", limits=limits(refused, pinned=Share(nbytes=96 * MiB)))
    try:
        assert pool.reserve(1, 64 * MiB, user=ALICE) == 64 * MiB
        with pytest.raises(UserLimitExceeded) as e:
            pool.reserve(2, 48 * MiB, user=ALICE)
        msg = str(e.value)
        assert "uid 1000" in msg and "[limits] user_pinned = 96.0 MiB" in msg and "session 1 64.0 MiB" in msg, msg
        assert pool.reserve(3, 64 * MiB, user=BOB) == 64 * MiB  # (another user: its own limit)
        assert pool.user_usage(ALICE, 2) == (96 * MiB, 64 * MiB)
        # Allocations beyond a reservation count too: session 2's segments stop at 32 MiB.
        refs = [pool.allocate(2, 8 * MiB, user=ALICE)[0] for _ in range(4)]
        with pytest.raises(UserLimitExceeded, match="new segment"):
            pool.allocate(2, 8 * MiB, user=ALICE)
        assert refused == ["pinned", "pinned"]
        pool.release_session(1)  # (its memory back: alice may take it again)
        assert pool.reserve(2, 96 * MiB, user=ALICE) == 96 * MiB
        for r in refs:
            pool.free(2, r)
    finally:
        for sid in (1, 2, 3):
            pool.release_session(sid)


def test_a_user_holds_at_most_user_sessions_those_closing_included():
    refused: list[str] = []
    release = threading.Event()
    registry = SessionRegistry(lambda s, kind: release.wait(30), lambda ns: None, lambda ns, uid, unnamed=False: None,
                               limits=limits(refused, sessions=2))
    a1, a2 = registry.open(ALICE, 11, "a1"), registry.open(ALICE, 12, "a2")
    with pytest.raises(UserLimitExceeded) as e:
        registry.open(ALICE, 13, "a3")
    msg = str(e.value)
    assert "uid 1000 holds 2 sessions" in msg and "[limits] user_sessions = 2" in msg and "namespace a1" in msg, msg
    b = registry.open(BOB, 21, "b1")  # (another user: its own count)
    closing = threading.Thread(target=registry.close, args=(a1, "test"))
    closing.start()
    wait_until(lambda: a1.closed, "a1 closing")
    with pytest.raises(UserLimitExceeded, match="1 closing"):  # (its memory is not back yet: it counts)
        registry.open(ALICE, 13, "a3")
    release.set()
    closing.join(30)
    assert registry.open(ALICE, 13, "a3").uid == ALICE
    assert refused == ["sessions", "sessions"]
    for s in (a2, b):
        registry.close(s, "test")


def test_ssd_bytes_are_counted_per_user_over_its_namespaces(tmp_path):
    refused: list[str] = []
    users = {"a1": ALICE, "a2": ALICE, "b": BOB}
    engine = ThreadPoolEngine(4)
    store = Store([Device(0, tmp_path / "ssd0", 128 * MiB)], IndexDB(tmp_path / "index.sqlite"), engine,
                  StagingPool(2 * MiB, MiB + 8192), chunk_size=MiB, stripe_size=4 * MiB,
                  limits=limits(refused, ssd=Share(nbytes=12 * MiB)), user_of=users.get)
    try:
        buf = mmap.mmap(-1, 8 * MiB)
        store.write([WriteItem("a1", "x", memoryview(buf)[:8 * MiB], persistent=True)])
        store.write([WriteItem("a1", "x", memoryview(buf)[:8 * MiB], persistent=True)])  # (a new version: not twice)
        with pytest.raises(UserLimitExceeded) as e:
            store.write([WriteItem("a2", "y", memoryview(buf)[:8 * MiB], persistent=False)])
        msg = str(e.value)
        assert "uid 1000 would hold 16.0 MiB" in msg and "a1 8.0 MiB" in msg and "[limits] user_ssd" in msg, msg
        store.write([WriteItem("a2", "y", memoryview(buf)[:4 * MiB], persistent=False)])  # (within: 12 MiB)
        store.write([WriteItem("b", "z", memoryview(buf)[:8 * MiB], persistent=True)])  # (bob's own limit)
        assert refused == ["ssd"]
        # A percentage is of the array's capacity (128 MiB): 25% is 32 MiB.
        store.limits = limits(refused, ssd=Share(fraction=0.25))
        for name in ("y2", "y3"):  # (alice at 28 MiB)
            store.write([WriteItem("a2", name, memoryview(buf)[:8 * MiB], persistent=False)])
        with pytest.raises(UserLimitExceeded, match="25%"):
            store.write([WriteItem("a2", "y4", memoryview(buf)[:8 * MiB], persistent=False)])
    finally:
        store.close()
        engine.close()


def test_turns_go_round_users_then_each_users_jobs():
    """One slot, held. Alice waits with two jobs (three requests each), Bob with one job
    (three requests): turns alternate between users, and Alice's alternate between her
    jobs, so Bob gets half however many jobs she runs."""
    turns = FairTurns(1, lambda ns: tenant(ALICE if ns.startswith("a") else BOB, ns))
    turns.acquire("holder")
    order, threads = [], []

    def waiter(ns):
        turns.acquire(ns)
        order.append(ns)
        turns.release()

    queued = 0
    for ns in ["aj1.r0", "aj1.r1", "aj1.r0", "aj2.r0", "aj2.r0", "aj2.r0", "bj.r0", "bj.r1", "bj.r0"]:
        t = threading.Thread(target=waiter, args=(ns,))
        t.start()
        threads.append(t)
        queued += 1
        wait_until(lambda n=queued: sum(turns.waiting().values()) == n, f"waiter {ns} queued", poll=0.002)
    turns.release()
    for t in threads:
        t.join(30)
    jobs = [tenant(None, ns)[1] for ns in order]
    assert jobs == ["aj1", "bj", "aj2", "bj", "aj1", "bj", "aj2", "aj1", "aj2"], order


def test_a_users_limits_through_the_daemon(short_tmp):
    """A real daemon with [limits]: the third session, a reservation past user_pinned and a
    write past user_ssd refused with the limit named, counted by limit; Status tells a
    session what its user may still take (the client plans within it)."""
    config = merge(SMALL, {"limits": {"user_sessions": 2, "user_pinned": "64MiB", "user_ssd": "20MiB"}})
    with private_daemon(config, data_dirs=1) as d:
        with fuyou_client.connect(d.socket) as s1, fuyou_client.connect(d.socket) as s2:
            with pytest.raises(fuyou_client.FuyouClientError, match=r"\[limits\] user_sessions = 2"):
                fuyou_client.connect(d.socket).close()
            s1.reserve(48 * MiB)
            st = s2.status()
            assert (st.user_pinned_budget_bytes, st.user_pinned_others_bytes) == (64 * MiB, 48 * MiB)
            with pytest.raises(fuyou_client.FuyouClientError, match=r"\[limits\] user_pinned = 64.0 MiB"):
                s2.reserve(32 * MiB)
            buf = s2.allocate(8 * MiB)
            s2.swap_out("one", buf)
            s1.swap_out("two", s1.allocate(8 * MiB))
            with pytest.raises(fuyou_client.FuyouClientError, match=r"\[limits\] user_ssd = 20.0 MiB"):
                s2.swap_out("three", buf)
            metrics = scrape(st.metrics_url)
            for limit in ("sessions", "pinned", "ssd"):
                assert metrics[f'fuyoud_user_limit_refusals_total{{limit="{limit}"}}'] == 1, limit
