"""The admin's site file sets limits no user can loosen (docs/admin/site-config.md): the polling
floor, the partitions, accounts and QoS pools and sbatch_args may use, the longest time limit.

Run as root: the admin's file stands in for /etc/detslurm/site.yaml through
$DETSLURM_ADMIN_SITE_CONFIG, which is honoured only for a file root owns and no one else may
write. What a second Unix user can do against it is in tests/cluster/test_site_limits_cluster.py."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import ROOT

from detslurm.doctor import checks
from detslurm.doctor.facts import SiteFacts
from detslurm.doctor.findings import Finding, Status
from detslurm.errors import ConfigError
from detslurm.slurm.client import Result
from detslurm.slurm.parse import parse_config, parse_sinfo
from detslurm.slurm.partitions import parse_partitions
from detslurm.slurm.refusals import RefusalKind, RequestRefused
from detslurm.slurm.site import SiteConfig, load_site_config

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"
ADMIN = """\
default_pool: cpu
poll_interval_s: 10
limits:
  partitions: [cpu, gpu]
  accounts: [proj]
  qos: [normal, high]
  max_time_min: 120
pools:
  cpu: {partition: cpu, slots_per_node: 2, account: proj, qos: normal}
  gpu: {partition: gpu, slot_type: gpu, slots_per_node: 2, account: proj}
"""


@pytest.fixture
def admin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The admin's file, root's and 0644, named the one way tests may name it."""
    if os.geteuid() != 0:
        pytest.skip("the admin's file must be owned by root")
    path = tmp_path / "admin-site.yaml"
    path.write_text(ADMIN)
    path.chmod(0o644)
    monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(path))
    monkeypatch.delenv("DETSLURM_SITE_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # no ~/.config/detslurm/site.yaml
    return path


def user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "my-site.yaml"
    path.write_text(text)
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(path))
    return path


