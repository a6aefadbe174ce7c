#!/usr/bin/env bash
# Build the Apptainer TEST RIG: Debian sid's `apptainer`, run from a debootstrapped sid root
# through Charliecloud's ch-run, so that hpcai's `--runtime singularity` path can run for real
# on a Debian 12 machine (which packages no Apptainer). A test rig, not a way to install
# Apptainer for users: a site has its own Apptainer or SingularityCE.
#
#   scripts/build-apptainer-rig.sh [--out DIR] [--force]
#
#   --out DIR   rig directory (default ${HPCAI_CACHE:-~/.cache/hpcai}/apptainer-rig)
#   --force     rebuild the sid root from scratch
#
# DIR/sid      debootstrap --variant=minbase sid from the apt mirror, plus `apptainer`
#              (apt-get install --no-install-recommends, run in the root with chroot)
# DIR/bin/     `singularity` and `apptainer`: `ch-run -b ... DIR/sid -- /usr/bin/apptainer "$@"`;
#              put DIR/bin on PATH and hpcai's runtime lookup finds `singularity`.
# DIR/.stamp   hash of the sid root's recipe: an unchanged recipe costs a hash check.
# The front-end binds, at their own paths, the host's top-level directories (/root, /home,
# /work, ...) of its working directory, of $HOME and of every absolute path in its arguments,
# so that apptainer sees the image, the bind sources and the directories it is given; /tmp is
# shared by ch-run anyway. Paths under /usr, /etc, /var, /run and the other system directories
# are the sid root's own, not the host's. The ranks of one node (LOCAL_WORLD_SIZE, set by
# hpcai-launch) join one ch-run container, so they share a user namespace as under a setuid or
# root Apptainer; each waits inside it until all have joined before it execs apptainer, whose
# exec of its starter would otherwise make a late peer's join fail ("join: no PID").
# Needs root (debootstrap, chroot; the front-end too), ch-run, debootstrap and the apt mirror.
# Failures print `error: ...` and `hint: ...` and exit 2.
set -Eeuo pipefail

START=$SECONDS
RELEASE=sid
VARIANT=minbase
PACKAGES=(apptainer)
CACHE=${HPCAI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcai}

say() { printf '[apptainer-rig %4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() {
  echo "error: $1" >&2
  echo "hint: $2" >&2
  exit 2
}
trap 'die "build step failed (exit $?, build-apptainer-rig.sh line $LINENO): $BASH_COMMAND" \
  "the output above says why; rerun, or pass --force to start from scratch"' ERR

