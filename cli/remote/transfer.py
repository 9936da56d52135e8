"""The commands that need this machine's files: `e create` uploads, `checkpoint download`
copies back, both over SFTP.

The upload cache on the login node is content-addressed per file: ~/.cache/detslurm/contexts/
objects/<sha256 of the file> holds each file once, trees/<sha256 of the whole context> is a
context materialized from them (copies, so the remote det packages exactly what it would have
packaged here), manifests/<same>.json lists it, configs/<sha256>.yaml the experiment configs.
Re-submitting unchanged code uploads nothing; a changed file uploads only itself.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import stat
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import click

from detslurm import context
from detslurm.cli.create_args import config_and_context
from detslurm.cli.remote.channel import collect
from detslurm.cli.remote.command import capture_argv, note, run_argv
from detslurm.cli.remote.target import RemoteError, RemoteSettings, Target
from detslurm.download_dir import LOCATE_COMMAND, fresh_download_dir
from detslurm.protocol.ckmark import MARKER_NAME, canonical_uuid
from detslurm.util import format_size

CACHE = ".cache/detslurm/contexts"


def _positionals(cmd: click.Command, args: Sequence[str]) -> tuple[list[int], list[str]]:
    """Indexes of the positional tokens of ``args`` (and the other tokens), using the command's
    own click declaration to know which options take a value: options added later still parse."""
    takes_value = {
        name
        for p in cmd.params
        if isinstance(p, click.Option) and not p.is_flag and not p.count
        for name in p.opts + p.secondary_opts
    }
    pos: list[int] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            pos += range(i + 1, len(args))
            break
        if a.startswith("-") and a != "-":
            i += 2 if a in takes_value else 1
            continue
        pos.append(i)
        i += 1
    return pos, [a for j, a in enumerate(args) if j not in pos and a != "--"]


def _is_config_opt(options: list[str], i: int) -> bool:
    """Whether ``options[i]`` is ``--config-file`` (or its ``=`` form) or that option's value."""
    here = options[i] == "--config-file" or options[i].startswith("--config-file=")
    return here or (i > 0 and options[i - 1] == "--config-file")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _mkdirs(sftp: Any, base: str) -> None:
    path = ""
    for part in base.strip("/").split("/"):
        path += "/" + part
        try:
            sftp.stat(path)
        except FileNotFoundError:
            sftp.mkdir(path, 0o700)


def _put(sftp: Any, local: Path, remote: str) -> None:
    """Upload to a temporary name, then rename: a crash never leaves a half object in the cache."""
    tmp = f"{remote}.part"
    sftp.put(str(local), tmp)
    sftp.posix_rename(tmp, remote)


def _good_objects(conn: Any, objects: str, digests: set[str]) -> set[str]:
    """Which of these objects the login node holds with the content their name says: each is
    hashed there, so an object another process of the user edited is uploaded again, never used."""
    chan = conn.open_exec(f"cd {shlex.quote(objects)} && xargs -r sha256sum --")
    chan.sendall("".join(f"{d}\n" for d in sorted(digests)).encode())
    chan.shutdown_write()
    # Missing or unreadable objects make sha256sum complain and exit non-zero: they are simply
    # not in the answer. Names are hex digests, so each output line is "<hash>  <name>".
    _, out, _ = collect(chan)
    lines = (line.split() for line in out.splitlines())
    return {f[1] for f in lines if len(f) == 2 and f[1] in digests and f[0] == f[1]}


def upload_context(conn: Any, bundle: context.ContextBundle) -> tuple[str, int, int]:
    """Make sure the login node has this context; returns (remote dir, files uploaded, files)."""
    sftp = conn.sftp()
    try:
        base = f"{sftp.normalize('.')}/{CACHE}"
        for sub in ("objects", "trees", "manifests"):
            _mkdirs(sftp, f"{base}/{sub}")
        tree = f"{base}/trees/{bundle.sha256}"
        files = [(e, _sha256(bundle.root / e.rel)) for e in bundle.entries if e.kind == "file"]
        # One round trip answers "which files are already there, intact" for the whole context:
        # no per-file request over a high-latency link.
        present = _good_objects(conn, f"{base}/objects", {d for _, d in files})
        uploaded = 0
        for e, digest in files:
            if digest not in present:
                _put(sftp, bundle.root / e.rel, f"{base}/objects/{digest}")
                present.add(digest)
                uploaded += 1
        manifest = [{"path": e.rel, "kind": e.kind, "mode": e.mode, "target": e.target} for e in bundle.entries]
        with sftp.open(f"{base}/manifests/{bundle.sha256}.json", "w") as f:
            f.write(json.dumps({"sha256": bundle.sha256, "entries": manifest}))
    finally:
        sftp.close()
    _materialize(conn, base, tree, bundle, dict((e.rel, d) for e, d in files))
    return tree, uploaded, len(files)


