#!/usr/bin/env bash
# The patch series (vendor/patches) as git commits over the pinned GGML, and as `git format-patch` files.
#
#   tools/export_patches.sh [--repo DIR] [--out DIR] [--stop-before NNNN] [--write]
#
# Makes a git repository of the pinned GGML (the archive vendor/pin.json names, fetched and checked by the build),
# commits it as the pin, and applies the series in order, one commit per patch: `git am` for a patch in mail form
# (its message, author and date kept), `git apply` for a plain diff (its leading text is the commit's message).
# Then `git format-patch -N --zero-commit --no-signature` of everything after the pin, into --out (default
# REPO/export). Prints the repository's path.
#
#   --repo DIR         the repository: made there (DIR must not exist), or, when DIR is one this script made,
#                      only exported again (after commits were amended, reordered or added: `git rebase -i pin`)
#   --stop-before NNNN apply the series up to that patch only (to rebase or change it, then apply the rest)
#   --write            the export replaces vendor/patches/*.patch; a patch the series keeps as a plain diff stays as
#                      it is, byte for byte (0007: its bytes key the Vulkan backend's cached build); delete it first
#                      to have it written in mail form
#
# Exporting the series unchanged gives vendor/patches back byte for byte (tests/test_patch_series.py).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
repo="" out="" stop="" write=0
while [ $# -gt 0 ]; do
    case "$1" in
        --repo) repo="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --stop-before) stop="$2"; shift 2 ;;
        --write) write=1; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "export_patches.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
python="${PYTHON:-python3}"
git_id=(-c user.name="ggml-hybrid export" -c user.email="export@ggml-hybrid.invalid")

if [ -n "$repo" ] && [ -d "$repo/.git" ]; then
    git -C "$repo" rev-parse --verify -q pin >/dev/null || {
        echo "export_patches.sh: $repo has no tag 'pin' (not made by this script)" >&2; exit 2; }
else
    repo="${repo:-$(mktemp -d "${TMPDIR:-/tmp}/ggml-series.XXXXXX")}"
    mkdir -p "$repo"
    # the pinned archive, fetched and checked against its sha256 as the build does, and GGML's folder in it
    read -r archive ggml_path < <(cd "$root" && "$python" -c '
from ggml_hybrid_build import paths, pin
p = paths.info.load_pin()
print(pin.fetch_archive(p), p["ggml_path"].rstrip("/"))')
    depth=$(($(tr -cd / <<<"$ggml_path" | wc -c) + 1))
    tar -xzf "$archive" -C "$repo" --strip-components="$depth" "$ggml_path"
    git -C "$repo" init -q
    git -C "$repo" add -A
    GIT_AUTHOR_DATE="1970-01-01T00:00:00Z" GIT_COMMITTER_DATE="1970-01-01T00:00:00Z" \
        git "${git_id[@]}" -C "$repo" commit -q -m "the pinned GGML ($(basename "$archive"), $ggml_path)"
    git -C "$repo" tag pin
    for p in "$root"/vendor/patches/*.patch; do
        name="$(basename "$p")"
        if [ -n "$stop" ] && [[ "$name" == "$stop"* ]]; then
            break
        fi
        if head -1 "$p" | grep -q '^From [0-9a-f]\{40\} '; then
            git "${git_id[@]}" -C "$repo" am -q --keep-cr "$p"
        else
            # a plain diff: what comes before its first file header is its message, its name the subject
            git -C "$repo" apply "$p"
            git -C "$repo" add -A
            { echo "${name#[0-9][0-9][0-9][0-9]-}" | sed 's/\.patch$//'; echo
              sed -n '/^\(diff --git \|--- \)/q;p' "$p"; } |
                git "${git_id[@]}" -C "$repo" commit -q -F -
        fi
    done
fi

out="${out:-$repo/export}"
rm -rf "$out"
git -C "$repo" format-patch -q -N --zero-commit --no-signature -o "$out" pin..HEAD
if [ "$write" = 1 ]; then
    for p in "$out"/*.patch; do
        name="$(basename "$p")"
        kept="$root/vendor/patches/$name"
        if [ -f "$kept" ] && ! head -1 "$kept" | grep -q '^From [0-9a-f]\{40\} '; then
            echo "kept $name (a plain diff)" >&2
            continue
        fi
        cp "$p" "$root/vendor/patches/$name"
    done
    # patches the export no longer has
    for p in "$root"/vendor/patches/*.patch; do
        [ -f "$out/$(basename "$p")" ] || { echo "removed $(basename "$p")" >&2; rm "$p"; }
    done
fi
echo "$repo"
