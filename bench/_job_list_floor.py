"""The floor of ``det job list`` for any Python command (run by bench/cli_latency.py): the least
such a command must do, and nothing else. It starts squeue with the daemon's format, imports
sqlite3 and opens the store while squeue runs, reads the experiments' names for our jobs, and
prints one line per job in queue order. No detslurm module, click, subprocess or dataclass.

    python _job_list_floor.py SQUEUE_FORMAT STORE_DB
"""

import os
import sys

SEP, REC_END = "\x1f", "\x1e"


def main() -> int:
    fmt, db = sys.argv[1], sys.argv[2]
    r, w = os.pipe()
    argv = ["squeue", "-h", "-r", "--states=all", "-O", fmt]
    actions = [(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)]
    pid = os.posix_spawnp("squeue", argv, os.environ, file_actions=actions)
    os.close(w)
    import sqlite3  # while squeue runs

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    chunks = []
    while chunk := os.read(r, 1 << 20):
        chunks.append(chunk)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        return 1  # squeue failed: no floor was measured (the bench's check=True says so)
    jobs = [f for rec in b"".join(chunks).decode().split(REC_END) if len(f := rec.strip("\n").split(SEP)) >= 19]
    ids = {c.split("exp=")[1].split(",")[0] for f in jobs if (c := f[18]).startswith("detslurm:exp=")}
    marks = ",".join("?" * len(ids))
    names = dict(con.execute(f"SELECT id, name FROM experiments WHERE id IN ({marks})", [int(i) for i in ids]))
    jobs.sort(key=lambda f: (f[5], f[4] != "RUNNING", -int(f[7] or 0), f[13]))
    out = []
    for n, f in enumerate(jobs):
        exp = f[18].split("exp=")[1].split(",")[0] if f[18].startswith("detslurm:exp=") else ""
        name = names.get(int(exp), f[17]) if exp else f[17]
        out.append(f"{n} {f[0]} {name} {f[16]} {f[7]} {f[13].replace('T', ' ')} 0/{f[11]} {f[4]} {f[6]} {f[5]} {f[8]}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