def _tree_checks(base: str, bundle: context.ContextBundle, digests: dict[str, str]) -> list[str]:
    """Shell lines that return 1 unless the current dir is exactly this context: the same
    entries (no more), each of its kind and mode, links to their targets, files equal to their
    (just verified) objects."""
    q = shlex.quote
    lines = [f'[ "$(find . -mindepth 1 -printf x | wc -c)" -eq {len(bundle.entries)} ] || return 1']
    for e in bundle.entries:
        rel = q("./" + e.rel)
        mode = f'[ "$(stat -c %a -- {rel})" = {e.mode:o} ]'
        if e.kind == "dir":
            lines.append(f"[ -d {rel} ] && [ ! -L {rel} ] && {mode} || return 1")
        elif e.kind == "link":
            lines.append(f'[ -L {rel} ] && [ "$(readlink -- {rel})" = {q(e.target or "")} ] || return 1')
        else:
            obj = q(f"{base}/objects/{digests[e.rel]}")
            lines.append(f"[ -f {rel} ] && [ ! -L {rel} ] && {mode} && cmp -s -- {obj} {rel} || return 1")
    return lines


def _materialize(conn: Any, base: str, tree: str, bundle: context.ContextBundle, digests: dict[str, str]) -> None:
    """Build trees/<sha> from the objects with one shell script on the login node (sent on
    stdin: a large context would not fit in one exec request). A tree already there is reused
    only when it still matches the context entry by entry; otherwise it is built again."""
    q = shlex.quote
    # A tree is only ever renamed into place whole, but another process of the user may have
    # edited it since: it is checked every time, never trusted by its name or its .done mark.
    lines = ["set -e", "umask 077", "intact() {", f"  [ -d {q(tree)} ] && [ ! -L {q(tree)} ] || return 1"]
    lines += [f"  cd {q(tree)} || return 1", *("  " + c for c in _tree_checks(base, bundle, digests)), "}"]
    lines += [f"if (intact); then : > {q(tree)}.done; exit 0; fi", f"rm -rf -- {q(tree)} {q(tree)}.done"]
    lines += [f"t={q(tree)}.tmp.$$", 'rm -rf "$t"', 'mkdir -p "$t"', 'cd "$t"']
    # Names are the user's files' (a file may be called --help): each is ./-prefixed after a --,
    # never read as an option. One command a line: set -e stops at any failed one (in an
    # `a && b` list it would not stop for a), so a missing object fails the upload.
    for e in bundle.entries:
        rel = q("./" + e.rel)
        if e.kind == "dir":
            lines += [f"mkdir -p -- {rel}", f"chmod -- {e.mode:o} {rel}"]
        elif e.kind == "link":
            lines.append(f"ln -s -- {q(e.target)} {rel}")
        else:
            lines += [f"cp -- {q(base + '/objects/' + digests[e.rel])} {rel}", f"chmod -- {e.mode:o} {rel}"]
    # Two creates of the same context at once: the second mv fails and its copy is dropped.
    lines += ["cd /", f'mv -T "$t" {q(tree)} 2>/dev/null || rm -rf "$t"', f": > {q(tree)}.done"]
    chan = conn.open_exec("sh -s")
    chan.sendall(("\n".join(lines) + "\n").encode())
    chan.shutdown_write()
    code, _, err = collect(chan)
    if code != 0:
        raise RemoteError(f"{conn.login}: could not unpack the uploaded context in {tree}: {err.strip()}")


def upload_config(conn: Any, config: Path) -> str:
    """Put the config file in the login node's upload cache; its path there."""
    try:
        data = config.read_bytes()
    except OSError as e:
        raise RemoteError(f"config file {config}: {e.strerror}") from None
    sftp = conn.sftp()
    try:
        d = f"{sftp.normalize('.')}/{CACHE}/configs"
        _mkdirs(sftp, d)
        remote = f"{d}/{hashlib.sha256(data).hexdigest()}-{config.name}"
        with sftp.open(remote + ".part", "wb") as f:
            f.write(data)
        sftp.posix_rename(remote + ".part", remote)
        return remote
    finally:
        sftp.close()


