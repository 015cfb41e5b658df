"""Every public argument is validated once, with a pdkv error that names it.

Covers issue 11 items 9 and 10: mismatched geometries are an error naming both (never
a partial transfer), block ids are integers in range with distinct destinations,
notifications are bytes/str within the limit, timeouts are finite and positive,
registration takes only objects with a pointer and a length, and metadata strings are
valid UTF-8 (else ProtocolError at add_peer, not a UnicodeDecodeError later).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

import pdkv
from conftest import SECRET
from kvpools import Pool, PoolSpec


@pytest.fixture
def pair():
    """Two tcp agents in this process, each with a pool of SPEC under 'kv', connected."""
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["tcp"]) as b:
        yield a, b


def pools(a, b, lspec: PoolSpec, rspec: PoolSpec, seed: int = 1):
    pa, pb = Pool(lspec, seed), Pool(rspec)
    pa.register(a)
    pb.register(b)
    return pa, pb, a.connect(b.address)


SPEC = PoolSpec(layers=2, blocks=16, block_tokens=4, heads=2, head_dim=8, dtype="float16")


# ------------------------------------------------------------------ item 9: geometries
def test_one_head_to_two_heads_without_a_plan_is_an_error_naming_both(pair):
    a, b = pair
    pa, pb, peer = pools(a, b, PoolSpec(heads=1), PoolSpec(heads=2))
    with pytest.raises(pdkv.InvalidArgument, match="num_heads") as info:
        a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [2, 3]))
    assert "kv_heads=1" in str(info.value) and "kv_heads=2" in str(info.value)
    assert not pb.logical(range(16)).any()  # nothing moved
    # With an explicit plan: head 0 of the 2-head pool, exactly.
    assert a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [2, 3]),
                   plan=pdkv.PlanOptions(num_heads=1, remote_head_offset=1)).wait(10)
    got = pb.logical([2, 3])
    assert np.array_equal(got[:, :, :, 1:2], pa.logical([0, 1]))
    assert not got[:, :, :, 0].any()


def test_different_block_sizes_need_num_tokens_unless_the_lists_hold_equal_tokens(pair):
    a, b = pair
    pa, pb, peer = pools(a, b, PoolSpec(block_tokens=8), PoolSpec(block_tokens=4))
    with pytest.raises(pdkv.InvalidArgument, match="num_tokens") as info:
        a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [2, 3]))  # 16 tokens vs 8: used to move 8 silently
    assert "block_tokens=8" in str(info.value) and "block_tokens=4" in str(info.value)
    with pytest.raises(pdkv.InvalidArgument, match="num_tokens"):
        a.read(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [2, 3, 4]))
    assert a.write(peer, pdkv.Blocks("kv", [0, 1]),
                   pdkv.Blocks("kv", [2, 3, 4, 5])).wait(10)  # 16 = 16: a full re-layout
    assert np.array_equal(pb.logical([2, 3, 4, 5]), pa.logical([0, 1]))
    assert a.write(peer, pdkv.Blocks("kv", [3]), pdkv.Blocks("kv", [9, 10]),
                   plan=pdkv.PlanOptions(num_tokens=5)).wait(10)
    assert np.array_equal(pb.logical([9, 10])[:, :, :5], pa.logical([3])[:, :, :5])
    assert not pb.logical([9, 10])[:, :, 5:].any()


def test_same_block_size_but_different_list_lengths_need_num_tokens(pair):
    a, b = pair
    pa, pb, peer = pools(a, b, SPEC, PoolSpec(**{**SPEC.to_dict(), "style": "hnd"}))
    with pytest.raises(pdkv.InvalidArgument, match="differ in length"):
        a.write(peer, pdkv.Blocks("kv", [0, 1, 2]), pdkv.Blocks("kv", [3, 4]))  # NHD -> HND used to move 2 blocks of 3
    assert a.write(peer, pdkv.Blocks("kv", [0, 1, 2]), pdkv.Blocks("kv", [3, 4, 5])).wait(10)
    assert np.array_equal(pb.logical([3, 4, 5]), pa.logical([0, 1, 2]))


def test_hnd_tensor_described_without_order_cannot_move_part_of_the_data(pair):
    a, b = pair
    hnd = PoolSpec(blocks=8, block_tokens=8, heads=2, head_dim=8, style="hnd")
    src = Pool(hnd, 3)
    # The same HND tensors described with the default order="NHD": 2 "tokens" x 8 "heads".
    wrong = pdkv.KVLayout.from_tensors(src.k, src.v, dtype="float16")
    assert (wrong.geometry.block_tokens, wrong.geometry.kv_heads) == (2, 8)
    for arr in src.arrays:
        a.register(arr)
    a.add_layout("kv", wrong)
    dst = Pool(PoolSpec(blocks=8, block_tokens=8, heads=2, head_dim=8, style="nhd"))
    dst.register(b)
    peer = a.connect(b.address)
    with pytest.raises(pdkv.InvalidArgument, match="kv heads"):
        a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [0, 1]))
    assert not dst.logical(range(8)).any()


def test_a_transposed_view_contradicting_order_is_rejected():
    store = np.zeros((4, 2, 8, 16), np.float16)  # HND memory: [blocks, heads, tokens, dim]
    view = store.transpose(0, 2, 1, 3)  # shaped like NHD, strides of HND
    with pytest.raises(pdkv.InvalidArgument, match="order='HND'"):
        pdkv.KVLayout.from_tensors([view], [view])
    lay = pdkv.KVLayout.from_tensors([store], [store], order="HND")
    assert (lay.geometry.block_tokens, lay.geometry.kv_heads) == (8, 2)
    with pytest.raises(pdkv.InvalidArgument, match="order must be"):
        pdkv.KVLayout.from_tensors([store], [store], order="hnd")


@pytest.mark.parametrize("field, value", [("num_tokens", -1), ("num_tokens", 1.5), ("num_heads", "2"),
                                          ("local_head_offset", True), ("remote_head_offset", None)])
def test_plan_arguments_are_non_negative_integers(pair, field, value):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match=f"PlanOptions.{field}"):
        pdkv.PlanOptions(**{field: value})
    plan = pdkv.PlanOptions()
    with pytest.raises(pdkv.InvalidArgument, match=f"PlanOptions.{field}"):
        setattr(plan, field, value)
    assert plan == pdkv.PlanOptions()  # a refused value changes nothing
    # Only a PlanOptions is a plan: the keywords it replaced are gone, a dict is refused.
    with pytest.raises(pdkv.InvalidArgument, match="plan must be a pdkv.PlanOptions"):
        a.write("b", pdkv.Blocks("kv", [0]), plan={field: value})
    with pytest.raises(TypeError, match=field):
        a.write("b", pdkv.Blocks("kv", [0]), **{field: 0})
    lay = Pool(SPEC).layout
    with pytest.raises(pdkv.InvalidArgument, match="plan must be a pdkv.PlanOptions"):
        pdkv.plan_blocks(lay, [0], lay, [0], plan={field: value})


# ------------------------------------------------------------------ item 10: block ids
@pytest.mark.parametrize("ids", [[0.0, 1.0], [1, 2.5], np.array([0.0, 1.0]), [True], np.array([True, False]),
                                 [np.bool_(True)], [np.float32(1)], "01", b"\x00\x01", 5, None, [[0, 1]],
                                 np.zeros((1, 2), np.int64), [object()], ["1"]],
                         ids=lambda v: type(v).__name__ + ":" + repr(v)[:20])
def test_block_ids_must_be_integers(pair, ids):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match="Blocks.ids"):
        pdkv.Blocks("kv", ids)
    if ids is not None:  # (generations=None means "unchecked")
        with pytest.raises(pdkv.InvalidArgument, match="Blocks.generations"):
            pdkv.Blocks("kv", [0], generations=ids)
    # A transfer takes Blocks only: ids where the Blocks go are refused by name.
    with pytest.raises(pdkv.InvalidArgument, match="local must be a pdkv.Blocks"):
        a.write("b", ids, pdkv.Blocks("kv", [0, 1]))
    with pytest.raises(pdkv.InvalidArgument, match="remote must be a pdkv.Blocks"):
        a.read("b", pdkv.Blocks("kv", [0, 1]), ids if ids is not None else "kv")


@pytest.mark.parametrize("ids", [[-1], [2**32], [2**70], np.array([-3], np.int8), np.array([2**40], np.uint64),
                                 [16]])
def test_block_ids_out_of_range(pair, ids):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.OutOfRange):
        a.write("b", pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", ids))


@pytest.mark.parametrize("ids", [[3, 4], np.array([3, 4], np.int8), np.array([3, 4], np.uint16),
                                 np.array([3, 4], np.int32), np.array([3, 4], np.uint64), [np.int64(3), np.uint8(4)],
                                 range(3, 5), (i for i in (3, 4))],
                         ids=lambda v: type(v).__name__ + ":" + str(getattr(v, "dtype", "")))
def test_integer_block_ids_of_every_kind_are_accepted(pair, ids):
    a, b = pair
    pa, pb, peer = pools(a, b, SPEC, SPEC)
    assert a.write(peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", [10, 11])).wait(10)
    assert np.array_equal(pb.logical([10, 11]), pa.logical([3, 4]))


def test_destination_blocks_must_be_distinct_sources_may_repeat(pair):
    a, b = pair
    pa, pb, peer = pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match="remote block 5 appears twice"):
        a.write(peer, pdkv.Blocks("kv", [1, 2]), pdkv.Blocks("kv", [5, 5]))
    with pytest.raises(pdkv.InvalidArgument, match="local block 7 appears twice"):
        a.read(peer, pdkv.Blocks("kv", [7, 1, 7]), pdkv.Blocks("kv", [2, 3, 4]))
    assert not pb.logical(range(16)).any()
    # One source block copied to two destinations is fine.
    assert a.write(peer, pdkv.Blocks("kv", [1, 1]), pdkv.Blocks("kv", [5, 6])).wait(10)
    assert np.array_equal(pb.logical([5]), pa.logical([1])) and np.array_equal(pb.logical([6]), pa.logical([1]))


# ------------------------------------------------------------------ notify and timeouts
@pytest.mark.parametrize("notify", [123, 1.5, ["x"], object(), True])
def test_notify_must_be_bytes_or_str(pair, notify):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match="notify"):
        a.write("b", pdkv.Blocks("kv", [0]), notify=notify)
    with pytest.raises(pdkv.InvalidArgument, match="notify"):
        a.prepare("write", "b", pdkv.Blocks("kv", [0])).post(notify=notify)
    with pytest.raises(pdkv.InvalidArgument, match="data"):
        a.notify("b", notify)
    assert b.wait_notifications(0.2) == []  # nothing was sent (notify=123 used to send 123 zero bytes)


def test_notify_limit_and_accepted_types(pair):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match="limit"):
        a.write("b", pdkv.Blocks("kv", [0]), notify=b"x" * ((1 << 20) + 1))
    for v, want in [("héllo", "héllo".encode()), (bytearray(b"ba"), b"ba"), (memoryview(b"mv"), b"mv")]:
        assert a.write("b", pdkv.Blocks("kv", [0]), notify=v).wait(10)
        got = b.wait_notifications(10)
        assert [n.data for n in got] == [want]


@pytest.mark.parametrize("timeout", [-1, 0, math.nan, math.inf, -math.inf, "5", True, [1]])
def test_transfer_timeouts_must_be_finite_and_positive(pair, timeout):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        a.write("b", pdkv.Blocks("kv", [0]), timeout=timeout)
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        a.read("b", pdkv.Blocks("kv", [0]), timeout=timeout)
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        a.prepare("write", "b", pdkv.Blocks("kv", [0])).post(timeout=timeout)
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        a.notify("b", b"n", timeout=timeout)


@pytest.mark.parametrize("timeout", [-1, math.nan, math.inf, "1"])
def test_wait_timeouts_must_be_finite_and_not_negative(pair, timeout):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    x = a.write("b", pdkv.Blocks("kv", [0]))
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        x.wait(timeout)
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        b.wait_notifications(timeout)
    assert x.wait(10)
    assert x.wait(0)  # 0 polls


def test_agent_options_are_validated():
    with pytest.raises(pdkv.InvalidArgument, match="default_timeout"):
        pdkv.Agent("x", default_timeout=-1)
    with pytest.raises(pdkv.InvalidArgument, match="max_notif_bytes"):
        pdkv.Agent("x", max_notif_bytes=0)
    with pytest.raises(pdkv.InvalidArgument, match="listen"):
        pdkv.Agent("x", listen=5)


# ------------------------------------------------------------------ registration
class DlpackOnly:
    """A tensor-like object that exports only DLPack (as jax/cupy-on-host arrays do)."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


