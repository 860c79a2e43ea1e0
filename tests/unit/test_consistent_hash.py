import bisect
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

import mmh3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routers.consistent_hash as ch
from routers.consistent_hash import ConsistentHash
from routers.core import InFlightTracker, ReplicaView, RouteRequest

REPO = Path(__file__).resolve().parents[2]
replica_ids = st.text(min_size=1, max_size=16)


def _mmh(key: str) -> int:
    # Spelled out, not imported: changing the seed would re-route every session on a rolling upgrade.
    return mmh3.hash64(key, seed=0xF9B4CA77, signed=False)[0]


def _oracle_ring(ids, hash_fn=_mmh) -> list[tuple[int, str]]:
    return sorted((hash_fn(f"{r}:{i}"), r) for r in ids for i in range(100))


def _oracle_lookup(ring: list[tuple[int, str]], key: str, k: int, hash_fn=_mmh) -> list[str]:
    """First 1+k distinct owners walking clockwise from the first point after the key's hash."""
    start = bisect.bisect_right([p for p, _ in ring], hash_fn(key)) % len(ring)
    found: list[str] = []
    for step in range(len(ring)):
        owner = ring[(start + step) % len(ring)][1]
        if owner not in found:
            found.append(owner)
    return found[: 1 + k]


def _policy(ids, **kwargs) -> ConsistentHash:
    policy = ConsistentHash(**kwargs)
    policy.on_replicas_changed(sorted(ids))
    return policy


def _ring_of(policy: ConsistentHash) -> list[tuple[int, str]]:
    return list(zip(policy._points, policy._owners, strict=True))


def _views(ids, **overrides) -> list[ReplicaView]:
    return [ReplicaView(replica_id=r, **overrides) for r in ids]


def test_constants_are_pinned() -> None:
    assert (ch.HASH_SEED, ch.VIRTUAL_NODES, ch.DEFAULT_NUM_FALLBACK_REPLICAS) == (0xF9B4CA77, 100, 2)
    assert ConsistentHash.name == "consistent_hash" and ConsistentHash.sticky


_CHILD = """
import json, random, sys
from routers.consistent_hash import ConsistentHash
from routers.core import InFlightTracker, ReplicaView, RouteRequest
job = json.load(sys.stdin)
out = []
for ids in job["sets"]:
    # A different history from the parent's cold build: three extra replicas that then leave.
    policy = ConsistentHash()
    policy.on_replicas_changed(sorted(ids + ["extra-a", "extra-b", "extra-c"]))
    views = [ReplicaView(replica_id=r) for r in ids]
    random.Random(7).shuffle(views)
    answers = [[t[0].replica_id for t in policy.rank(views, RouteRequest(request_id=s, session_id=s))]
               for s in job["sessions"]]
    out.append({"ring": repr(list(zip(policy._points, policy._owners))), "answers": answers})
print(json.dumps(out))
"""


def test_same_set_gives_the_same_ring_and_answers_in_another_process() -> None:
    rng = random.Random(2024)
    sets = [[f"r{rng.getrandbits(40):x}" for _ in range(n)] for n in (1, 2, 3, 5, 8, 37, 128, 1024)]
    sessions = [f"session-{rng.getrandbits(64):x}" for _ in range(200)]
    # A different str-hash seed from ours: set or dict iteration order must not leak into the ring.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps({"sets": sets, "sessions": sessions}),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
        timeout=120,
    )
    theirs = json.loads(child.stdout)
    for ids, other in zip(sets, theirs, strict=True):
        policy = ConsistentHash()
        views = _views(ids)
        ours = [
            [t[0].replica_id for t in policy.rank(views, RouteRequest(request_id=s, session_id=s))] for s in sessions
        ]
        assert repr(_ring_of(policy)) == other["ring"]
        assert ours == other["answers"]
        if len(ids) <= 8:  # the naive oracle is slow on big rings
            assert _ring_of(policy) == _oracle_ring(ids)
            assert ours == [_oracle_lookup(_oracle_ring(ids), s, 2) for s in sessions]


