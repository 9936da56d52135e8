"""`import determined` wherever detslurm is installed, and a real `determined` always wins.

The packaging tests build the real wheel and the real editable wheel from a copy of the source
(so nothing in the repo or the venv changes), unpack each into a fresh site dir and start Python
with only that site dir (``-S`` + ``site.addsitedir``): exactly what site-packages does at startup.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMPAT_PKG = ROOT / "detslurm/_compat/determined"
FAKE = "REAL_DETERMINED = True\n"

PROBE = (
    "import json, sys\n"
    "import determined as det\n"
    "print(json.dumps({'file': det.__file__, 'real': getattr(det, 'REAL_DETERMINED', False),"
    " 'torch': 'torch' in sys.modules}))\n"
)

# What the .pth line has imported by the time it is done (before json, which imports re).
STARTUP_PROBE = (
    "import sys\n"
    "heavy = sorted(m for m in ('typing', 're', 'collections', 'contextlib', 'pathlib', 'enum') if m in sys.modules)\n"
    "finder = 'detslurm._compat.finder' in sys.modules\n"
    "import json\n"
    "print(json.dumps({'heavy': heavy, 'finder': finder}))\n"
)


def py(code: str, *, env: dict[str, str] | None = None, isolated_site: Path | None = None) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; the JSON line it prints."""
    if isolated_site is not None:
        # No site-packages at all, then this one dir processed as a site dir (its .pth files run).
        code = f"import site; site.addsitedir({str(isolated_site)!r})\n" + code
        argv = [sys.executable, "-S", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    # The cwd is on sys.path for `-c`: run outside the repo so its detslurm/ cannot be picked up.
    cwd = isolated_site.parent if isolated_site is not None else None
    r = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=600, cwd=cwd
    )  # a guard: a loaded machine took over 120 s
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def fake_determined(where: Path) -> Path:
    (where / "determined").mkdir(parents=True)
    (where / "determined/__init__.py").write_text(FAKE)
    return where


INSTALL_FINDER = "from detslurm._compat import finder; finder.install()\n"


def test_finder_resolves_our_package_lazily_and_without_torch(tmp_path: Path) -> None:
    got = py(INSTALL_FINDER + PROBE, env={"PATH": "/usr/bin:/bin"})
    assert got == {"file": str(COMPAT_PKG / "__init__.py"), "real": False, "torch": False}


def test_a_real_determined_on_pythonpath_wins(tmp_path: Path) -> None:
    fake = fake_determined(tmp_path / "real")
    got = py(INSTALL_FINDER + PROBE, env={"PYTHONPATH": str(fake)})
    assert got["real"] is True and got["file"] == str(fake / "determined/__init__.py")


def test_a_finder_added_after_ours_wins_too(tmp_path: Path) -> None:
    """A real determined provided by a later meta-path finder (another editable install)."""
    fake = fake_determined(tmp_path / "real")
    code = (
        INSTALL_FINDER + "import importlib.machinery, sys\n"
        "class Later:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        return importlib.machinery.PathFinder.find_spec(name, [{str(fake)!r}])\n"
        "sys.meta_path.append(Later())\n" + PROBE
    )
    assert py(code)["real"] is True


@pytest.mark.heavy
def test_top_level_names_match_determined() -> None:
    code = (
        INSTALL_FINDER + "import json, sys, detslurm, determined\n"
        "names = ['core', 'get_cluster_info', 'InvalidHP', 'import_from_path', 'LOG_FORMAT', 'experimental', 'launch']\n"
        "ok = {n: getattr(detslurm, n) is not None and getattr(determined, n) is not None for n in names}\n"
        "from determined.experimental import client\n"
        "from determined import core, pytorch\n"
        "print(json.dumps({'ok': ok, 'core': core.DistributedContext is detslurm.core.DistributedContext,"
        " 'client': client.get_checkpoint.__module__, 'pt': pytorch.Trainer is detslurm.pytorch.Trainer,"
        " 'fmt': determined.LOG_FORMAT, 'hp': determined.InvalidHP is detslurm.InvalidHP}))\n"
    )
    got = py(code)
    assert all(dict(got["ok"]).values())  # type: ignore[call-overload]
    assert got["core"] is True and got["pt"] is True and got["hp"] is True
    assert got["client"] == "detslurm.client"
    assert got["fmt"] == "%(levelname)s: [%(process)s] %(name)s: %(message)s"


def test_import_detslurm_stays_light() -> None:
    code = "import json, sys, detslurm\nprint(json.dumps(sorted(m for m in ('torch', 'sqlalchemy', 'click', 'detslurm.core') if m in sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(r.stdout) == []


def test_import_from_path_forgets_only_its_own_modules(tmp_path: Path) -> None:
    from detslurm.util import import_from_path

    (tmp_path / "code").mkdir()
    (tmp_path / "code/old_model_def_probe.py").write_text("VERSION = 'old'\n")
    with import_from_path(tmp_path / "code"):
        import old_model_def_probe  # type: ignore[import-not-found]

        assert old_model_def_probe.VERSION == "old"
    assert "old_model_def_probe" not in sys.modules and str(tmp_path / "code") not in sys.path


def _source_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("detslurm", "cli", "launchers", "templates", "site-configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _build(src: Path, hook: str, out: Path) -> Path:
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("hook", ["build_wheel", "build_editable"])
def test_installed_pth_makes_determined_importable_and_steps_aside(tmp_path: Path, hook: str) -> None:
    src = _source_copy(tmp_path)
    (tmp_path / "dist").mkdir()
    wheel = _build(src, hook, tmp_path / "dist")
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        assert "detslurm-determined.pth" in z.namelist()
        assert not any(n.startswith("determined/") for n in z.namelist())  # never a top-level package
        z.extractall(site)
    got = py(PROBE, isolated_site=site)
    pkg = (site if hook == "build_wheel" else src) / "detslurm/_compat/determined/__init__.py"
    assert got == {"file": str(pkg), "real": False, "torch": False}
    if hook == "build_wheel":
        # The .pth runs at every interpreter start (each trial's ranks too): it must not pull in
        # typing, re and the like, which once cost 5 ms a start.
        assert py(STARTUP_PROBE, isolated_site=site) == {"heavy": [], "finder": True}
    # A real determined installed later into the same site-packages wins at once.
    fake_determined(site)
    assert py(PROBE, isolated_site=site)["file"] == str(site / "determined/__init__.py")
