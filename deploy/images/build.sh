#!/usr/bin/env bash
# Build Asteroid-Edge's container images without network inside any build:
#   1. the base, asteroid-edge/base:bookworm[-ARCH], a Debian bookworm root file system made
#      by mmdebstrap from the host's apt sources and loaded as an image of that architecture
#      (skipped when present);
#   2. a wheelhouse under deploy/build/ (the project's wheel and every dependency, torch
#      included), filled on the host from its package indexes;
#   3. asteroid-edge/{worker,control,redis}:VERSION and :latest from deploy/images/Dockerfile,
#      pip installing from the wheelhouse with --no-index.
# Usage: deploy/images/build.sh [--arch amd64|arm64]
# Environment: PYTHON (the project's interpreter, default .venv/bin/python), MIRROR (apt
# sources for mmdebstrap: a URL or a .sources/.list file; default the host's), TORCH (pin;
# default per architecture, below), PYFULL (the image's python3 version when its base cannot
# run here; default 3.11.2).
# arm64 on an x86-64 host: the base is made under qemu-user-static (binfmt_misc with
# qemu-aarch64 registered), the wheelhouse is downloaded for aarch64 without emulation.
set -euo pipefail
cd "$(dirname "$0")/../.."

ARCH=amd64
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) ARCH="${2:?--arch needs amd64 or arm64}"; shift 2 ;;
        --arch=*) ARCH="${1#--arch=}"; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$ARCH" in
    amd64) PLATFORM=x86_64 ;;
    arm64) PLATFORM=aarch64 ;;
    *) echo "error: --arch $ARCH: expected amd64 or arm64" >&2; exit 2 ;;
esac

# Another architecture's base and images run their programs under qemu-user-static: its
# binfmt_misc handler must be registered (with the F flag Debian's package sets, so that it
# also serves inside containers).
if [ "$PLATFORM" != "$(uname -m)" ] && ! head -n1 "/proc/sys/fs/binfmt_misc/qemu-$PLATFORM" 2>/dev/null | grep -qx enabled; then
    echo "error: $ARCH images on $(uname -m) need qemu: apt-get install qemu-user-static binfmt-support," \
        "then update-binfmts --enable qemu-$PLATFORM (where /proc/sys/fs/binfmt_misc is empty, first" \
        "mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc)" >&2
    exit 1
fi

PYTHON="${PYTHON:-.venv/bin/python}"
# A CPU build of torch, the same version on every architecture where one can be had. PyPI's
# aarch64 torch is a CPU build up to 2.10; from 2.11 on it is built for CUDA 13 and pulls
# gigabytes of CUDA wheels, so arm64 takes 2.10.0, the newest CPU one (wheelhouse.py --check
# refuses a CUDA torch). A cluster mixing the two trains exactly all the same
# (tests/integration/test_mixed_arch.py, `make test-arm64`).
case "$ARCH" in
    amd64) TORCH="${TORCH:-torch==2.13.0}" ;;
    arm64) TORCH="${TORCH:-torch==2.10.0}" ;;
esac
# Debian bookworm's python3 is 3.11: the wheelhouse must match it, whatever the host runs.
PYVER=3.11
BUILD=deploy/build
WHEELS="$BUILD/wheelhouse-$ARCH"
CONTEXT="$BUILD/context-$ARCH"
# a tag is [A-Za-z0-9_.-]: a local version's "+" becomes "-"
VERSION="$("$PYTHON" -c 'from common.version import VERSION; print(VERSION)' | tr '+' '-')"
SUFFIX=""
[ "$ARCH" = amd64 ] || SUFFIX="-$ARCH"
BASE="asteroid-edge/base:bookworm$SUFFIX"
# Only what the services need at run time: the interpreter and venv, OpenMP for torch,
# CA certificates, redis-server for the Redis image, and nothing to build with.
PACKAGES=python3,python3-venv,libgomp1,ca-certificates,redis-server

for tool in docker "$PYTHON"; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 1; }
done
docker info >/dev/null 2>&1 || { echo "error: no Docker engine answers (docker info)" >&2; exit 1; }

stamp() { date +%s; }
t_all=$(stamp)
mkdir -p "$BUILD"

# --- 1. the base -----------------------------------------------------------------------
# (a base of another architecture under this name, as `docker import` made on older engines,
# is made again)
if [ "$(docker image inspect --format '{{.Architecture}}' "$BASE" 2>/dev/null)" = "$ARCH" ]; then
    echo "base $BASE exists, kept"
