#!/usr/bin/env python3
"""Writes the committed seed inputs under fuzz/seeds/TARGET/ (run from anywhere).

Seeds are small, hand-made starting points for libFuzzer: valid wire frames
and handshakes (so mutation starts deep inside the decoders) and short,
meaningful op scripts for the two state-machine bodies. The byte layouts
follow the module docs of src/transport/frame.rs and handshake.rs and the
`Unstructured` decoding in the fuzz bodies; a seed that drifts out of date is
still a valid input, only a less useful one. Deterministic: rerunning it
rewrites the same files.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


# --- tcp_frame: src/transport/frame.rs module doc (little-endian) ---------
MAGIC = struct.pack("<I", 0x5246564B)  # b"KVFR"


def req_header(kind, req_id):
    return MAGIC + bytes([1, kind]) + struct.pack("<HQ", 0, req_id)


def read_req(req_id, session, region, offset, length):
    s = session.encode()
    return req_header(1, req_id) + struct.pack("<H", len(s)) + s + struct.pack("<IQQ", region, offset, length)


def resp(status, req_id, payload):
    return MAGIC + bytes([1, status]) + struct.pack("<HQQ", 0, req_id, len(payload)) + payload


write("tcp_frame", "ping", req_header(2, 7))
write("tcp_frame", "read", read_req(1, "sess-01.A_z", 0, 4096, 65536))
write("tcp_frame", "read_then_ping", read_req(2, "s", 3, 0, 1) + req_header(2, 3))
write("tcp_frame", "resp_ok", resp(0, 1, b"\x00\x01\x02\x03"))
write("tcp_frame", "resp_error", resp(2, 9, b"range not locked"))

# --- handshake: src/transport/handshake.rs module doc ---------------------


def hs(transport, node, data_addr, regions, verbs=None, same_host=None):
    out = b"KVHS" + bytes([2, transport])
    for s in (node, data_addr):
        b = s.encode()
        out += struct.pack("<H", len(b)) + b
    out += struct.pack("<H", len(regions))
    for rid, base, ln, rkey in regions:
        out += struct.pack("<IQQI", rid, base, ln, rkey)
    if verbs is None:
        out += b"\x00"
    else:
        link, lid, gid, qpns, psn, mtu = verbs
        out += bytes([1, link]) + struct.pack("<H", lid) + gid + bytes([len(qpns)])
        out += b"".join(struct.pack("<I", q) for q in qpns) + struct.pack("<II", psn, mtu)
    if same_host is None:
        out += b"\x00"
    else:
        host_id, socket, region, token = same_host
        out += b"\x01"
        for s in (host_id, socket):
            b = s.encode()
            out += struct.pack("<H", len(b)) + b
        out += struct.pack("<I", region) + token
    return out


write("handshake", "tcp", hs(1, "10.0.0.1:5000", "10.0.0.1:5001", [(0, 0, 1 << 30, 0)]))
write(
    "handshake",
    "tcp_same_host",
    hs(1, "10.0.0.1:5000", "10.0.0.1:5001", [(0, 0, 1 << 30, 0)], None,
       ("04968113-364b-49b4-89cd-fbde5136432d/net:[4026531833]", "kvferry-shm-" + "ab" * 16, 0, bytes(range(16)))),
)
write("handshake", "sim_no_addr", hs(3, "node-a:1", "", [(0, 0, 4096, 0), (1, 8192, 4096, 0)]))
write(
    "handshake",
    "verbs_ib",
    hs(2, "gpu7.example:7000", "", [(5, 0x7F0000000000, 1 << 34, 0x1234)],
       (1, 3, bytes(range(16)), [0x11, 0x22], 0xABCDE, 4096)),
)
write(
    "handshake",
    "verbs_roce",
    hs(2, "[fe80::1]:7000", "", [(1, 4096, 4096, 7)], (2, 0, b"\xfe\x80" + bytes(14), [1], 0, 1024)),
)

# --- registration_queue: fuzz_registration_queue in src/client/queue.rs ----
# Prefix: depth_max byte (1 + b % 8), chunk_hashes_max byte (1 + b % 4). Then
# ops: 0/1 offer(ns, hash, remove?), 2 flush, 3 take_batch, 4 deliver(i),
# 5 fail-or-split(i, split?), 6 close(p == 0).
OFFER, FLUSH, TAKE, DELIVER, FAIL, CLOSE = 0, 2, 3, 4, 5, 6
write("registration_queue", "net_and_deliver", [
    3, 1,
    OFFER, 0, 1, 0, OFFER, 0, 1, 1, OFFER, 1, 2, 0, OFFER, 0, 3, 0,
    FLUSH, TAKE, DELIVER, 0, DELIVER, 0, DELIVER, 0, FLUSH,
])
write("registration_queue", "full_fail_split", [
    1, 3,
    OFFER, 0, 1, 0, OFFER, 0, 2, 0, OFFER, 0, 3, 0, OFFER, 0, 4, 1,
    FLUSH, TAKE, FAIL, 0, 1, DELIVER, 0, FAIL, 0, 0, DELIVER, 0, FLUSH,
])
write("registration_queue", "close_mid_batch", [
    7, 0,
    OFFER, 0, 5, 0, TAKE, OFFER, 1, 5, 1, FLUSH, CLOSE, 0, OFFER, 0, 1, 0, FLUSH,
])

# --- metaserver_store: fuzz_store / model::decode_op in src/metaserver/store.rs
# Prefix: stale_after_ms byte, ttl_ms two bytes. Then ops by kind % 24:
# 0 heartbeat(node, sess), 4 takeover(node, s), 5 insert(ns, hashes, node,
# sess), 11 remove(...), 13 unregister(node, sess), 14 sweep, 15 advance(ms),
# 17 jump(ms), 18 query(ns, hashes), 22 owners(ns, hash). sess: byte < 192 =
# current session. hashes: even b = run(start b>>1, len), odd b = list.
HB, TAKEOVER, INS, REM, UNREG, SWEEP, ADV, JUMP, QUERY, OWNERS = 0, 4, 5, 11, 13, 14, 15, 17, 18, 22
write("metaserver_store", "prefix_two_owners", [
    80, 0x2C, 0x01,
    HB, 0, 0, HB, 1, 0,
    INS, 0, 0, 4, 0, 0,       # node 0 owns hashes 0..4
    INS, 0, 0, 2, 1, 0,       # node 1 owns hashes 0..2
    QUERY, 0, 0, 6,
    INS, 0, 5, 1, 2, 1, 0,    # node 1: list (odd b, 5 >> 1 = 2 hashes) [1, 2]
    QUERY, 0, 0, 6, OWNERS, 0, 1,
])
write("metaserver_store", "stale_takeover_sweep", [
    30, 0x64, 0x00,
    HB, 0, 0, INS, 1, 2, 5, 0, 0,
    ADV, 200, QUERY, 1, 2, 5,
    TAKEOVER, 0, 1, QUERY, 1, 2, 5,
    INS, 1, 2, 3, 0, 200,     # node 0, session index 2: likely fenced
    JUMP, 255, SWEEP, QUERY, 1, 2, 5,
])
write("metaserver_store", "remove_unregister", [
    100, 0x00, 0x02,
    HB, 2, 0, HB, 3, 0, INS, 0, 0, 8, 2, 0, INS, 0, 0, 8, 3, 0,
    REM, 0, 5, 1, 3, 2, 0,
    QUERY, 0, 0, 8, UNREG, 3, 0, QUERY, 0, 0, 8, OWNERS, 0, 0,
])


# --- disk_record: src/disk/format.rs module doc (little-endian) -----------
def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def disk_record(ns, h, family, generation, slots):
    payload = b"".join(slots)
    n = len(slots)
    hlen = 48 + len(ns) + len(h) + 8 * n + 4
    head = b"KFSD" + struct.pack("<HHIIQQQHHI", 1, 0, hlen, n, generation, family, len(payload), len(ns), len(h), 0)
    head += ns + h + b"".join(struct.pack("<II", len(s), crc32c(s)) for s in slots)
    head += struct.pack("<I", crc32c(head))
    area = (len(head) + 4095) // 4096 * 4096
    body = head + bytes(area - len(head)) + payload
    return body + bytes((len(body) + 4095) // 4096 * 4096 - len(body))


rec = disk_record(b"qwen3-8b", bytes(range(32)), 0xFEED, 7, [bytes([i]) * 300 for i in range(3)])
write("disk_record", "valid_three_slots", rec)
write("disk_record", "header_only", rec[:4096])
write("disk_record", "torn_payload", rec[:4096 + 450] + bytes(len(rec) - 4096 - 450))