def test_a_users_file_cannot_lower_the_admins_polling_floor(
    admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = user_file(tmp_path, monkeypatch, "poll_interval_s: 0.5\ndefault_pool: cpu\n")
    site = load_site_config()
    assert site.poll_interval_s == 10 and site.origin("poll_interval_s") == str(admin)
    assert site.files == [admin, mine]
    # The admin's pools and limits are all there, whatever the user's file says.
    assert sorted(site.pools) == ["cpu", "gpu"] and site.limits.accounts == ["proj"]


def test_a_users_file_adds_pools_and_defaults_and_tightens_limits(
    admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = user_file(
        tmp_path,
        monkeypatch,
        "poll_interval_s: 30\ndefault_pool: mine\nsetup: [echo mine]\n"
        "limits: {max_time_min: 60, qos: [low, high, normal]}\n"
        "pools:\n  mine: {partition: gpu, slot_type: gpu, slots_per_node: 1, qos: high}\n",
    )
    site = load_site_config()
    assert site.default_pool == "mine" and sorted(site.pools) == ["cpu", "gpu", "mine"]
    assert site.origin("pools.mine") == str(mine) and site.origin("pools.cpu") == str(admin)
    assert site.poll_interval_s == 30 and site.origin("poll_interval_s") == str(mine)
    # Tighter: the user's; a value only the user adds (low) is not allowed by the admin's list.
    assert site.limits.max_time_min == 60 and site.origin("limits.max_time_min") == str(mine)
    assert site.limits.qos == ["normal", "high"] and site.origin("limits.qos") == str(admin)
    assert site.origin("limits.accounts") == str(admin)


@pytest.mark.parametrize(
    ("pool", "words"),
    [
        ("{partition: high}", ["partition", "'high' is not allowed", "limits.partitions"]),
        ("{partition: cpu, account: other}", ["account", "'other' is not allowed", "limits.accounts"]),
        ("{partition: cpu, time_limit_min: 600}", ["time_limit_min: 600 is over", "limits.max_time_min"]),
    ],
)
def test_a_users_pool_outside_the_limits_names_both_files(
    admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str, words: list[str]
) -> None:
    mine = user_file(tmp_path, monkeypatch, f"pools:\n  mine: {pool}\n")
    with pytest.raises(ConfigError) as e:
        load_site_config()
    text = str(e.value)
    assert str(mine) in text and str(admin) in text
    assert all(w in text for w in words), text


def test_a_user_cannot_redefine_the_sites_pool(admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The admin's definition is used, and the doctor says which of the user's pools it hides
    (a file `det site init` wrote before the admin installed one names the same pools)."""
    mine = user_file(tmp_path, monkeypatch, "pools:\n  cpu: {partition: cpu, slots_per_node: 2, account: other}\n")
    site = load_site_config()
    assert site.pools["cpu"].account == "proj" and site.origin("pools.cpu") == str(admin)
    found = checks.check_site_limits(facts(site, None))
    assert found.status is checks.WARNING and f"pools cpu of {mine} are the site's too" in found.detail


@pytest.mark.parametrize("attack", ["not root's", "group-writable", "world-writable"])
def test_an_admin_file_that_root_does_not_hold_alone_is_refused(
    admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attack: str
) -> None:
    """What a user who controls the environment could name: a file of their own, or one they
    may write."""
    if attack == "not root's":
        os.chown(admin, 65534, 65534)
    else:
        admin.chmod(0o664 if attack == "group-writable" else 0o646)
    with pytest.raises(ConfigError, match="must be owned by root and writable by no one else"):
        load_site_config()


def test_the_admin_override_is_read_only_where_etc_has_no_file(
    admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixed path wins: naming another root-owned file (looser) changes nothing when the
    admin's file is installed."""
    import detslurm.slurm.site as site_mod

    installed = tmp_path / "etc-site.yaml"
    installed.write_text("poll_interval_s: 60\n")
    monkeypatch.setattr(site_mod, "ADMIN_SITE_CONFIG", installed)
    site = load_site_config()
    assert site.poll_interval_s == 60 and site.files == [installed]


# -- sbatch_args cannot change what the site locks ----------------------------------------


def create_dry_run(det_env: Path, config: str, site: SiteConfig) -> None:
    """`det e create --dry-run`'s create, on Slurm, with a Slurm that answers nothing: the
    site's locks are judged before any Slurm call."""
    from detslurm import settings as settings_mod
    from detslurm.controller.create import create, plan_create
    from detslurm.controller.placement import SlurmPlace
    from detslurm.slurm.client import SlurmClient
    from detslurm.store import open_store

    def unreachable(argv: Sequence[str], **_: Any) -> Result:
        raise AssertionError(f"a site lock needs no Slurm call, got {list(argv)}")

    ctx = det_env / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = det_env / "c.yaml"
    cfg.write_text(config)
    settings = settings_mod.load()
    place = SlurmPlace(SlurmClient(unreachable, user="alice"), site, lambda ex: None)
    create(open_store(settings.db_url), settings, place, plan_create(settings, cfg, ctx), lambda *a, **k: None)


BASE = "name: x\nentrypoint: python3 train.py\nsearcher: {name: single, metric: m, max_length: {batches: 1}}\n"


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        ("[--account=other]", "--account other is not allowed: limits.accounts in {admin} allows only proj"),
        ("[-q, low]", "--qos low is not allowed: limits.qos in {admin} allows only normal, high"),
        ("[--time=3:00:00]", "--time 3:00:00 is over the site's maximum 02:00:00 (limits.max_time_min in {admin})"),
        ("[-t, UNLIMITED]", "--time UNLIMITED is over the site's maximum"),
    ],
)
def test_sbatch_args_cannot_change_what_the_site_locks(
    det_env: Path, admin: Path, monkeypatch: pytest.MonkeyPatch, args: str, refused: str
) -> None:
    site = load_site_config()
    with pytest.raises(RequestRefused) as e:
        create_dry_run(det_env, BASE + f"slurm: {{sbatch_args: {args}}}\n", site)
    (r,) = e.value.refusals
    assert r.kind is RefusalKind.SITE_LIMIT and r.path.startswith("<config>.slurm.sbatch_args[")
    assert refused.format(admin=admin) in r.message


def test_sbatch_args_within_the_limits_pass(det_env: Path, admin: Path) -> None:
    # Within the locks: the create goes on to ask Slurm (which the stand-in refuses to answer).
    with pytest.raises(AssertionError, match="needs no Slurm call"):
        create_dry_run(det_env, BASE + "slurm: {sbatch_args: [--qos=high, --time=30]}\n", load_site_config())


# -- the doctor ---------------------------------------------------------------------------


def facts(site: SiteConfig, user_poll: float | None) -> SiteFacts:
    return SiteFacts(
        caps=parse_config((DATA / "show-config.txt").read_text()),
        partitions=parse_partitions((DATA / "show-partition.txt").read_text()),
        sinfo=parse_sinfo((DATA / "sinfo.txt").read_text()),
        site=site,
        site_path=site.files[0] if site.files else None,
        experiments_dir=Path("/shared/exps"),
        checkpoint_dir=Path("/shared/ckpts"),
        user_poll_interval_s=user_poll,
    )


def test_the_doctor_says_which_file_set_each_limit(
    admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = user_file(tmp_path, monkeypatch, "limits: {max_time_min: 60}\n")
    found = {f.subject: f for f in checks.site_findings(facts(load_site_config(), None))}
    limits = found["site limits"].detail
    assert f"poll floor 10 s ({admin})" in limits and f"accounts proj ({admin})" in limits
    assert f"max time 60 min ({mine})" in limits
    assert f"(from {admin})" in found["polling"].detail


def test_the_doctor_says_when_the_user_set_no_poll_interval(admin: Path) -> None:
    site = load_site_config()
    assert "this user sets none" in checks.check_polling(facts(site, None)).detail
    assert "this user asks for 0.5 s" in checks.check_polling(facts(site, 0.5)).detail


def test_the_doctor_reads_the_users_setting_not_the_default(monkeypatch: pytest.MonkeyPatch, det_env: Path) -> None:
    from detslurm.doctor.facts import _user_poll_interval_s

    monkeypatch.delenv("DETSLURM_POLL_INTERVAL_S")
    assert _user_poll_interval_s() is None
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "2")
    assert _user_poll_interval_s() == 2.0


def test_the_doctors_table_fits_100_columns(admin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table as `det site doctor` prints it, for the captured 22.05 cluster and long paths."""
    from detslurm.cli.site import findings_table

    user_file(tmp_path, monkeypatch, "limits: {max_time_min: 60}\n")
    long = Finding("pool abcdefghijklmnop: node", Status.PROBLEM, "word " * 40 + "x" * 60, "act " * 30 + "y" * 40)
    table = findings_table([*checks.site_findings(facts(load_site_config(), 0.5)), long])
    widths = [len(line) for line in table.splitlines()]
    assert len(widths) > 20 and max(widths) <= 100, max(widths)


def test_job_list_help_says_what_each_type_means() -> None:
    """Every user's detslurm trials are TYPE_EXPERIMENT (as Determined shows every user's
    experiments); TYPE_EXTERNAL is for jobs detslurm did not submit."""
    from detslurm.cli.main import cli

    out = CliRunner().invoke(cli, ["job", "list", "--help"]).output
    text = " ".join(out.split())
    assert "every user's detslurm trials as TYPE_EXPERIMENT" in text
    assert "jobs detslurm did not submit as TYPE_EXTERNAL" in text


def test_the_generic_site_config_documents_limits() -> None:
    site = load_site_config(ROOT / "site-configs" / "generic.yaml")
    assert site.limits.max_time_min is None  # documented commented out: no limit by default
    assert "limits:" in (ROOT / "site-configs" / "generic.yaml").read_text()
