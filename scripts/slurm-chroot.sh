# Sourced by scripts/test-cluster when TEST_CLUSTER_SLURM names a Slurm other than the host's.
#
# Debian 12 packages Slurm 22.05 and Debian 13 packages 24.11. Mixing trixie packages into the
# host is not possible (glibc), and a 22.05 client cannot talk to a 24.11 slurmctld, so the
# whole 24.11 cluster (munged, slurmctld, slurmd, slurmdbd, the jobs) and its clients run in a
# Debian 13 chroot. The chroot is built once into a root-owned cache and reused; it sees this
# repository, the state dir and /tmp at the same paths as the host, so tests and jobs inside
# it find every file where the host put it.

# Debian release that packages each Slurm version we test against.
chroot_suite() {
  case $1 in
    24.11) echo trixie ;;
    *) echo "test-cluster: no chroot recipe for Slurm '$1' (known: 24.11)" >&2; return 2 ;;
  esac
}

# The host's Debian mirror: read from its apt sources at run time (never written into the repo).
chroot_mirror() {
  local m
  m=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -n 1)
  [ -n "$m" ] || m=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v -- '-security' | head -n 1)
  echo "${m:-http://deb.debian.org/debian}"
}

CHROOT_VER=$TEST_CLUSTER_SLURM
CHROOT_CACHE=${TEST_CLUSTER_CHROOT_CACHE:-/var/cache/detslurm}
ROOTFS=$CHROOT_CACHE/slurm-$CHROOT_VER
REPO=$(cd "$HERE/.." && pwd)
CHROOT_PKGS=slurmctld,slurmd,slurm-client,slurmdbd,mariadb-server,munge,python3,python3-venv,ca-certificates,hostname,procps

chroot_build() {
  [ -f "$ROOTFS/.detslurm-ready" ] && return 0
  [ "$(id -u)" = 0 ] || { echo "test-cluster: building the Slurm $CHROOT_VER chroot needs root" >&2; return 1; }
  local suite; suite=$(chroot_suite "$CHROOT_VER")
  mkdir -p "$CHROOT_CACHE"; chmod 755 "$CHROOT_CACHE"
  # Two test sessions starting at once must not both debootstrap into the same dir.
  exec 9>"$CHROOT_CACHE/.lock-$CHROOT_VER"
  flock 9
  if [ ! -f "$ROOTFS/.detslurm-ready" ]; then
    command -v debootstrap >/dev/null || {
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 update -qq
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq debootstrap >/dev/null
    }
    echo "test-cluster: building the Slurm $CHROOT_VER chroot ($suite) in $ROOTFS (once; about a minute)" >&2
    rm -rf "$ROOTFS.tmp"
    debootstrap --variant=minbase --include="$CHROOT_PKGS" "$suite" "$ROOTFS.tmp" "$(chroot_mirror)" \
      >"$CHROOT_CACHE/debootstrap-$CHROOT_VER.log" 2>&1 || {
      echo "test-cluster: debootstrap failed; see $CHROOT_CACHE/debootstrap-$CHROOT_VER.log" >&2
      return 1
    }
    # Written last, so an interrupted build is redone instead of half used.
    touch "$ROOTFS.tmp/.detslurm-ready"
    mv "$ROOTFS.tmp" "$ROOTFS"
  fi
  exec 9>&-
}

