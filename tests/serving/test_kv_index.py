"""The fleet KV index: a worker's KV event log (kv_events) and the proxy's index
(kv_index) fed from it, under lost events, restarts of either side, dead workers and
forged answers. Torch-free: the events are synthetic, the "workers" are event logs
called in-process (the HTTP path is tested in test_kv_routing.py)."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import pytest

from pdkv.errors import InvalidArgument
from pdkv.serving.kv_events import KVEventLog, parse_query
from pdkv.serving.kv_index import KVEventsRefused, KVIndex, KVIndexPoller
from pdkv.serving.prefix_hash import block_hashes, cache_salt
from pdkv.serving.proxy_pool import PoolWorker

BT = 4
SALT = cache_salt("tiny", block_tokens=BT, dtype="float32")


@dataclass(frozen=True)
class Ev:
    """A synthetic engine event (engine_types.KVEvent's shape)."""

    kind: str
    hashes: tuple[str, ...] = ()


class FakeCache:
    """A worker's prefix cache: a set of hashes, and its event log fed like the engine feeds it."""

    def __init__(self, *, max_events: int = 4096, max_response_hashes: int = 4096, salt: str = SALT,
                 epoch: str | None = None) -> None:
        self.held: set[str] = set()
        self.log = KVEventLog(lambda: tuple(self.held), lambda: salt, BT, max_events=max_events,
                              max_response_hashes=max_response_hashes, epoch=epoch)

    def store(self, hs: list[str]) -> None:
        self.held.update(hs)
        self.log.record(Ev("stored", tuple(hs)))

    def evict(self, hs: list[str]) -> None:
        self.held.difference_update(hs)
        self.log.record(Ev("evicted", tuple(hs)))

    def clear(self) -> None:
        self.held.clear()
        self.log.record(Ev("cleared"))


def sync(index: KVIndex, url: str, cache: FakeCache, rounds: int = 50) -> None:
    """Polls ``cache`` until the index says nothing more is waiting."""
    for _ in range(rounds):
        q = index.next_query(url)
        if not index.apply(url, q, cache.log.query(parse_query(q))):
            return
    raise AssertionError("the index did not settle")


def held(index: KVIndex, url: str) -> set[str]:
    return {h for h in index._workers[url].hashes}  # noqa: SLF001 - the test's view of the truth


def chain(prompt: list[int]) -> list[str]:
    return block_hashes(prompt, BT, SALT)


PROMPT = list(range(10, 30))          # 5 full blocks
HS = chain(PROMPT)


# ---------------------------------------------------------------- the worker's log
def test_log_numbers_events_and_answers_those_after_since():
    c = FakeCache(epoch="e1")
    c.store(HS[:2])
    c.store(HS[2:3])
    c.evict(HS[:1])
    a = c.log.query(parse_query({"epoch": "e1", "since": "1"}))
    assert a["epoch"] == "e1" and a["salt"] == SALT and a["block_tokens"] == BT
    assert [(e["seq"], e["kind"], e["hashes"]) for e in a["events"]] == [(2, "stored", HS[2:3]),
                                                                          (3, "evicted", HS[:1])]
    assert a["seq"] == 3 and a["more"] is False
    assert c.log.query(parse_query({"epoch": "e1", "since": "3"}))["events"] == []


@pytest.mark.parametrize("q", [{}, {"epoch": "other", "since": "0"}, {"epoch": "e1"}, {"epoch": "e1", "since": "99"}])
def test_log_answers_a_snapshot_to_a_stranger_a_restart_or_a_future_seq(q):
    c = FakeCache(epoch="e1")
    c.store(HS)
    a = c.log.query(parse_query(q))
    assert "events" not in a and sorted(a["snapshot"]) == sorted(HS) and a["seq"] == 1 and a["more"] is False


def test_log_forgets_old_events_and_a_proxy_behind_gets_a_snapshot():
    c = FakeCache(max_events=3, epoch="e1")
    for h in HS:
        c.store([h])
    assert c.log.dropped == 2
    a = c.log.query(parse_query({"epoch": "e1", "since": "1"}))   # event 2 is gone
    assert "snapshot" in a
    a = c.log.query(parse_query({"epoch": "e1", "since": "2"}))   # 3, 4, 5 are kept
    assert [e["seq"] for e in a["events"]] == [3, 4, 5]


def test_log_splits_a_long_event_and_pages_answers_and_snapshots():
    c = FakeCache(max_response_hashes=2, epoch="e1")
    c.store(HS)                                   # 5 hashes -> events 1..3 of 2, 2, 1
    a = c.log.query(parse_query({"epoch": "e1", "since": "0"}))
    assert [len(e["hashes"]) for e in a["events"]] == [2] and a["more"] is True and a["seq"] == 1
    pages, after = [], ""
    while True:
        a = c.log.query(parse_query({"snapshot": "1", **({"after": after} if after else {})}))
        pages.append(a["snapshot"])
        if not a["more"]:
            break
        after = a["snapshot"][-1]
    assert [len(p) for p in pages] == [2, 2, 1] and sum(pages, []) == sorted(HS)


def test_log_refuses_a_malformed_engine_event_and_forces_a_snapshot(caplog):
    c = FakeCache(epoch="e1")
    c.store(HS[:1])
    with caplog.at_level(logging.ERROR, logger="pdkv.serving"):
        c.log.record(Ev("stored", ("not-a-hash",)))
        c.log.record(Ev("exploded", ()))
    assert c.log.refused == 2 and "KV event refused" in caplog.text
    assert "snapshot" in c.log.query(parse_query({"epoch": "e1", "since": "1"}))


@pytest.mark.parametrize("q, word", [({"since": "-1"}, "since"), ({"since": "x"}, "since"), ({"epoch": "a b"}, "epoch"),
                                     ({"epoch": "e" * 65}, "epoch"), ({"snapshot": "2"}, "snapshot"),
                                     ({"snapshot": "1", "after": "zz"}, "after"), ({"after": HS[0]}, "after"),
                                     ({"bogus": "1"}, "bogus"), ({"since": "9" * 30}, "since"),
                                     ({"since": "\u00b2"}, "since"), ({"epoch": "\u00e9t\u00e9"}, "epoch")])
def test_log_query_validation_names_the_parameter(q, word):
    with pytest.raises(InvalidArgument, match=word):
        parse_query(q)


# ---------------------------------------------------------------- the proxy's index
def test_index_converges_and_matches_leading_blocks_only():
    idx, c = KVIndex(), FakeCache()
    c.store(HS[:3])
    sync(idx, "A", c)
    assert idx.match(PROMPT, ["A", "B"]) == {"A": 3 * BT, "B": 0}
    c.evict(HS[1:2])                              # a hole: only block 0 still leads
    sync(idx, "A", c)
    assert idx.match(PROMPT, ["A"]) == {"A": BT}
    c.clear()
    sync(idx, "A", c)
    assert idx.match(PROMPT, ["A"]) == {"A": 0} and idx.blocks("A") == 0 and idx.holders(HS[0]) == frozenset()


def test_index_matches_workers_by_their_own_salt():
    other = cache_salt("other-model", block_tokens=BT, dtype="float32")
    idx, a, b = KVIndex(), FakeCache(), FakeCache(salt=other)
    a.store(HS[:2])
    b.store(HS[:4])                   # b's hashes are under another salt: they are not this prompt's
    sync(idx, "A", a)
    sync(idx, "B", b)
    assert idx.match(PROMPT, ["A", "B"]) == {"A": 2 * BT, "B": 0}
    b.store(block_hashes(PROMPT, BT, other)[:3])
    sync(idx, "B", b)
    assert idx.match(PROMPT, ["A", "B"]) == {"A": 2 * BT, "B": 3 * BT}


def test_index_resyncs_by_snapshot_after_lost_events():
    idx, c = KVIndex(), FakeCache(epoch="e1")
    c.store(HS[:1])
    sync(idx, "A", c)
    c.store(HS[1:2])
    c.store(HS[2:3])
    lost = c.log.query(parse_query({"epoch": "e1", "since": "1"}))
    lost["events"] = lost["events"][1:]           # event 2 lost on the way
    assert idx.apply("A", {"epoch": "e1", "since": "1"}, lost) is True
    assert idx.resyncs["gap"] == 1 and idx.next_query("A") == {"snapshot": "1"}
    sync(idx, "A", c)
    assert held(idx, "A") == set(HS[:3]) and idx.match(PROMPT, ["A"])["A"] == 3 * BT


def test_index_resyncs_when_the_worker_log_forgot_what_it_missed():
    idx, c = KVIndex(), FakeCache(max_events=2, epoch="e1")
    c.store(HS[:1])
    sync(idx, "A", c)
    for h in HS[1:]:
        c.store([h])                              # more than the log keeps
    c.evict(HS[:1])
    sync(idx, "A", c)
    assert idx.resyncs["behind"] == 1 and held(idx, "A") == set(HS[1:])


def test_a_restarted_proxy_converges_from_snapshots():
    c1, c2 = FakeCache(), FakeCache()
    c1.store(HS[:2])
    c2.store(HS[:4])
    old = KVIndex()
    sync(old, "A", c1)
    c1.store(HS[2:3])
    new = KVIndex()                              # the proxy restarted: empty, knows no epoch
    assert new.match(PROMPT, ["A", "B"]) == {"A": 0, "B": 0}
    sync(new, "A", c1)
    sync(new, "B", c2)
    assert new.match(PROMPT, ["A", "B"]) == {"A": 3 * BT, "B": 4 * BT}


def test_a_restarted_worker_is_resynced_under_its_new_epoch():
    idx, c = KVIndex(), FakeCache(epoch="first")
    c.store(HS)
    sync(idx, "A", c)
    c2 = FakeCache(epoch="second")                  # same URL, new process: its cache is empty
    c2.store(HS[:1])
    sync(idx, "A", c2)
    assert idx.state("A")["epoch"] == "second" and held(idx, "A") == set(HS[:1])
    assert idx.resyncs["restarted"] == 1 and idx.match(PROMPT, ["A"])["A"] == BT


def test_periodic_snapshot_repairs_what_events_never_said():
    now = [0.0]
    idx, c = KVIndex(snapshot_interval_s=10.0, clock=lambda: now[0]), FakeCache()
    c.store(HS[:2])
    sync(idx, "A", c)
    c.held.add(HS[2])                            # changed without an event (a bug, a lost sink call)
    sync(idx, "A", c)
    assert HS[2] not in held(idx, "A")
    now[0] = 11.0
    sync(idx, "A", c)
    assert HS[2] in held(idx, "A") and idx.resyncs["periodic"] == 1


def test_snapshot_pages_with_changes_between_them_converge():
    rng = random.Random(7)
    universe = chain(list(range(200)))          # 50 hashes
    for trial in range(20):
        c = FakeCache(max_response_hashes=3)
        c.store(rng.sample(universe, 20))
        idx = KVIndex()
        for _ in range(40):                      # one page or event batch, then the cache moves
            q = idx.next_query("A")
            idx.apply("A", q, c.log.query(parse_query(q)))
            op = rng.random()
            if op < 0.4:
                c.store(rng.sample(universe, 2))
            elif op < 0.8:
                c.evict(rng.sample(sorted(c.held), min(2, len(c.held))))
        sync(idx, "A", c)
        assert held(idx, "A") == c.held, trial
        for h in universe:                       # the reverse map agrees
            assert ("A" in idx.holders(h)) == (h in c.held)


def test_dropping_a_worker_removes_all_its_entries():
    idx, a, b = KVIndex(), FakeCache(), FakeCache()
    a.store(HS)
    b.store(HS[:2])
    sync(idx, "A", a)
    sync(idx, "B", b)
    idx.drop("A", "dead")
    assert idx.match(PROMPT, ["A", "B"]) == {"A": 0, "B": 2 * BT}
    assert idx.holders(HS[3]) == frozenset() and idx.holders(HS[0]) == {"B"} and idx.drops["dead"] == 1


# ---------------------------------------------------------------- forged answers
def _good(c: FakeCache, idx: KVIndex) -> tuple[dict[str, str], dict[str, Any]]:
    q = idx.next_query("A")
    return q, c.log.query(parse_query(q))


@pytest.mark.parametrize("forge, reason", [
    (lambda a: a.update(snapshot=["g" * 16]), "bad_hash"),
    (lambda a: a.update(snapshot=[1]), "bad_hash"),
    (lambda a: a.update(snapshot="abc"), "malformed"),
    (lambda a: a.update(snapshot=["%016x" % i for i in range(20)]), "oversized"),
    (lambda a: a.update(epoch=""), "malformed"),
    (lambda a: a.update(seq=-1), "malformed"),
    (lambda a: a.update(seq=True), "malformed"),
    (lambda a: a.update(salt="nope"), "malformed"),
    (lambda a: a.update(block_tokens=0), "malformed"),
    (lambda a: a.update(more="yes"), "malformed"),
    (lambda a: a.update(events=[]), "malformed"),
    (lambda a: a.clear(), "malformed"),
])
def test_forged_snapshots_are_refused_with_a_reason(forge, reason):
    idx, c = KVIndex(max_response_hashes=10), FakeCache()
    c.store(HS[:2])
    q, a = _good(c, idx)
    forge(a)
    with pytest.raises(KVEventsRefused) as e:
        idx.apply("A", q, a)
    assert e.value.reason == reason and idx.refusals[reason] == 1 and "A" not in idx.urls()


@pytest.mark.parametrize("forge, reason", [
    (lambda a: a["events"].append({"seq": 3, "kind": "stored", "hashes": ["X" * 16]}), "bad_hash"),
    (lambda a: a["events"].append({"seq": 3, "kind": "nuked", "hashes": []}), "malformed"),
    (lambda a: a["events"].append({"seq": "3", "kind": "stored", "hashes": []}), "malformed"),
    (lambda a: a["events"].append("stored"), "malformed"),
    (lambda a: a["events"].extend({"seq": 3 + i, "kind": "stored", "hashes": HS[:3]} for i in range(4)), "oversized"),
    (lambda a: a.update(events={"a": 1}), "malformed"),
])
def test_forged_events_are_refused_and_the_worker_resynced(forge, reason):
    idx, c = KVIndex(max_response_hashes=10), FakeCache(epoch="e1")
    c.store(HS[:1])
    sync(idx, "A", c)
    c.store(HS[1:2])
    q, a = _good(c, idx)
    forge(a)
    a["seq"] = a["events"][-1]["seq"] if isinstance(a["events"], list) and a["events"] and \
        isinstance(a["events"][-1], dict) and isinstance(a["events"][-1].get("seq"), int) else a["seq"]
    with pytest.raises(KVEventsRefused) as e:
        idx.apply("A", q, a)
    assert e.value.reason == reason and "A" not in idx.urls()
    sync(idx, "A", c)                            # the next poll starts again from a snapshot
    assert held(idx, "A") == set(HS[:2])


def test_a_worker_cannot_hold_more_than_its_cap():
    idx = KVIndex(max_hashes_per_worker=8, max_response_hashes=4)
    c = FakeCache(max_response_hashes=4)
    many = chain(list(range(100)))               # 25 hashes
    c.store(many[:6])
    sync(idx, "A", c)
    c.store(many[6:12])                          # events beyond the cap
    with pytest.raises(KVEventsRefused) as e:
        sync(idx, "A", c)
    assert e.value.reason == "too_many" and "A" not in idx.urls()
    with pytest.raises(KVEventsRefused) as e:    # and a snapshot beyond it
        sync(idx, "A", c)
    assert e.value.reason == "too_many" and idx.blocks() == 0


# ---------------------------------------------------------------- the poller
class _Resp:
    def __init__(self, status: int, raw: bytes) -> None:
        self.status = status
        self._raw = raw
        self.content = self

    async def read(self, n: int = -1) -> bytes:
        return self._raw if n < 0 else self._raw[:n]

    async def __aenter__(self) -> "_Resp":
        return self

    async def __aexit__(self, *a: Any) -> None:
        return None


class FakeClient:
    """WorkerClient.get over in-process event logs (or canned answers)."""

    def __init__(self, caches: dict[str, Any]) -> None:
        self.caches = caches
        self.calls: list[str] = []

    def get(self, url: str, **kw: Any) -> _Resp:
        import json
        from urllib.parse import parse_qsl, urlsplit

        self.calls.append(url)
        u = urlsplit(url)
        base = f"{u.scheme}://{u.netloc}"
        c = self.caches[base]
        if isinstance(c, tuple):
            return _Resp(*c)
        return _Resp(200, json.dumps(c.log.query(parse_query(dict(parse_qsl(u.query))))).encode())


def _pool_worker(url: str) -> PoolWorker:
    w = PoolWorker(url, "decode")
    w.info = object()  # type: ignore[assignment] - known to the proxy
    return w


def test_poller_drops_dead_and_removed_workers_and_logs_forged_answers(caplog):
    a, b = FakeCache(), FakeCache()
    a.store(HS)
    b.store(HS[:2])
    ws = [_pool_worker("http://a"), _pool_worker("http://b"), _pool_worker("http://c")]
    client = FakeClient({"http://a": a, "http://b": b,
                         "http://c": (200, b'{"epoch":"e","seq":0,"salt":"","block_tokens":4,"snapshot":["zz"]}')})
    idx = KVIndex()
    poller = KVIndexPoller(idx, client, lambda: list(ws))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="pdkv.serving"):
        asyncio.run(poller.poll_once())
    assert idx.match(PROMPT, ["http://a", "http://b", "http://c"]) == {"http://a": 5 * BT, "http://b": 2 * BT,
                                                                         "http://c": 0}
    assert "refused decode worker http://c" in caplog.text and "bad_hash" in caplog.text
    assert all("/pd/kv_events?" in u for u in client.calls)
    ws[0].alive = False                                   # a missed liveness probe
    ws.pop(1)                                             # b left the pool
    asyncio.run(poller.poll_once())
    assert idx.urls() == set() and idx.match(PROMPT, ["http://a", "http://b"]) == {"http://a": 0, "http://b": 0}