@settings(max_examples=40, deadline=None)
@given(initial=st.lists(replica_ids, max_size=12, unique=True), data=st.data(), coarse=st.booleans())
def test_ring_depends_only_on_the_set_not_its_history(initial, data, coarse) -> None:
    """In-place and full rebuilds agree with a from-scratch sort by (hash, id), even when hashes collide."""
    hash_fn = (lambda key: _mmh(key) % 64) if coarse else _mmh  # % 64 forces many equal hashes
    with mock.patch.object(ch, "_hash", hash_fn):
        policy = _policy(initial)
        current = set(initial)
        assert _ring_of(policy) == _oracle_ring(current, hash_fn)
        for _ in range(data.draw(st.integers(1, 6))):
            # Up to 16 joins and leaves at once: both the in-place and the full-sort paths.
            leave = data.draw(st.lists(st.sampled_from(sorted(current)), max_size=8)) if current else []
            current = (current - set(leave)) | set(data.draw(st.lists(replica_ids, max_size=8)))
            policy.on_replicas_changed(sorted(current))
            assert _ring_of(policy) == _oracle_ring(current, hash_fn)
        if current:
            for key in ("a", "b", "session-1"):
                assert policy.lookup(key)[0] == _oracle_lookup(_oracle_ring(current, hash_fn), key, 2, hash_fn)


SESSIONS = [f"session-{i}" for i in range(10_000)]


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(replica_ids, min_size=2, max_size=21, unique=True))
def test_adding_a_replica_moves_about_its_share_and_only_to_it(ids) -> None:
    before = _policy(ids[:-1])
    after = _policy(ids)
    new = ids[-1]
    moved = [s for s in SESSIONS if before.lookup(s)[0][0] != after.lookup(s)[0][0]]
    assert all(after.lookup(s)[0][0] == new for s in moved)
    n = len(ids)
    p = 1 / n
    # The new replica's ring share is Beta(100, 100(n-1)) (sd 0.035 at n=2): +-0.05 is 5 sd only from
    # n=10 on, so below that allow 5 sd (ring share plus sampling of 10,000 sessions) instead.
    tolerance = max(0.05, 5 * math.sqrt(p * (1 - p) * (1 / (100 * n) + 1 / len(SESSIONS))))
    assert abs(len(moved) / len(SESSIONS) - p) <= tolerance


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(replica_ids, min_size=2, max_size=21, unique=True), data=st.data())
def test_removing_a_replica_moves_only_its_sessions(ids, data) -> None:
    gone = data.draw(st.sampled_from(ids))
    before = _policy(ids)
    after = _policy([r for r in ids if r != gone])
    for s in SESSIONS[:2000]:
        old, new = before.lookup(s)[0][0], after.lookup(s)[0][0]
        assert new == old if old != gone else new != gone