@pytest.mark.parametrize("obj", [[1, 2, 3], {"a": 1}, 12345, None, "text", 1.5],
                         ids=lambda v: type(v).__name__)
def test_registering_something_without_memory_is_invalid_argument(obj):
    with pdkv.Agent("a", secret=SECRET) as a:
        with pytest.raises(pdkv.InvalidArgument, match=type(obj).__name__):
            a.register(obj)


def test_registration_of_capsules_read_only_buffers_and_regions():
    with pdkv.Agent("a", secret=SECRET) as a:
        with pytest.raises(pdkv.InvalidArgument, match="DLPack capsule"):
            a.register(np.zeros(16).__dlpack__())
        with pytest.raises(pdkv.InvalidArgument, match="read-only"):
            a.register(b"immutable bytes")
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(pdkv.InvalidArgument, match="read-only"):
            a.register(ro)
        assert a.register(ro, remote_access=False).nbytes == 16  # a write source is fine
        shared = a.alloc(4096)
        with pytest.raises(pdkv.InvalidArgument, match="registered already"):
            a.register(shared)
        with pytest.raises(pdkv.InvalidArgument, match="remote_access"):
            a.register(np.zeros(8), remote_access="yes")
        with pytest.raises(pdkv.InvalidArgument, match="nbytes"):
            a.alloc(-5)
        with pytest.raises(pdkv.InvalidArgument, match="nbytes"):
            a.register_address(4096, "10")