def test_poller_refuses_an_oversized_body_and_drops_on_errors():
    ws = [_pool_worker("http://a"), _pool_worker("http://b")]
    big = b'{"snapshot": [' + b'"0123456789abcdef",' * 1000 + b'"0123456789abcdef"]}'
    client = FakeClient({"http://a": (200, big), "http://b": (500, b"{}")})
    idx = KVIndex()
    poller = KVIndexPoller(idx, client, lambda: list(ws), max_body_bytes=1024)  # type: ignore[arg-type]
    asyncio.run(poller.poll_once())
    assert idx.refusals["oversized"] == 1 and idx.urls() == set()


# ---------------------------------------------------------------- fuzzing
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    given = None

if given is not None:
    _hash = st.sampled_from(HS + ["0" * 16, "f" * 16])
    _scalar = st.none() | st.booleans() | st.integers(-3, 1 << 70) | st.text(max_size=20) | _hash
    _json = st.recursive(_scalar, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c,
                                                                                         max_size=5), max_leaves=25)
    _event = st.fixed_dictionaries({"seq": st.integers(0, 8), "kind": st.sampled_from(["stored", "evicted", "cleared",
                                                                                        "x"]),
                                    "hashes": st.lists(_hash | _scalar, max_size=6)})
    _answer = st.fixed_dictionaries(
        {"epoch": st.sampled_from(["e1", "e2", "", "e 1"]), "seq": st.integers(-1, 9) | _scalar,
         "salt": st.sampled_from([SALT, "", "zz"]), "block_tokens": st.sampled_from([BT, 0, 8, "4"]),
         "more": st.booleans() | _scalar},
        optional={"events": st.lists(_event | _json, max_size=6) | _json,
                  "snapshot": st.lists(_hash, max_size=8) | _json})
    _query = st.sampled_from([{"snapshot": "1"}, {"epoch": "e1", "since": "1"}, {"snapshot": "1", "after": HS[2]}])

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(answers=st.lists(st.tuples(_query, _answer | _json), min_size=1, max_size=8))
    def test_fuzzed_answers_raise_only_refusals_and_keep_the_index_consistent(answers):
        idx = KVIndex(max_hashes_per_worker=5, max_response_hashes=6)
        c = FakeCache(epoch="e1")
        c.store(HS[:2])
        sync(idx, "A", c)
        for q, a in answers:
            try:
                idx.apply("A", q, a)
            except KVEventsRefused as e:
                assert e.reason in ("malformed", "oversized", "bad_hash", "too_many")
            w = idx._workers.get("A")  # noqa: SLF001
            mine = w.hashes if w is not None else set()
            assert len(mine) <= 5
            assert {h for h, ws in idx._owners.items() if "A" in ws} == mine  # noqa: SLF001

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(q=st.dictionaries(st.sampled_from(["epoch", "since", "snapshot", "after", "x"]), st.text(max_size=30),
                             max_size=4))
    def test_fuzzed_queries_raise_only_invalid_argument(q):
        c = FakeCache(epoch="e1")
        c.store(HS)
        try:
            parsed = parse_query(q)
        except InvalidArgument:
            return
        a = c.log.query(parsed)
        assert ("events" in a) != ("snapshot" in a)