def create(conn: Any, target: Target, rs: RemoteSettings, args: list[str], create_cmd: click.Command) -> int:
    """`det e create CONFIG CONTEXT` remotely: upload what changed, then create there.
    ``create_cmd`` is the local `det e create`, whose declaration parses ``args``. The Python
    SDK's ``create_experiment`` over ssh:// uploads through the same two functions."""
    with create_cmd.make_context("create", args[2:]) as ctx:  # click's own usage errors, as locally
        p = ctx.params
        config, ctx_dir = config_and_context(p["config_file"], p["context_dir"], p["config_opt"], p["template"])
    _, options = _positionals(create_cmd, args[2:])
    # The config goes as the uploaded file's positional argument, not as --config-file.
    options = [o for i, o in enumerate(options) if not _is_config_opt(options, i)]
    bundle = context.package(ctx_dir)
    tree, uploaded, total = upload_context(conn, bundle)
    note(
        f"Uploaded {uploaded} of {total} context files to {conn.login}:{tree} "
        f"({total - uploaded} already there, {format_size(bundle.total_bytes)} in all)"
    )
    remote_config = upload_config(conn, config)
    return run_argv(conn, target, rs, [*args[:2], remote_config, tree, *options])


def download_checkpoint(
    conn: Any, target: Target, rs: RemoteSettings, args: list[str], download_cmd: click.Command
) -> int:
    """`det checkpoint download UUID [-o DIR] [-q]`: ask the login node which directory holds the
    checkpoint (checked there as a local download checks it), check it again here, then copy its
    files into a fresh directory with a progress line. ``download_cmd`` is the local
    `det checkpoint download`, whose declaration parses ``args``."""
    with download_cmd.make_context("download", args[2:]) as ctx:
        uuid, out_dir, quiet = ctx.params["uuid"], ctx.params["output_dir"], ctx.params["quiet"]
    code, out, err = capture_argv(conn, target, rs, ["checkpoint", LOCATE_COMMAND, uuid])
    if code != 0:
        click.echo(err, nl=False, err=True)
        return code
    dst, src, files, total = fetch_checkpoint(conn, out, Path(out_dir) if out_dir is not None else None)
    note(f"Downloaded {len(files)} files ({format_size(total)}) from {conn.login}:{src}")
    click.echo(str(dst) if quiet else f"Local checkpoint path:\n{dst}")
    return 0


def fetch_checkpoint(
    conn: Any, answer: str, out_dir: Path | None
) -> tuple[Path, str, list[tuple[str, Path, int]], int]:
    """Copy the checkpoint that the login node's answer to `det checkpoint locate-for-download`
    names (checked again here) into ``out_dir`` (default checkpoints/<uuid>), a fresh
    directory: (that directory, the remote one, the files copied, their bytes). `det checkpoint
    download` and the Python SDK's ``Checkpoint.download`` over ssh:// both copy through here."""
    src = _checked_source(conn, answer)
    uuid = PurePosixPath(src).name
    dst = out_dir if out_dir is not None else Path("checkpoints") / uuid
    sftp = conn.sftp()
    try:
        # lstat: a link in the checkpoint's place is not the checkpoint, whatever it points to.
        if not stat.S_ISDIR(sftp.lstat(src).st_mode or 0):
            raise RemoteError(f"{conn.login}:{src} is not a directory; refusing to download it")
        files = _walk(sftp, src, Path(), 0)
        total = sum(size for _, _, size in files)
        _check_room(dst, total)
        with fresh_download_dir(dst) as tmp:
            _copy(sftp, [(r, tmp / rel, size) for r, rel, size in files], uuid)
    except FileNotFoundError:
        raise RemoteError(f"checkpoint files for {uuid} not found on {conn.login} ({src})") from None
    finally:
        sftp.close()
    return dst, src, files, total


def fetch_file(conn: Any, remote: str, dest: Path) -> int:
    """Copy the login node's regular file ``remote`` to ``dest``, replacing it (through a
    temporary name beside it); its bytes. A link or anything else in its place is refused: the
    Python SDK's ``Experiment.download_code`` over ssh:// copies the code snapshot through here."""
    if not PurePosixPath(remote).is_absolute():
        raise RemoteError(f"{conn.login}: {remote!r} is not an absolute path; refusing to download it")
    tmp = dest.with_name(f".{dest.name}.tmp")
    sftp = conn.sftp()
    try:
        attrs = sftp.lstat(remote)
        if not stat.S_ISREG(attrs.st_mode or 0):
            raise RemoteError(f"{conn.login}:{remote} is not a regular file; refusing to download it")
        size = int(attrs.st_size or 0)
        _check_room(dest, size)
        tmp.unlink(missing_ok=True)
        _get(sftp, remote, tmp, size)
        tmp.replace(dest)
    except FileNotFoundError:
        raise RemoteError(f"{remote} not found on {conn.login}") from None
    finally:
        tmp.unlink(missing_ok=True)
        sftp.close()
    return size


