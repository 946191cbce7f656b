#!/usr/bin/env bash
# Build the Containerfile's image with buildah, no daemon: what CI and this project's machines can run (docs/rpc.md,
# "The image"). From a fresh clone, as root:
#
#   apt-get install -y buildah debootstrap     # Debian's packages
#   tools/build_image.sh                       # -> localhost/ggml-hybrid:latest
#
# The base: python:3.11-slim-bookworm from Docker Hub where it can be pulled; where it cannot (no route to Docker Hub:
# this project's machines reach only PyPI and Debian's packages), one made from Debian's packages instead: debootstrap
# of bookworm (python3 3.11, python3-venv, ca-certificates) committed as localhost/ggml-hybrid-base:bookworm, and the
# Containerfile built with BASE set to it.
#
# Options:  --tag NAME      the image's name (default localhost/ggml-hybrid:latest)
#           --base IMAGE    build on IMAGE, no pull and no debootstrap
#           --debootstrap   make the Debian base even where Docker Hub answers
#           --clean         remove the images this script made (and their build containers), then exit
# Environment: STORAGE_DRIVER (default vfs: works without overlay), BUILDAH_ISOLATION (default chroot: works without
# user namespaces), DEBIAN_MIRROR (default http://deb.debian.org/debian), PIP_CERT (a CA bundle for pip, where a proxy
# re-signs TLS; default: pip's own `cert` setting), passed to the build as a secret, never kept in the image.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=localhost/ggml-hybrid:latest
base=""
force_debootstrap=0
clean=0
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        --base) base="$2"; shift 2 ;;
        --debootstrap) force_debootstrap=1; shift ;;
        --clean) clean=1; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

hub_base=docker.io/library/python:3.11-slim-bookworm
debian_base=localhost/ggml-hybrid-base:bookworm
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"
export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if ! command -v buildah >/dev/null; then
    echo "error: buildah is not installed (Debian: apt-get install -y buildah)" >&2; exit 1
fi
b() { buildah --storage-driver "$STORAGE_DRIVER" "$@"; }

if [ "$clean" -eq 1 ]; then
    for image in "$tag" "$debian_base"; do
        if b inspect --type image "$image" >/dev/null 2>&1; then b rmi -f "$image" >/dev/null; echo "removed $image"; fi
    done
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

make_debian_base() {
    if ! command -v debootstrap >/dev/null; then
        echo "error: debootstrap is not installed (Debian: apt-get install -y debootstrap)" >&2; exit 1
    fi
    local ctr mnt
    ctr=$(b from scratch)
    mnt=$(b mount "$ctr")
    echo "making $debian_base: debootstrap bookworm from $mirror" >&2
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$mnt" "$mirror" \
        >"$work/debootstrap.log" 2>&1; then
        b rm "$ctr" >/dev/null
        echo "error: debootstrap of bookworm from $mirror failed:" >&2; tail -5 "$work/debootstrap.log" >&2; exit 1
    fi
    rm -rf "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/lib/apt/lists/*
    b umount "$ctr" >/dev/null
    b config --env LANG=C.UTF-8 --cmd '["python3"]' "$ctr"
    b commit -q --rm "$ctr" "$debian_base" >/dev/null
}

if [ -z "$base" ]; then
    if [ "$force_debootstrap" -eq 0 ] && b pull -q "$hub_base" >/dev/null 2>"$work/pull.err"; then
        base="$hub_base"
    else
        [ "$force_debootstrap" -eq 1 ] || echo "$hub_base cannot be pulled ($(tail -1 "$work/pull.err")):" \
            "a base from Debian's packages instead" >&2
        b inspect --type image "$debian_base" >/dev/null 2>&1 || make_debian_base
        base="$debian_base"
    fi
fi

secret=()
cert="${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}"
if [ -n "$cert" ]; then
    [ -f "$cert" ] || { echo "error: pip's CA bundle $cert is not a file" >&2; exit 1; }
    secret=(--secret "id=pip-ca,src=$cert")
fi

revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
echo "building $tag on $base (revision $revision)" >&2
start=$(date +%s)
b build --isolation "$BUILDAH_ISOLATION" "${secret[@]}" --build-arg "BASE=$base" \
    --label "org.opencontainers.image.revision=$revision" -f Containerfile -t "$tag" .
echo "built $tag in $(( $(date +%s) - start )) s" >&2
