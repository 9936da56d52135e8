"""Host-key checking against known_hosts files as OpenSSH writes them: every matching line
counts (round-robin login nodes, key rotations), @revoked refuses, @cert-authority is a clear
refusal (host certificates are not checked), hashed names and wildcards match; and the same
against a real sshd on loopback."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import paramiko
import pytest

from detslurm.cli.remote import sshconf
from detslurm.cli.remote.target import RemoteError

NAME = "[login.hpc.example.org]:2201"


def _key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


def _line(hosts: str, key: paramiko.PKey, marker: str = "") -> str:
    return f"{marker} {hosts} {key.get_name()} {key.get_base64()}".strip() + "\n"


def _hop(tmp_path: Path, *files_text: str) -> sshconf.Hop:
    files = []
    for i, text in enumerate(files_text):
        (tmp_path / f"kh{i}").write_text(text)
        files.append(tmp_path / f"kh{i}")
    return sshconf.Hop("hpc", "login.hpc.example.org", 2201, "u", (), False, tuple(files), None, None)


def _refusal(hop: sshconf.Hop, offered: paramiko.PKey) -> str:
    with pytest.raises(RemoteError) as e:
        sshconf.check_host_key(hop, offered)
    return str(e.value)


def test_every_key_of_a_type_is_compared_across_lines_and_files(tmp_path: Path) -> None:
    # Round-robin login nodes behind one name, and a rotation with the new key in the global file.
    a, b, c = _key(), _key(), _key()
    hop = _hop(tmp_path, _line(NAME, a) + _line(NAME, b), _line(NAME, c))
    for k in (a, b, c):
        sshconf.check_host_key(hop, k)
    impostor = _key()
    msg = _refusal(hop, impostor)
    assert "HOST KEY CHANGED" in msg and all(sshconf.fingerprint(k) in msg for k in (a, b, c, impostor))


def test_hashed_wildcard_and_negated_names(tmp_path: Path) -> None:
    a, b = _key(), _key()
    hashed = paramiko.HostKeys.hash_host(NAME)
    sshconf.check_host_key(_hop(tmp_path, _line(hashed, a)), a)
    sshconf.check_host_key(_hop(tmp_path, _line("other,[*.hpc.example.org]:2201", b)), b)
    # A negation vetoes the line even when another pattern matches.
    assert "unknown host key" in _refusal(_hop(tmp_path, _line(f"[*.example.org]:2201,!{NAME}", b)), b)
    assert "unknown host key" in _refusal(_hop(tmp_path, _line("[login.hpc.example.org]:22", b)), b)


def test_revoked_key_is_refused_even_when_also_listed(tmp_path: Path) -> None:
    a, b = _key(), _key()
    hop = _hop(tmp_path, _line(NAME, a) + _line(NAME, b), _line("*", a, "@revoked"))
    msg = _refusal(hop, a)
    assert "REVOKED host key" in msg and sshconf.fingerprint(a) in msg
    sshconf.check_host_key(hop, b)  # the other key still works


def test_cert_authority_lines_do_not_break_checking(tmp_path: Path) -> None:
    a, ca = _key(), _key()
    # A CA line elsewhere in the file (paramiko's own loader raised InvalidHostKey on it).
    sshconf.check_host_key(_hop(tmp_path, _line("[*.example.org]:*", ca, "@cert-authority") + _line(NAME, a)), a)
    # Vouched for only by a CA: refused with a message that says why.
    msg = _refusal(_hop(tmp_path, _line("[*.example.org]:*", ca, "@cert-authority")), a)
    assert "@cert-authority" in msg and "does not check host certificates" in msg and a.get_base64() in msg
    # Comments, unknown markers and garbage are skipped like OpenSSH does, not fatal.
    junk = "# comment\n@bogus * x y\nnot-a-line\n" + f"{NAME} ssh-ed25519 !!!notbase64\n"
    sshconf.check_host_key(_hop(tmp_path, junk + _line(NAME, a)), a)
    assert sshconf.preferred_key_types(_hop(tmp_path, junk + _line(NAME, a)), ("ssh-ed25519", a.get_name()))[0] == (
        a.get_name()
    )


def test_real_sshd_accepts_any_of_its_listed_keys_and_refuses_revoked(tmp_path: Path) -> None:
    import sshd_harness as sh

    from detslurm.cli.remote.connect import open_hop

    if os.geteuid() != 0:
        pytest.skip("starts sshd as root")
    try:
        sh.ensure_openssh()
        user = sh.ensure_user()
    except sh.Unavailable as e:
        pytest.skip(str(e))
    key = sh.keygen(tmp_path / "laptop_key")
    # sshd reads the file as the user: in the user's own ~/.ssh, under a name of this test's.
    auth = Path(user.pw_dir) / ".ssh/authorized_keys_known_hosts_test"
    auth.parent.mkdir(mode=0o700, exist_ok=True)
    auth.write_text(Path(f"{key}.pub").read_text())
    for p in (auth.parent, auth):
        os.chown(p, user.pw_uid, user.pw_gid)
    server = sh.start_sshd(tmp_path / "login", auth)
    try:
        real = server.known_hosts_line()
        name = real.split()[0]
        other, ca = _key(), _key()
        ok = _line(name, other) + _line("*", ca, "@cert-authority") + real  # the real key is not the first
        hop = sshconf.Hop("direct", "127.0.0.1", server.port, sh.USER, (key,), True, (tmp_path / "kh",), None, None)
        (tmp_path / "kh").write_text(ok)
        t = open_hop(socket.create_connection(("127.0.0.1", server.port)), hop, lambda _t, _e: "")
        assert t.is_authenticated()
        t.close()
        (tmp_path / "kh").write_text(ok + "@revoked * " + " ".join(real.split()[1:]) + "\n")
        with pytest.raises(RemoteError, match="REVOKED host key"):
            open_hop(socket.create_connection(("127.0.0.1", server.port)), hop, lambda _t, _e: "")
        assert "Accepted publickey" not in server.log.split("Accepted publickey", 1)[-1]
    finally:
        server.stop()