def test_dlpack_exporters_register_their_memory():
    with pdkv.Agent("a", secret=SECRET) as a:
        arr = np.arange(64, dtype=np.float32)
        r = a.register(DlpackOnly(arr))
        assert (r.addr, r.nbytes) == (arr.ctypes.data, 256)
        torch = pytest.importorskip("torch")
        t = torch.zeros(32, dtype=torch.float16)
        r2 = a.register(DlpackOnly(t))
        assert (r2.addr, r2.nbytes) == (t.data_ptr(), 64)


# ------------------------------------------------------------------ metadata strings
def _patch(blob: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and blob.count(old) >= 1
    return blob.replace(old, new, 1)


@pytest.mark.parametrize("field", ["host id", "endpoint address", "layout name"])
def test_metadata_with_non_utf8_strings_is_rejected_at_add_peer(pair, field):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    md = b.metadata()
    info = pdkv.decode_metadata(md)
    if field == "host id":
        old = info["host_id"].encode()
    elif field == "endpoint address":
        old = info["endpoints"][0][1].encode()
    else:
        old = struct.pack("<I", 2) + b"kv"
    bad = _patch(md, old, old[:-2] + b"\xff\xfe")
    with pytest.raises(pdkv.ProtocolError, match=field):
        a.add_peer(bad)
    with pytest.raises(pdkv.ProtocolError, match=field):
        pdkv.decode_metadata(bad)
    # The peer is usable with its real metadata; peer_info decodes.
    assert a.add_peer(md) == "b"
    assert a.peer_info("b")["host_id"] == info["host_id"]


def test_every_error_is_a_pdkv_error(pair):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    for call in (lambda: a.write("b", pdkv.Blocks("kv", [0.5])), lambda: a.register([1]), lambda: a.write("b",
                                                                                             pdkv.Blocks("kv", [0]),
                                                                                             notify=1),
                 lambda: a.write("b", pdkv.Blocks("kv", [0]), timeout=-1), lambda: a.add_peer("not bytes"),
                 lambda: a.write("b", pdkv.Blocks(5, [0]))):
        with pytest.raises(pdkv.PdkvError):
            call()


@pytest.mark.parametrize("extents", [[(0, 0.5, 0, 0, 8)], [(0, 0, 0, 0, 8.0)], [(0, -8, 0, 0, 8)], [(0, 0, 0, 0)],
                                     [("0", 0, 0, 0, 8)], 7])
def test_raw_extents_must_be_non_negative_integers(pair, extents):
    a, b = pair
    pools(a, b, SPEC, SPEC)
    with pytest.raises(pdkv.InvalidArgument, match="extent"):
        a.prepare_extents("write", "b", extents)