@settings(max_examples=50, deadline=None)
@given(
    ids=st.lists(replica_ids, min_size=1, max_size=30, unique=True),
    k=st.integers(0, 6),
    keys=st.lists(st.text(max_size=20), min_size=1, max_size=30),
)
def test_fallbacks_are_distinct_clockwise_and_exclude_the_primary(ids, k, keys) -> None:
    policy = _policy(ids, num_fallback_replicas=k)
    ring = _oracle_ring(ids)
    for key in keys:
        ranking = policy.rank(_views(ids), RouteRequest(request_id=key, session_id=key))
        assert all(len(tier) == 1 for tier in ranking)
        ranked = [tier[0].replica_id for tier in ranking]
        assert len(ranked) == len(set(ranked)) == 1 + min(k, len(ids) - 1)
        assert ranked == _oracle_lookup(ring, key, k)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 12),
    load_factor=st.floats(1.0, 3.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_bounded_load_never_places_over_the_bound(n, load_factor, seed) -> None:
    rng = random.Random(seed)
    ids = [f"replica-{i}" for i in range(n)]
    ring = _oracle_ring(ids)
    policy = ConsistentHash(load_factor=load_factor)
    load = dict.fromkeys(ids, 0)
    open_requests: dict[str, str] = {}
    for step in range(300):
        if open_requests and rng.random() < 0.3:
            request_id = rng.choice(sorted(open_requests))
            replica_id = open_requests.pop(request_id)
            policy.on_completed(request_id, replica_id)
            load[replica_id] -= 1
            continue
        session = f"hot-{rng.randrange(3)}"  # a few hot sessions pile onto their owners
        bound = math.ceil(load_factor * (sum(load.values()) + 1) / n)
        views = [ReplicaView(replica_id=r, in_flight=load[r]) for r in ids]
        request_id = f"req-{step}"
        primary = policy.rank(views, RouteRequest(request_id=request_id, session_id=session))[0][0].replica_id
        assert load[primary] + 1 <= bound
        clockwise = _oracle_lookup(ring, session, n - 1)
        assert primary == next(r for r in clockwise if load[r] + 1 <= bound)
        assert policy.counts.last_reason == ("primary" if primary == clockwise[0] else "bound_exceeded")
        load[primary] += 1
        open_requests[request_id] = primary
        assert policy.live_in_flight(ReplicaView(replica_id=primary)) == load[primary]


def test_requests_without_a_session_spread_evenly() -> None:
    # 100 virtual nodes give a replica's ring share a CV of about sqrt(7/8 / 100) = 0.094 over 8 replicas,
    # so CV <= 0.1 holds on average over replica sets, not for every set (replica-000..007 gives 0.127).
    rng = random.Random(11)
    policy = ConsistentHash()
    cvs = []
    for _ in range(10):
        views = _views(f"{rng.getrandbits(48):012x}" for _ in range(8))
        counts = dict.fromkeys((v.replica_id for v in views), 0)
        for _ in range(10_000):
            counts[policy.rank(views, RouteRequest(request_id=f"{rng.getrandbits(64):x}"))[0][0].replica_id] += 1
        cvs.append(statistics.pstdev(counts.values()) / statistics.mean(counts.values()))
    assert statistics.mean(cvs) <= 0.12 and max(cvs) <= 0.2, cvs
    assert policy.counts.decisions == {"no_session_header": 100_000}


def test_session_sticks_and_ring_is_rebuilt_only_when_the_set_changes() -> None:
    ids = [f"replica-{i:03d}" for i in range(6)]
    policy = ConsistentHash()
    views = _views(ids)
    first = policy.rank(views, RouteRequest(request_id="r0", session_id="alice"))[0][0].replica_id
    for i in range(1, 50):
        shuffled = random.Random(i).sample(views, len(views))
        shuffled.append(ReplicaView(replica_id="sick", healthy=False))  # unroutable: not part of the set
        assert policy.rank(shuffled, RouteRequest(request_id=f"r{i}", session_id="alice"))[0][0].replica_id == first
    assert policy.rebuild_count == 1
    assert policy.counts.decisions["primary"] == 50

    # Queue depth is ignored without a load factor: the hot session stays put.
    loaded = [ReplicaView(replica_id=r, in_flight=1000 if r == first else 0) for r in ids]
    assert policy.rank(loaded, RouteRequest(request_id="r50", session_id="alice"))[0][0].replica_id == first

    policy.rank(_views([*ids, "replica-new"]), RouteRequest(request_id="r51", session_id="alice"))
    assert policy.rebuild_count == 2
    policy.rank(_views(ids), RouteRequest(request_id="r52", session_id=""))
    policy.rank(_views(ids), RouteRequest(request_id="r53"))
    assert policy.rebuild_count == 3
    assert policy.counts.decisions["no_session_header"] == 2


def test_user_affinity_keys_on_the_body_user_only_when_there_is_no_session() -> None:
    ids = [f"replica-{i:03d}" for i in range(6)]
    views = _views(ids)
    ring = _oracle_ring(ids)
    policy = ConsistentHash(user_affinity=True)
    users = [f"user-{i}" for i in range(40)]
    for user in users:
        owners = {
            policy.rank(views, RouteRequest(request_id=f"{user}-{t}", user=user))[0][0].replica_id for t in range(5)
        }
        assert owners == {_oracle_lookup(ring, f"user:{user}", 0)[0]}
    assert len({_oracle_lookup(ring, f"user:{u}", 0)[0] for u in users}) > 1, "users spread over the ring"
    assert policy.counts.decisions == {"user_affinity": 200}
    # A session header wins over the user; without the opt-in the user is ignored.
    with_session = policy.rank(views, RouteRequest(request_id="r", session_id="alice", user="bob"))
    assert with_session[0][0].replica_id == _oracle_lookup(ring, "alice", 0)[0]
    plain = ConsistentHash()
    spread = {plain.rank(views, RouteRequest(request_id=f"r{i}", user="bob"))[0][0].replica_id for i in range(60)}
    assert len(spread) > 1 and plain.counts.decisions == {"no_session_header": 60}


def test_bound_exceeded_is_counted_when_the_owner_is_full() -> None:
    ids = [f"replica-{i:03d}" for i in range(4)]
    policy = ConsistentHash(load_factor=1.0)
    natural, second, *_ = _oracle_lookup(_oracle_ring(ids), "alice", 3)
    views = [ReplicaView(replica_id=r, in_flight=3 if r == natural else 0) for r in ids]
    ranking = policy.rank(views, RouteRequest(request_id="r1", session_id="alice"))
    # bound = ceil(1.0 * (3 + 1) / 4) = 1: the owner is full, the next replica clockwise takes it.
    assert ranking[0][0].replica_id == second
    assert policy.counts.decisions == {"bound_exceeded": 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_fallback_replicas": -1}, "num_fallback_replicas"),
        ({"load_factor": 0.5}, "load_factor"),
        ({"load_factor": 0.999}, "load_factor"),
        ({"load_factor": float("nan")}, "load_factor"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ConsistentHash(**kwargs)


def test_constructor_accepts_the_edges() -> None:
    policy = ConsistentHash(num_fallback_replicas=0, load_factor=1.0)
    assert (policy.num_fallback_replicas, policy.load_factor, policy.rebuild_count) == (0, 1.0, 0)


def test_bounded_load_on_one_views_tuple_tracks_every_change_of_the_counts() -> None:
    """The same views tuple throughout, so the load sum is kept rather than added up: completions, requests that went
    to a fallback, a swapped tracker and requests it forgets all change it, and each primary matches a full recount."""
    ids = [f"replica-{i}" for i in range(6)]
    reported = {r: i % 3 for i, r in enumerate(ids)}  # the caller's own counts, the floor of each live count
    views = tuple(ReplicaView(replica_id=r, in_flight=reported[r]) for r in ids)
    ring = _oracle_ring(ids)
    policy = ConsistentHash(load_factor=1.25)
    rng = random.Random(5)
    now = [0.0]
    placed: dict[str, str] = {}  # open request id -> the replica it is counted on
    for step in range(600):
        if step == 300:
            policy.tracker = InFlightTracker(forget_after_s=10.0, clock=lambda: now[0])
            placed.clear()
        if open_ids := sorted(placed):
            request_id = rng.choice(open_ids)
            roll = rng.random()
            if roll < 0.25:
                policy.on_completed(request_id, placed.pop(request_id))
                continue
            if roll < 0.35:
                placed[request_id] = rng.choice(ids)
                policy.on_routed(RouteRequest(request_id=request_id), placed[request_id])
                continue
        live = {r: max(reported[r], sum(p == r for p in placed.values())) for r in ids}
        bound = math.ceil(1.25 * (sum(live.values()) + 1) / len(ids))
        session = f"hot-{rng.randrange(3)}"
        expected = next(r for r in _oracle_lookup(ring, session, len(ids) - 1) if live[r] + 1 <= bound)
        request_id = f"req-{step}"
        forgets = step >= 450 and not now[0]  # this decision's placement forgets every earlier one
        if forgets:
            now[0] = 11.0
        assert policy.rank(views, RouteRequest(request_id, session))[0][0].replica_id == expected
        if forgets:
            placed.clear()
        placed[request_id] = expected