# Bind DIR into the chroot at the same path (once; nothing when a bound parent covers it).
chroot_bind() {
  local dir=$1 m
  for m in /tmp "$REPO"; do
    case $dir/ in "$m"/*) mountpoint -q "$ROOTFS$m" && [ "$m" != "$dir" ] && return 0 ;; esac
  done
  mountpoint -q "$ROOTFS$dir" && return 0
  mkdir -p "$ROOTFS$dir"
  mount --bind "$dir" "$ROOTFS$dir"
  # Slave propagation: unmounting inside the chroot later must never unmount the host's own.
  mount --make-rslave "$ROOTFS$dir"
}

chroot_mount() {
  mountpoint -q "$ROOTFS/proc" || mount -t proc proc "$ROOTFS/proc"
  local d
  for d in sys dev; do
    if ! mountpoint -q "$ROOTFS/$d"; then
      mount --rbind "/$d" "$ROOTFS/$d"
      mount --make-rslave "$ROOTFS/$d"
    fi
  done
  chroot_bind /tmp
  chroot_bind "$REPO"
  chroot_bind "$S"
  # Name resolution for pip, and the host's names; `up` adds the node names inside.
  cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf" 2>/dev/null || true
  # The host's trust store: pip inside must trust what the host trusts (a site's TLS proxy).
  cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/host-ca-certificates.crt" 2>/dev/null || true
  grep -v "# detslurm-test-cluster\$" /etc/hosts >"$ROOTFS/etc/hosts.new" || true
  grep "# detslurm-test-cluster\$" "$ROOTFS/etc/hosts" >>"$ROOTFS/etc/hosts.new" 2>/dev/null || true
  mv "$ROOTFS/etc/hosts.new" "$ROOTFS/etc/hosts"
}

# Run a command inside the chroot, in the current directory, with a clean environment: only the
# settings meant for tests pass (the host's PATH, venv or pip settings would point at host files).
chroot_run() {
  local -a keep=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
    TEST_CLUSTER_IN_CHROOT=1)
  [ -f "$ROOTFS/etc/ssl/certs/host-ca-certificates.crt" ] && keep+=(PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt)
  local v
  for v in $(compgen -e); do
    case $v in
      CI | TERM | USER | DETSLURM_* | TEST_CLUSTER_* | PYTEST_* | SLURM_CONF | http_proxy | https_proxy | no_proxy)
        [ "$v" = TEST_CLUSTER_SLURM ] || keep+=("$v=${!v}") ;;
    esac
  done
  chroot "$ROOTFS" /usr/bin/env -i "${keep[@]}" /bin/bash -c 'cd "$1" && shift && exec "$@"' _ "$PWD" "$@"
}

# Unmount everything under the chroot once no process runs inside it any more (another cluster
# of the same version may still use it).
chroot_unmount_if_idle() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOTFS" ] && return 0
  done
  local m
  for m in $(awk -v r="$ROOTFS/" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}

chroot_main() {
  local cmd=$1
  case $cmd in
    up | env | status | ctld-stop | ctld-start)
      chroot_build
      chroot_mount
      if [ "$cmd" = up ] && [ "${TEST_CLUSTER_DBD:-0}" = 1 ] && [ -z "${TEST_CLUSTER_DB_PORT:-}" ]; then
        # Trixie's slurmdbd 24.11.5 dies against trixie's MariaDB 11.8 at its first query
        # ("_check_mysql_concat_is_sane: null result", client error 5027); against the host's
        # MariaDB 10.11 it works. The database is only a TCP service to slurmdbd, so the host
        # runs it (same network; its pid file in the state dir, so `down` stops it).
        TEST_CLUSTER_SLURM='' bash "$HERE/test-cluster" db-up "$S"
        export TEST_CLUSTER_DB_PORT=$((${TEST_CLUSTER_PORT:-16817} + 10))
      fi
      chroot_run bash "$HERE/test-cluster" "$cmd" "$S"
      ;;
    down | purge)
      if [ -f "$ROOTFS/.detslurm-ready" ] && mountpoint -q "$ROOTFS/proc"; then
        chroot_mount
        chroot_run bash "$HERE/test-cluster" "$cmd" "$S"
      fi
      chroot_unmount_if_idle
      awk -v r="$ROOTFS/" 'index($2, r) == 1 {n++} END {exit n > 0}' /proc/self/mounts \
        || echo "test-cluster: processes still run in $ROOTFS; its mounts stay until the last cluster is down" >&2
      ;;
    exec)
      # exec STATE_DIR [--] CMD...: a command with this cluster's Slurm clients (SLURM_CONF set).
      shift 2
      [ "${1:-}" = -- ] && shift
      [ $# -gt 0 ] || { echo "usage: $0 exec STATE_DIR [--] CMD..." >&2; return 2; }
      chroot_build
      chroot_mount
      if [ -f "$S/etc/slurm.conf" ]; then SLURM_CONF=$S/etc/slurm.conf chroot_run "$@"; else chroot_run "$@"; fi
      ;;
    unmount) chroot_unmount_if_idle ;;
    *) echo "usage: $0 up|down|purge|env|status|exec|unmount|ctld-stop|ctld-start STATE_DIR" >&2; return 2 ;;
  esac
}