RIG=""
FORCE=0
while (($#)); do
  case $1 in
    --out)
      (($# >= 2)) || die "--out needs a directory" "scripts/build-apptainer-rig.sh --out /path/to/rig"
      RIG=$2
      shift 2
      ;;
    --out=*) RIG=${1#--out=}; shift ;;
    --force) FORCE=1; shift ;;
    -h | --help) sed -n '7,10s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument: $1" "usage: scripts/build-apptainer-rig.sh [--out DIR] [--force]" ;;
  esac
done
RIG=${RIG:-$CACHE/apptainer-rig}
[ "$RIG" != / ] || die "refusing to use / as the rig directory" "pass --out DIR"
mkdir -p "$RIG"
RIG=$(cd "$RIG" && pwd)
SID=$RIG/sid

command -v ch-run >/dev/null ||
  die "ch-run not found" "apt-get install charliecloud-runtime (scripts/install.sh does it)"
export USER=${USER:-$(id -un)} # ch-run refuses to start without $USER

exec 9>"$RIG.lock" # serialise concurrent builds of the same rig
flock 9

# The text of this function is part of the stamp: editing the recipe rebuilds the root.
sid_root() { # $1: empty target directory
  local target=$1 mirror
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  mirror=${HPCAI_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
  say "debootstrap --variant=$VARIANT $RELEASE from $mirror (about 1 min)"
  debootstrap --variant="$VARIANT" "$RELEASE" "$target" "$mirror" >"$target.log" 2>&1 || {
    tail -n 20 "$target.log" >&2
    die "debootstrap of $RELEASE failed (full log: $target.log)" \
      "check that the apt mirror $mirror is reachable, or set HPCAI_DEBIAN_MIRROR"
  }
  say "apt-get install ${PACKAGES[*]} (in the sid root, chroot)"
  # A mirror that is a snapshot has a Release file past its Valid-Until date.
  chroot "$target" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive sh -c 'apt-get -q -o Acquire::Check-Valid-Until=false update &&
      apt-get -q -y --no-install-recommends install "$@"' apt "${PACKAGES[@]}" \
    >>"$target.log" 2>&1 || {
    tail -n 20 "$target.log" >&2
    die "apt-get install ${PACKAGES[*]} in the $RELEASE root failed (full log: $target.log)" \
      "check that the apt mirror $mirror has $RELEASE's ${PACKAGES[*]}"
  }
  rm -f "$target.log"
  rm -rf "$target"/var/cache/apt/archives/*.deb "$target"/var/lib/apt/lists/*
  # ch-run binds the host's /etc/hosts and /etc/resolv.conf only over files that exist;
  # apptainer binds /etc/hosts into its containers and fails without one.
  touch "$target/etc/hosts" "$target/etc/resolv.conf"
  [ -x "$target/usr/bin/apptainer" ] || die "the sid root has no /usr/bin/apptainer" \
    "apt-get install apptainer did not install it; see the apt output above"
}

hash=$( { printf '%s\n' "$RELEASE" "$VARIANT" "${PACKAGES[@]}"; declare -f sid_root; } |
  sha256sum | cut -c1-16)
if ((FORCE == 0)) && [ -f "$RIG/.stamp" ] && [ "$(cat "$RIG/.stamp")" = "$hash" ] &&
  [ -x "$SID/usr/bin/apptainer" ]; then
  say "sid root: up to date ($hash)"
else
  [ "$(id -u)" = 0 ] || die "building the sid root needs root (debootstrap, chroot)" \
    "run scripts/build-apptainer-rig.sh as root once; later runs only check the stamp"
  command -v debootstrap >/dev/null || PATH=$PATH:/usr/sbin:/sbin
  command -v debootstrap >/dev/null || die "debootstrap not found" "apt-get install debootstrap"
  t=$SECONDS
  rm -rf "$SID.new" "$RIG/.stamp"
  sid_root "$SID.new"
  rm -rf "$SID"
  mv "$SID.new" "$SID"
  echo "$hash" >"$RIG/.stamp"
  say "sid root: built in $((SECONDS - t)) s ($(du -sh "$SID" | cut -f1))"
fi

# The front-end (rewritten every run: it is cheap). It finds the sid root next to itself.
mkdir -p "$RIG/bin"
cat >"$RIG/bin/.apptainer.new" <<'EOF'
#!/usr/bin/env bash
# hpcai's Apptainer TEST RIG (written by scripts/build-apptainer-rig.sh), not an Apptainer
# install: Debian sid's apptainer from ../sid, run through ch-run. The host's top-level
# directory of the working directory, of $HOME and of every absolute path in the arguments is
# bound at its own path, system directories excepted (those are the sid root's; /tmp is
# shared).
set -euo pipefail
SID=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../sid" && pwd)
export USER=${USER:-$(id -un)}
top_of() { local rest=${1#/}; printf '/%s' "${rest%%/*}"; }
binds=()
bound=" /tmp "
for arg in "$PWD" "$HOME" "$@"; do # SRC:DST:ro, NAME=VALUE, a,b lists: split on separators
  IFS=',:=' read -r -a words <<<"$arg"
  for word in "${words[@]}"; do
    [[ $word == /?* ]] || continue
    top=$(top_of "$word")
    case $top in
      /bin | /boot | /dev | /etc | /lib | /lib32 | /lib64 | /libx32 | /proc | /run | /sbin | \
        /sys | /usr | /var) continue ;;
    esac
    [[ $bound != *" $top "* ]] && [ -d "$top" ] && [ ! -L "$top" ] || continue
    [ -d "$SID$top" ] || mkdir -p "$SID$top"
    binds+=(-b "$top:$top")
    bound+="$top "
  done
done
cwd=/ # apptainer binds its working directory: the caller's, where the rig can see it
[[ $bound != *" $(top_of "$PWD") "* ]] || cwd=$PWD
# The ranks of one node (hpcai-launch's LOCAL_WORLD_SIZE, started by one parent: orted,
# hydra's proxy or slurmstepd) share one ch-run container, as they share the host's user
# namespace under a setuid or root Apptainer. Each in its own user namespace, MPICH's UCX
# cannot open its peer's shared memory (/proc/PID/fd: permission denied).
# A peer joins the namespaces of the first one through /proc/PID/ns; apptainer (Go) execs its
# starter from another thread, and while that exec replaces the process, /proc/PID/ns/mnt
# is gone ("join: no PID ... not found"). So every member first waits inside the container
# until all have joined (a file each in a directory of the shared /tmp), then execs apptainer.
# The group is named by the PID and start time (a PID is reused, the pair is not) of the
# process that started the ranks: the parent, or, where hpcai-launch's rank wrapper stays to
# watch the rank (under Hydra), the wrapper's parent.
stat_fields() { # the fields of /proc/PID/stat from the third on: [1] ppid, [19] start time
  local stat
  stat=$(<"/proc/$1/stat")
  read -r -a fields <<<"${stat##*) }"
}
inside=(/usr/bin/apptainer "$@")
join=()
if [[ ${LOCAL_WORLD_SIZE:-1} =~ ^[0-9]+$ ]] && ((${LOCAL_WORLD_SIZE:-1} > 1)); then
  starter=$PPID
  case " $(tr '\0' ' ' <"/proc/$starter/cmdline")" in
    *" -m hpcai.launcher "* | *"/hpcai-launch "*) stat_fields "$starter" && starter=${fields[1]} ;;
  esac
  stat_fields "$starter"
  tag=apptainer-rig-$starter-${fields[19]}
  join=(--join-ct="$LOCAL_WORLD_SIZE" --join-tag="$tag")
  barrier='dir=$1 n=$2; shift 2 # run by the sh in the container
    count() { c=0; for f in "$dir"/"$1".*; do [ -e "$f" ] && c=$((c + 1)); done; echo "$c"; }
    mkdir -p "$dir" && : >"$dir/in.$$" || exit 2
    i=0
    while [ "$(count in)" -lt "$n" ]; do
      i=$((i + 1))
      if [ "$i" -gt 1200 ]; then
        echo "apptainer rig: $n members expected in $dir, going on without them after 60 s" >&2
        break
      fi
      sleep 0.05
    done
    : >"$dir/out.$$"
    [ "$(count out)" -lt "$n" ] || rm -rf "$dir" # the last one through removes it
    exec "$@"'
  inside=(/bin/sh -c "$barrier" rig-barrier "/tmp/.$tag" "$LOCAL_WORLD_SIZE" "${inside[@]}")
fi
# --no-passwd: the sid root's /etc/passwd names the user's real home, which apptainer mounts
# (ch-run's generated one says /).
exec ch-run --no-passwd "${join[@]}" "${binds[@]}" -c "$cwd" "$SID" -- "${inside[@]}"
EOF
chmod 755 "$RIG/bin/.apptainer.new"
mv "$RIG/bin/.apptainer.new" "$RIG/bin/apptainer"
ln -sfn apptainer "$RIG/bin/singularity"

version=$("$RIG/bin/apptainer" --version) ||
  die "the rig does not start: $RIG/bin/apptainer --version failed" \
    "see the ch-run/apptainer output above; --force rebuilds the sid root"
say "ready: $RIG/bin/singularity ($version) in $((SECONDS - START)) s"