else
    command -v mmdebstrap >/dev/null || { echo "error: mmdebstrap not found (apt-get install mmdebstrap)" >&2; exit 1; }
    if [ -z "${MIRROR:-}" ]; then
        MIRROR=http://deb.debian.org/debian
        for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
            if [ -s "$f" ]; then MIRROR="$f"; break; fi
        done
    fi
    t=$(stamp)
    rootfs="$BUILD/rootfs-$ARCH.tar"
    # Documentation, man pages and translations are dropped; apt's lists are cleaned.
    mmdebstrap --variant=minbase --architectures="$ARCH" --include="$PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --aptopt='Acquire::Languages "none"' \
        bookworm "$rootfs" "$MIRROR"
    # an image archive naming its architecture (rootfs_image.py says why not `docker import`)
    "$PYTHON" deploy/images/rootfs_image.py "$rootfs" --arch "$ARCH" --tag "$BASE" \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 | docker load >/dev/null
    rm -f "$rootfs"
    echo "base $BASE built in $(( $(stamp) - t )) s"
fi

# --- 2. the wheelhouse -------------------------------------------------------------------
# pip evaluates markers for the interpreter running it; wheelhouse.py then adds what the
# image's python3 needs beyond that (a dependency only older Pythons take).
pyfull="$(docker run --rm --network none --platform "linux/$ARCH" "$BASE" \
    python3 -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "${PYFULL:-3.11.2}")"
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
# The host's own interpreter resolves for itself when it matches the image's. Otherwise pip
# would evaluate the dependencies' markers for the host (x86_64 on an aarch64 download), so
# each wheel comes without its dependencies and wheelhouse.py names them, for the image.
NATIVE=0
[ "$("$PYTHON" -c 'import platform, sys; print(platform.machine(), sys.version_info[:2])')" = "$PLATFORM (3, 11)" ] && NATIVE=1
download() {
    if [ "$NATIVE" = 1 ]; then
        quiet "$PYTHON" -m pip download --quiet --dest "$WHEELS" --only-binary=:all: "$@"
    else
        quiet "$PYTHON" -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --no-deps \
            --platform "manylinux_2_28_$PLATFORM" --platform "manylinux2014_$PLATFORM" \
            --platform "manylinux_2_17_$PLATFORM" --platform "linux_$PLATFORM" \
            --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" "$@"
    fi
}
t=$(stamp)
rm -rf "$WHEELS" && mkdir -p "$WHEELS"
quiet "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$WHEELS" .
download "$TORCH" "$(ls "$WHEELS"/asteroid_edge-*.whl)"
for _ in 1 2 3 4 5 6 7 8 9 10; do
    mapfile -t lacking < <("$PYTHON" deploy/images/wheelhouse.py "$WHEELS" --python "$pyfull" --machine "$PLATFORM")
    [ ${#lacking[@]} -eq 0 ] && break
    echo "wheelhouse: adding ${lacking[*]} for python $pyfull"
    download "${lacking[@]}"
done
[ ${#lacking[@]} -eq 0 ] || { echo "error: wheelhouse still lacks ${lacking[*]}" >&2; exit 1; }
"$PYTHON" deploy/images/wheelhouse.py "$WHEELS" --python "$pyfull" --machine "$PLATFORM" --check
echo "wheelhouse $WHEELS: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), $(( $(stamp) - t )) s"

# --- 3. the images ---------------------------------------------------------------------
rm -rf "$CONTEXT" && mkdir -p "$CONTEXT"
mkdir -p "$CONTEXT/wheels" "$CONTEXT/project"
cp "$WHEELS"/*.whl "$CONTEXT/wheels/"
mv "$CONTEXT"/wheels/asteroid_edge-*.whl "$CONTEXT/project/"
cp deploy/images/entrypoint.py deploy/images/redis-entrypoint.py deploy/images/probe.py "$CONTEXT/"
cp deploy/redis.conf deploy/redis-acl.conf "$CONTEXT/"
for target in control worker redis; do
    t=$(stamp)
    docker build --quiet --platform "linux/$ARCH" --build-arg BASE="$BASE" \
        --build-arg VERSION="$VERSION" --target "$target" \
        -t "asteroid-edge/$target:$VERSION$SUFFIX" -t "asteroid-edge/$target:latest$SUFFIX" \
        -f deploy/images/Dockerfile "$CONTEXT" >/dev/null
    echo "image asteroid-edge/$target:$VERSION$SUFFIX built in $(( $(stamp) - t )) s"
done
rm -rf "$CONTEXT"
docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' 'asteroid-edge/*' | grep -E ":($VERSION|bookworm)$SUFFIX[[:space:]]" | sort
echo "images built in $(( $(stamp) - t_all )) s"
