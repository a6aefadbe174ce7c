#!/usr/bin/env bash
# Build the hpcai Charliecloud image (a plain directory image) without any registry:
#
#   charliecloud/build-image.sh [--out DIR] [--force] [--squash]
#
#   --out DIR   image directory (default ${HPCAI_IMAGE_DIR:-$HOME/.cache/hpcai/images}/hpcai-bookworm,
#               outside the repository so that clean clones reuse it)
#   --force     rebuild every layer from scratch
#   --squash    also write DIR.sqfs (ch-convert if present, else mksquashfs)
#
# Three layers, each with a stamp file holding its hash under DIR/opt/hpcai/:
#   base     debootstrap --variant=minbase bookworm from the apt mirror: python3, pip, Open MPI
#            4.1.4 (the image's own MPI), empty mount points under /opt/hpcai   (.stamp-base)
#   python   pip3 install of requirements.txt (minus pytest; minus tensorflow-cpu and keras
#            unless HPCAI_IMAGE_WITH_TF=1), torch from ${HPCAI_WHEELS:-/opt/wheels}
#            when that directory exists; plus a Horovod wheel if
#            HPCAI_IMAGE_HOROVOD_WHEEL names one (scripts/build-horovod.sh
#            builds and caches it; same Python 3.11, torch and Open MPI ABI)    (.stamp-python)
#   project  this repository's package, non-editable, --no-deps                 (.stamp-project)
# Then, every run: empty /etc/hosts and /etc/resolv.conf where missing (ch-run binds the
# host's name resolution only onto files the image has).
# A layer is rebuilt only when its hash changed (the base layer's recipe; requirements.txt and
# the python layer's recipe; the tracked sources), so an unchanged image costs a hash check.
# Every run ends with DIR/opt/hpcai/manifest.json up to date.
# Needs root (or a user who can run debootstrap), charliecloud-runtime (ch-run), debootstrap,
# and squashfs-tools for --squash. Failures print `error: ...` and `hint: ...` and exit 2.
set -Eeuo pipefail # -E: the ERR trap below also fires inside functions

START=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=hpcai-bookworm
RELEASE=bookworm
VARIANT=minbase
# python3-venv is left out: everything is installed into the system Python of the image.
BASE_PACKAGES=(python3 python3-pip ca-certificates openmpi-bin libopenmpi3)
MOUNT_POINTS=(/opt/hpcai/host /opt/hpcai/src /opt/hpcai/data /opt/hpcai/out /opt/hpcai/work)
WHEELS=${HPCAI_WHEELS:-/opt/wheels}
# The tracked files that make up the installed package (the project layer's hash).
SOURCE_PATHS=(setup.cfg pyproject.toml __init__.py core launcher models training slurm perf)

say() { printf '[image %4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() {
  echo "error: $1" >&2
  echo "hint: $2" >&2
  exit 2
}
on_err() {
  local rc=$1 line=$2 cmd=$3
  echo "error: build step failed (exit $rc, build-image.sh line $line): $cmd" >&2
  echo "hint: the output above says why; rerun to resume (finished layers are kept)," \
    "or pass --force to start from scratch" >&2
  exit 2
}
trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR

