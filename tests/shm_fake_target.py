"""A fake shm target for tests/library/shm/test_shm_identity.py: a Unix socket that answers the
shm control protocol (docs/wire-shm.md) with whatever identity and region it is told
to claim, the way a hostile same-host process could.

    shm_fake_target.py --path P --instance I --name N --addr A --len L
                       [--claim-pid PID] [--handoff] [--uid UID]

It binds P, prints ``ready`` and serves one connection: Hello -> HelloAck(I, PID or
its own pid, N); every RegionReq -> RegionInfo(A, L, host, private). With
``--handoff`` it answers the hello, then forks a child that keeps the connection and
answers the rest, and exits itself, so the pid it gave (its own, which the kernel also
reports for the socket) belongs to a dead process and may be reused. With ``--uid`` it
listens as that uid (it binds first: the socket's directory is root's).
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import time

MAGIC = 0x534B4450
HELLO, HELLO_ACK, REGION_REQ, REGION_RESP, CHALLENGE, PROOF = 1, 2, 3, 4, 15, 16
SHM_VERSION = 6


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def frame(type_: int, ident: int, aux: bytes) -> bytes:
    return struct.pack("<IHHQII", MAGIC, type_, 0, ident, len(aux), 0) + aux


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--instance", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--addr", type=int, required=True)
    ap.add_argument("--len", type=int, required=True)
    ap.add_argument("--claim-pid", type=int, default=0)
    ap.add_argument("--handoff", action="store_true")
    ap.add_argument("--uid", type=int, default=-1)
    ap.add_argument("--secret", default="", help="the cluster secret: the fake proves it, as a member would")
    args = ap.parse_args()

    import pdkv  # loaded before --uid drops the rights to read the interpreter's files

    native = pdkv._native.module()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(args.path)
    if args.uid >= 0:
        os.setuid(args.uid)  # SO_PEERCRED reports the credentials of listen()'s caller
    srv.listen(4)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(60)
    try:
        hdr = recv_exact(conn, 24)
        magic, type_, _, _, aux_len, _ = struct.unpack("<IHHQII", hdr)
        assert magic == MAGIC and type_ == HELLO, (magic, type_)
        hello = recv_exact(conn, aux_len)
        # The challenge-response (pdkv/spi/auth.h), proving --secret: a member that lies
        # about its pid, not an outsider.
        n = struct.unpack_from("<I", hello, 10)[0]
        initiator = hello[14:14 + n].decode()
        m = 14 + n + 4 + struct.unpack_from("<I", hello, 14 + n)[0]
        hs = native.TargetHandshake("shm", SHM_VERSION, initiator, args.name, args.instance,
                                                   hello[m:m + 32], hello[m + 32:m + 64])
        name = args.name.encode()
        conn.sendall(frame(CHALLENGE, 0, struct.pack("<QI", args.instance, len(name)) + name + hs.nonce + hs.pub))
        hdr = recv_exact(conn, 24)
        magic, type_, _, _, aux_len, _ = struct.unpack("<IHHQII", hdr)
        assert type_ == PROOF, type_
        _, mac = hs.check(recv_exact(conn, aux_len), [args.secret.encode()])
        pid = args.claim_pid or os.getpid()
        conn.sendall(frame(HELLO_ACK, 0, struct.pack("<QI", args.instance, pid) + struct.pack("<I", len(name)) + name
                           + mac))
        if args.handoff:
            time.sleep(0.5)  # the dialer finishes its handshake while this pid is alive
            if os.fork() != 0:
                os._exit(0)  # the parent: the pid in the HelloAck dies; the child keeps the socket
        while True:
            hdr = recv_exact(conn, 24)
            magic, type_, _, ident, aux_len, _ = struct.unpack("<IHHQII", hdr)
            recv_exact(conn, aux_len)
            if type_ == REGION_REQ:
                info = struct.pack("<QQIIQQ", args.addr, args.len, 0, 0, 0, 0)
                conn.sendall(frame(REGION_RESP, ident, info))
    except (EOFError, OSError, socket.timeout):
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