def _checked_source(conn: Any, answer: str) -> str:
    """The directory in the login node's answer, if it is ``<absolute base>/<canonical uuid>``:
    the uuid becomes a directory name here, and a path that is not a checkpoint's is refused."""
    try:
        info = json.loads(answer)
        uuid, src = str(info["uuid"]), str(info["directory"])
    except (ValueError, KeyError, TypeError):
        raise RemoteError(
            f"{conn.login}: unexpected answer to `det checkpoint {LOCATE_COMMAND}`: {answer[:200]!r}"
        ) from None
    path = PurePosixPath(src)
    if not canonical_uuid(uuid) or path.name != uuid or not path.is_absolute() or ".." in path.parts:
        raise RemoteError(
            f"{conn.login}: checkpoint {uuid!r} at {src!r} is not <storage base>/<uuid> with a uuid as the "
            "Core API makes them; refusing to download it"
        )
    return src


# Bounds on what a trial's tree may make this machine walk and write.
MAX_DEPTH = 64
MAX_FILES = 1_000_000


def _check_room(dst: Path, total: int) -> None:
    """Refuse a download bigger than the free space where it goes."""
    where = next(p for p in (dst.absolute(), *dst.absolute().parents) if p.exists())
    free = shutil.disk_usage(where).free
    if total > free:
        raise RemoteError(
            f"the checkpoint holds {total / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free at {where}"
        )


def _copy(sftp: Any, files: list[tuple[str, Path, int]], label: str) -> None:
    total = sum(s for _, _, s in files)
    done = 0
    # The progress line is ours (counts and a checked uuid) and redraws itself with \r, a control
    # character the terminal guard (detslurm/terminal.py) would blank: it goes to the terminal itself.
    progress = sys.__stderr__ if sys.stderr.isatty() else None
    for n, (remote, local, size) in enumerate(files, 1):
        local.parent.mkdir(parents=True, exist_ok=True)
        _get(sftp, remote, local, size)
        done += size
        if progress is not None:
            # Padded: a redraw shorter than the last ("1.0 MiB" after "1023.9 KiB") would leave
            # the old line's end on screen.
            click.echo(
                f"\rDownloading {label}: {n}/{len(files)} files, {format_size(done):>10} of {format_size(total)}",
                nl=False,
                file=progress,
            )
    if progress is not None:
        click.echo("\r", nl=False, file=progress)


def _get(sftp: Any, remote: str, local: Path, size: int) -> None:
    """Copy at most ``size`` bytes (the listed size): a file that grew since the listing is refused,
    so the total checked against the free space holds."""
    with sftp.open(remote, "rb") as f, open(local, "xb") as out:
        f.prefetch(size)
        left = size
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
        if f.read(1):
            raise RemoteError(f"{remote} grew while it was downloaded; refusing it")


def _walk(sftp: Any, remote: str, rel: Path, depth: int) -> list[tuple[str, Path, int]]:
    """(remote file, path relative to the top, size) for every regular file under ``remote``.
    Names come from the cluster (written by the trial: untrusted), so only plain names are
    followed, never a link, and depth and file count are bounded."""
    if depth > MAX_DEPTH:
        raise RemoteError(f"{remote} is nested deeper than {MAX_DEPTH} levels; refusing to download it")
    out: list[tuple[str, Path, int]] = []
    for a in sftp.listdir_attr(remote):
        name = a.filename
        if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            continue
        if depth == 0 and name == MARKER_NAME:  # the run's delete mark, not a checkpoint file
            continue
        mode = a.st_mode or 0
        # lstat-style attributes: a symlink a trial planted (to ~/.ssh, say) is neither a dir
        # nor a regular file here, so it is never followed or copied.
        if stat.S_ISDIR(mode):
            out += _walk(sftp, f"{remote}/{name}", rel / name, depth + 1)
        elif stat.S_ISREG(mode):
            out.append((f"{remote}/{name}", rel / name, int(a.st_size or 0)))
        if len(out) > MAX_FILES:
            raise RemoteError(f"{remote} holds more than {MAX_FILES} files; refusing to download it")
    return out