usage() { sed -n '2,10s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

IMG=""
FORCE=0
SQUASH=0
while (($#)); do
  case $1 in
    --out)
      (($# >= 2)) || die "--out needs a directory" "charliecloud/build-image.sh --out /path/to/image"
      IMG=$2
      shift 2
      ;;
    --out=*) IMG=${1#--out=}; shift ;;
    --force) FORCE=1; shift ;;
    --squash) SQUASH=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument: $1" "usage: charliecloud/build-image.sh [--out DIR] [--force] [--squash]" ;;
  esac
done
[ -n "$IMG" ] || IMG=${HPCAI_IMAGE_DIR:-$HOME/.cache/hpcai/images}/$NAME
[ -n "$IMG" ] && [ "$IMG" != / ] || die "refusing to use '$IMG' as the image directory" "pass --out DIR"
mkdir -p "$(dirname "$IMG")"
IMG=$(cd "$(dirname "$IMG")" && pwd)/$(basename "$IMG")
META=$IMG/opt/hpcai

# ---------------------------------------------------------------- prerequisites
command -v ch-run >/dev/null ||
  die "ch-run not found" "apt-get install charliecloud-runtime (scripts/install.sh does it)"
command -v sha256sum >/dev/null || die "sha256sum not found" "apt-get install coreutils"
export USER=${USER:-$(id -un)} # ch-run refuses to start without $USER

# ch-run with a clean environment: nothing of the host's venv, MPI or LD_LIBRARY_PATH leaks
# into the build. ch-run starts in /, so every path given to it is absolute.
CH_ENV=(env -i "USER=$USER" HOME=/root LANG=C.UTF-8 LC_ALL=C.UTF-8
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
ch() { "${CH_ENV[@]}" ch-run "$@"; }

# Serialise concurrent builds of the same image (two test sessions, say).
exec 9>"$IMG.lock"
if ! flock -n 9; then
  say "another build of $IMG is running; waiting for it"
  flock 9
fi

# ---------------------------------------------------------------- layer recipes
# The text of each layer function is part of that layer's hash: editing a recipe rebuilds it.

base_layer() { # $1: empty target directory
  local target=$1 mirror
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  mirror=${HPCAI_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
  local include
  include=$(IFS=,; echo "${BASE_PACKAGES[*]}")
  say "base: debootstrap --variant=$VARIANT $RELEASE from $mirror (about 1-3 min)"
  debootstrap --variant="$VARIANT" --include="$include" "$RELEASE" "$target" "$mirror" \
    >"$target.debootstrap.log" 2>&1 || {
    tail -n 20 "$target.debootstrap.log" >&2
    die "debootstrap failed (full log: $target.debootstrap.log)" \
      "check that the apt mirror $mirror is reachable, or set HPCAI_DEBIAN_MIRROR"
  }
  rm -f "$target.debootstrap.log"
  # Device nodes are useless in a Charliecloud image (ch-run binds the host's /dev) and make
  # packers copy /dev/full until the disk is full.
  find "$target/dev" -mindepth 1 -not -type d -delete
  rm -rf "$target"/var/cache/apt/archives/*.deb "$target"/var/lib/apt/lists/*
  local m
  for m in "${MOUNT_POINTS[@]}"; do
    mkdir -p "$target$m"
  done
  # The image's Open MPI must be the default MPI inside (mpirun, libmpi.so.40).
  [ -n "$(find "$target/usr/lib" -name 'libmpi.so.40*' -print -quit)" ] ||
    die "the base layer has no libmpi.so.40" "the Debian package libopenmpi3 did not install; see the debootstrap log"
}

python_layer() {
  local -a reqs=("${REQS[@]}") pipenv=() binds=()
  if [ -n "$HOROVOD_WHEEL" ]; then
    say "python: + $(basename "$HOROVOD_WHEEL") (Horovod, built on the host against Open MPI)"
    mkdir -p "$IMG/opt/horovod-wheel"
    binds+=(-b "$(dirname "$HOROVOD_WHEEL"):/opt/horovod-wheel")
    reqs+=("/opt/horovod-wheel/$(basename "$HOROVOD_WHEEL")" cloudpickle cffi psutil pyyaml packaging)
  fi
  if [ -d "$WHEELS" ]; then
    say "python: pip3 install ${reqs[*]} (find-links $WHEELS)"
    mkdir -p "$IMG/opt/wheels"
    binds+=(-b "$WHEELS:/opt/wheels")
    pipenv=(PIP_FIND_LINKS=/opt/wheels)
  else
    say "python: pip3 install ${reqs[*]} (PyPI; no $WHEELS here, so torch is PyPI's build)"
  fi
  # The host's CA bundle (a site proxy may re-sign PyPI) is used for this build only.
  local ca=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
  if [ -f "$ca" ]; then
    install -m 644 "$ca" "$META/work/.build-ca.pem"
    pipenv+=(PIP_CERT=/opt/hpcai/work/.build-ca.pem)
  fi
  local rc=0
  ch -w "${binds[@]}" "$IMG" -- env "${pipenv[@]}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-180}" PIP_ROOT_USER_ACTION=ignore \
    pip3 install --break-system-packages --no-cache-dir --no-warn-script-location \
    --progress-bar off "${reqs[@]}" || rc=$?
  rm -f "$META/work/.build-ca.pem"
  [ ! -d "$IMG/opt/wheels" ] || rmdir "$IMG/opt/wheels"
  [ ! -d "$IMG/opt/horovod-wheel" ] || rmdir "$IMG/opt/horovod-wheel"
  ((rc == 0)) || die "pip3 install inside the image failed (exit $rc)" \
    "check that PyPI is reachable from this machine; put a CPU torch wheel in HPCAI_WHEELS (default /opt/wheels)"
}

project_layer() {
  local stage=/opt/hpcai/work/.hpcai-src
  say "project: pip3 install --no-deps $ROOT (non-editable)"
  # setuptools builds in the source tree, so the tracked files (not the venv, build/ or
  # *.egg-info of the checkout) are copied to a scratch directory inside the image first.
  rm -rf "$IMG$stage"
  mkdir -p "$IMG$stage"
  { printf '%s\0' "${SRC_FILES[@]}"; [ ! -f "$ROOT/README.md" ] || printf '%s\0' README.md; } |
    tar -C "$ROOT" --null -T - -cf - | tar -C "$IMG$stage" -xf -
  ch -w "$IMG" -- env PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    pip3 install --break-system-packages --no-cache-dir --no-deps --no-build-isolation \
    --force-reinstall --no-warn-script-location "$stage" >"$IMG$stage.log" 2>&1 || {
    tail -n 20 "$IMG$stage.log" >&2
    die "installing the hpcai package into the image failed" "see the pip output above"
  }
  rm -rf "$IMG$stage" "$IMG$stage.log"
  # The mount point of the host's FLOP counts (containerplan.flop_cache); in this layer, not
  # with MOUNT_POINTS, so that adding it did not rebuild the base layer.
  mkdir -p "$IMG/opt/hpcai/cache/flops"
}

# ---------------------------------------------------------------- hashes
REQS=()
read_requirements() { # REQS: requirements.txt without comments and without pytest
  local line name
  [ -f "$ROOT/requirements.txt" ] || die "$ROOT/requirements.txt not found" "restore requirements.txt"
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}
    line=$(echo "$line" | tr -d '[:space:]')
    [ -n "$line" ] || continue
    case $line in -*) die "requirements.txt option '$line' is not supported by the image build" \
      "list plain requirements only" ;; esac
    name=${line%%[<>=!~;[]*}
    [ "${name,,}" = pytest ] && continue
    # TensorFlow/Keras (~600 MB) only when asked: HPCAI_IMAGE_WITH_TF=1
    case ${name,,} in tensorflow-cpu|keras) [ "${HPCAI_IMAGE_WITH_TF:-0}" = 1 ] || continue ;; esac
    REQS+=("$line")
  done <"$ROOT/requirements.txt"
  ((${#REQS[@]})) || die "no requirements found in $ROOT/requirements.txt" "restore requirements.txt"
}

source_files() { # NUL-separated tracked source files, relative to ROOT, that exist
  local f
  if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    while IFS= read -r -d '' f; do
      [ -f "$ROOT/$f" ] && printf '%s\0' "$f"
    done < <(git -C "$ROOT" ls-files -z -- "${SOURCE_PATHS[@]}")
  else # an exported tree without .git
    (cd "$ROOT" && find "${SOURCE_PATHS[@]}" -name __pycache__ -prune -o -name '*.egg-info' -prune \
      -o -type f -print0 2>/dev/null | sort -z)
  fi
}

hash_of() { sha256sum | cut -c1-16; }

read_requirements
HOROVOD_WHEEL=${HPCAI_IMAGE_HOROVOD_WHEEL:-}
if [ -n "$HOROVOD_WHEEL" ]; then
  [ -f "$HOROVOD_WHEEL" ] && [[ $HOROVOD_WHEEL == *.whl ]] ||
    die "HPCAI_IMAGE_HOROVOD_WHEEL=$HOROVOD_WHEEL is not a wheel file" \
      "run scripts/build-horovod.sh; the wheel is under ~/.cache/hpcai/wheels/horovod-*/"
  HOROVOD_WHEEL=$(cd "$(dirname "$HOROVOD_WHEEL")" && pwd)/$(basename "$HOROVOD_WHEEL")
fi
mapfile -d '' -t SRC_FILES < <(source_files)
((${#SRC_FILES[@]})) || die "no tracked sources found under $ROOT" "run the script from a checkout of hpcai"

BASE_HASH=$({
  echo "$NAME $RELEASE $VARIANT ${BASE_PACKAGES[*]} ${MOUNT_POINTS[*]}"
  declare -f base_layer
} | hash_of)
PY_HASH=$({
  echo "$BASE_HASH"
  printf '%s\n' "${REQS[@]}"
  [ ! -d "$WHEELS" ] || ls "$WHEELS"
  [ -z "$HOROVOD_WHEEL" ] || sha256sum <"$HOROVOD_WHEEL"
  declare -f python_layer
} | hash_of)
SRC_HASH=$({
  declare -f project_layer
  (cd "$ROOT" && sha256sum -- "${SRC_FILES[@]}")
} | hash_of)

stamp() { cat "$META/.stamp-$1" 2>/dev/null || true; }
set_stamp() { echo "$2" >"$META/.stamp-$1"; }

# ---------------------------------------------------------------- build
say "image $IMG"
changed=0

if ((FORCE)) || [ "$(stamp base)" != "$BASE_HASH" ]; then
  command -v debootstrap >/dev/null ||
    die "debootstrap not found" "apt-get install debootstrap (scripts/install.sh does it)"
  [ "$(id -u)" = 0 ] || die "the base layer needs root (debootstrap)" \
    "run as root once; later runs only rebuild the Python and project layers"
  t=$SECONDS
  if [ -e "$IMG" ] && [ ! -d "$IMG/opt/hpcai" ] && [ -n "$(ls -A "$IMG" 2>/dev/null)" ]; then
    die "$IMG exists and is not an hpcai image; not replacing it" "pass --out with a new or empty directory"
  fi
  new=$IMG.new
  rm -rf "$new"
  mkdir -p "$new"
  base_layer "$new"
  rm -rf "$IMG" "$IMG.sqfs"
  mv "$new" "$IMG"
  set_stamp base "$BASE_HASH"
  say "base: done in $((SECONDS - t)) s"
  changed=1
else
  say "base: up to date ($BASE_HASH)"
fi

if ((FORCE)) || [ "$(stamp python)" != "$PY_HASH" ]; then
  t=$SECONDS
  rm -f "$META/.stamp-python" "$META/.stamp-project"
  python_layer
  set_stamp python "$PY_HASH"
  say "python: done in $((SECONDS - t)) s"
  changed=1
else
  say "python: up to date ($PY_HASH)"
fi

if ((FORCE)) || [ "$(stamp project)" != "$SRC_HASH" ]; then
  t=$SECONDS
  rm -f "$META/.stamp-project"
  project_layer
  set_stamp project "$SRC_HASH"
  say "project: done in $((SECONDS - t)) s"
  changed=1
else
  say "project: up to date ($SRC_HASH)"
fi

# ---------------------------------------------------------------- name resolution
# ch-run binds the host's /etc/hosts and /etc/resolv.conf only onto files the image has; a
# debootstrap root has no /etc/hosts, so neither localhost nor the node names resolved in
# the container. Empty files make every ch-run use the node's own (outside the layers: a
# cached image gets them too without a rebuild).
for f in /etc/hosts /etc/resolv.conf; do
  if [ ! -e "$IMG$f" ]; then
    : >"$IMG$f"
    say "name resolution: empty $f (ch-run binds the host's over it)"
  fi
done

# ---------------------------------------------------------------- manifest
if ((changed)) || [ ! -s "$META/manifest.json" ]; then
  say "manifest: $META/manifest.json"
  manifest=$(ch "$IMG" -- python3 - "$NAME" "$RELEASE" "$BASE_HASH" "$PY_HASH" "$SRC_HASH" <<'PY'
import datetime, glob, importlib.metadata as md, json, os, platform, re, subprocess, sys

name, release, base, python, project = sys.argv[1:6]

def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None

libc = os.confstr("CS_GNU_LIBC_VERSION") or ""            # "glibc 2.36", from the image's libc
mpirun = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
mpi_version = re.search(r"(\d+\.\d+(?:\.\d+)?)", mpirun.splitlines()[0] if mpirun else "")
libmpi = sorted(glob.glob("/usr/lib/*/libmpi.so.40"))
os_release = dict(line.rstrip("\n").split("=", 1) for line in open("/etc/os-release") if "=" in line)
print(json.dumps({
    "image": name,
    "build_date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "debian_release": release,
    "debian_version": open("/etc/debian_version").read().strip(),
    "os": os_release.get("PRETTY_NAME", "").strip('"'),
    "glibc": libc.split()[-1] if libc else None,
    "mpi": {
        "family": "openmpi",
        "soname": "libmpi.so.40",
        # ABIs the image's MPI programs can use: the mpi4py wheel carries an Open MPI and
        # an MPICH-ABI build and picks one at run time (MPI4PY_MPIABI), so a bound host
        # MPICH / Intel MPI works as well as a host Open MPI.
        "abis": ["openmpi"] + (["mpich"] if glob.glob(
            "/usr/local/lib/python3*/dist-packages/mpi4py/MPI.mpich*.so") else []),
        "version": mpi_version.group(1) if mpi_version else None,
        "mpirun": "/usr/bin/mpirun.openmpi",
        "libmpi": libmpi[0] if libmpi else None,
        "libmpi_real": os.path.realpath(libmpi[0]) if libmpi else None,
    },
    "python": platform.python_version(),
    "packages": {d: version(d) for d in ("torch", "mpi4py", "numpy", "h5py", "hpcai",
                                         "horovod", "tensorflow-cpu", "keras")},
    "host_mount": "/opt/hpcai/host",
    "mount_points": {"host": "/opt/hpcai/host", "src": "/opt/hpcai/src",
                     "data": "/opt/hpcai/data", "out": "/opt/hpcai/out",
                     "work": "/opt/hpcai/work"},
    "layers": {"base": base, "python": python, "project": project},
}, indent=1))
PY
)
  printf '%s\n' "$manifest" >"$META/manifest.json.tmp"
  mv "$META/manifest.json.tmp" "$META/manifest.json"
else
  say "manifest: up to date"
fi

# ---------------------------------------------------------------- squash
if ((SQUASH)); then
  if [ -s "$IMG.sqfs" ] && [ "$IMG.sqfs" -nt "$META/manifest.json" ]; then
    say "squash: $IMG.sqfs up to date"
  else
    t=$SECONDS
    rm -f "$IMG.sqfs"
    if command -v ch-convert >/dev/null; then
      say "squash: ch-convert -i dir -o squash $IMG $IMG.sqfs"
      "${CH_ENV[@]}" ch-convert -i dir -o squash "$IMG" "$IMG.sqfs"
    else
      command -v mksquashfs >/dev/null ||
        die "neither ch-convert nor mksquashfs found" "apt-get install squashfs-tools"
      say "squash: mksquashfs $IMG $IMG.sqfs"
      mksquashfs "$IMG" "$IMG.sqfs" -noappend -all-root -no-xattrs -quiet -no-progress >/dev/null
    fi
    say "squash: done in $((SECONDS - t)) s ($(du -sh "$IMG.sqfs" | cut -f1))"
  fi
fi

say "ready: $IMG ($( ((changed)) && du -sh "$IMG" | cut -f1 || echo cached)) in $((SECONDS - START)) s"
