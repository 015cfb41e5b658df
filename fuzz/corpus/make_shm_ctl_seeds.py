"""Writes the seed corpora for fuzz/targets/shm_ctl_fuzz.cc and cuda_ipc_ctl_fuzz.cc.

Each seed: one byte choosing the reading side, then frames (docs/wire.md).
Run from the repository root: python fuzz/corpus/make_shm_ctl_seeds.py
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def s(x: bytes) -> bytes:
    return struct.pack("<I", len(x)) + x


def frame(magic: int, type_: int, aux: bytes = b"", ident: int = 0, status: int = 0) -> bytes:
    return struct.pack("<IHHQII", magic, type_, 0, ident, len(aux), status) + aux


def write(dirname: str, seeds: dict) -> None:
    d = os.path.join(HERE, dirname)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


SHM = 0x534B4450
NONCE, PUB, MAC = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32
# Handshake (v6): hello {nonce, key}, then the proof (one MAC); no secret anywhere.
hello = frame(SHM, 1, struct.pack("<HQ", 6, 7) + s(b"alice") + s(b"bob") + NONCE + PUB) + frame(SHM, 16, MAC)
challenge = frame(SHM, 15, struct.pack("<Q", 7) + s(b"bob") + NONCE + PUB)
info = struct.pack("<QQIIQQ", 0x7F0000001000, 65536, 0, 1, 4096, 57344)  # shared window: whole pages
# LeaseReq: u32 hold_ms, then the claim (u32 name length, name, u32 count, count x (u32 block, u32 gen)).
lease = struct.pack("<I", 5000) + s(b"kv") + struct.pack("<I", 2) + struct.pack("<IIII", 3, 1, 7, 2)
write("shm_ctl", {
    "target_hello_then_requests": b"\x00" + hello + frame(SHM, 3, ident=5) + frame(SHM, 5, b"req-1", 1)
    + frame(SHM, 8, ident=5),
    "target_prehello_oversized": b"\x00" + frame(SHM, 1)[:16] + struct.pack("<II", 2 << 20, 0),
    "target_prehello_notify": b"\x00" + frame(SHM, 5, b"x"),
    "target_lease_req_end": b"\x00" + hello + frame(SHM, 10, lease, 1) + frame(SHM, 12, ident=1),
    "target_lease_req_huge_count": b"\x00" + hello + frame(SHM, 10, lease[:10] + struct.pack("<I", 1 << 30), 2),
    "initiator_lease_resp": b"\x03" + frame(SHM, 11, ident=1) + frame(SHM, 11, b"stale block 3", 2, 15),
    "initiator_hello_ack": b"\x02" + challenge + frame(SHM, 2, struct.pack("<QI", 7, 1234) + s(b"bob") + MAC),
    "target_proof_before_hello": b"\x00" + frame(SHM, 16, MAC),
    "target_proof_wrong_size": b"\x04" + frame(SHM, 16, MAC + b"x"),
    "initiator_region_resp_ok": b"\x03" + frame(SHM, 4, info, 5) + frame(SHM, 7, ident=5) + frame(SHM, 6, ident=1),
    "initiator_region_resp_err": b"\x03" + frame(SHM, 4, b"no region 5", 5, 2) + frame(SHM, 9, b"bye", 0, 9),
    "initiator_hello_error": b"\x02" + frame(SHM, 9, b"wrong secret", 0, 5),
})

CUDA = 0x434B4450
chello = frame(CUDA, 1, struct.pack("<HQ", 2, 7) + s(b"imp") + NONCE + PUB) + frame(CUDA, 7, MAC)
write("cuda_ipc_ctl", {
    "exporter_hello_then_ack": b"\x00" + chello + frame(CUDA, 4, ident=3),
    "exporter_prehello_revoke": b"\x00" + frame(CUDA, 3, ident=3),
    "importer_hello_ack": b"\x02" + frame(CUDA, 6, struct.pack("<Q", 7) + s(b"exp") + NONCE + PUB) + frame(CUDA, 2, MAC),
    "importer_revoke_error": b"\x03" + frame(CUDA, 3, ident=3) + frame(CUDA, 5, b"closing", 0, 9),
    "exporter_oversized": b"\x00" + frame(CUDA, 1)[:16] + struct.pack("<II", 5000, 0),
})
