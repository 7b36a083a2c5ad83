#!/usr/bin/env bash
# Apply megatron_oases' patch set to a Megatron-LM checkout, so that the checkout's own
# pretrain_gpt.py accepts --tp-backend, --schedule, ... (docs/megatron_lm.md).
#
#   scripts/apply_patches.sh [--check | --revert] PATH
#
# The patch set follows the checkout's release (megatron/core/package_info.py): core_v0.16.1,
# core_v0.17.x, core_v0.18.x or core_v0.19.x under patches/. Idempotent: patches already applied
# are skipped. Refuses (exit 1, nothing changed) another release, a git checkout away from that
# release's tags, and a file that is neither the upstream one nor our patched one.
# --check reports what would happen; --revert removes the patches again. Needs git (git apply).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUPPORTED="core_v0.16.1, core_v0.17.x, core_v0.18.x, core_v0.19.x"
PROG="apply_patches.sh"

die() { echo "$PROG: error: $*" >&2; exit "${2:-1}"; }
usage() { echo "usage: $PROG [--check | --revert] PATH  (PATH: a Megatron-LM checkout at $SUPPORTED)" >&2; exit 2; }

mode=apply
case "${1:-}" in
    --check) mode=check; shift ;;
    --revert) mode=revert; shift ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[[ $# -eq 1 ]] || usage
command -v git >/dev/null || die "git is needed (git apply); install git"
[[ -d "$1" ]] || die "$1 is not a directory; give the path of a Megatron-LM checkout"
ROOT="$(cd "$1" && pwd)"
[[ -f "$ROOT/pretrain_gpt.py" && -f "$ROOT/megatron/core/package_info.py" ]] \
    || die "$ROOT is not a Megatron-LM checkout (pretrain_gpt.py or megatron/core/package_info.py missing)"

# Release check: the version in package_info.py picks the patch set (TAG) and the tags HEAD may
# be at (TAG_GLOB); in a git checkout that has such tags, HEAD must be at one of them.
found="$(sed -n -E 's/^(MAJOR|MINOR|PATCH) *= *([0-9]+).*/\2/p' "$ROOT/megatron/core/package_info.py" | paste -sd. -)"
case "$found" in
    0.16.1) TAG=core_v0.16.1; TAG_GLOB=core_v0.16.1 ;;
    0.17.*|0.18.*|0.19.*) TAG="core_v${found%.*}.x"; TAG_GLOB="core_v${found%.*}.*" ;;
    *) die "$ROOT is Megatron-Core ${found:-unknown}; these patches are for $SUPPORTED; run: git -C $ROOT checkout core_v0.19.0" ;;
esac
PATCH_DIR="${PATCH_DIR:-$HERE/patches/$TAG}"
if [[ -e "$ROOT/.git" ]]; then
    release_tags="$(git -C "$ROOT" tag -l "$TAG_GLOB" 2>/dev/null || true)"
    at_tag="$(git -C "$ROOT" tag --points-at HEAD -l "$TAG_GLOB" 2>/dev/null || true)"
    if [[ -n "$release_tags" && -z "$at_tag" ]]; then
        die "$ROOT is at $(git -C "$ROOT" describe --tags --always HEAD 2>/dev/null || echo HEAD), not $TAG; run: git -C $ROOT checkout $(echo "$release_tags" | tail -n 1)"
    fi
fi

shopt -s nullglob
patches=("$PATCH_DIR"/*.patch)
[[ ${#patches[@]} -gt 0 ]] || die "no patches in $PATCH_DIR"

# git apply from inside the checkout, never discovering a repository above it.
gapply() { (cd "$ROOT" && GIT_CEILING_DIRECTORIES="$(dirname "$ROOT")" git apply "$@"); }
files_of() { sed -n -E 's|^\+\+\+ b/(.*)$|\1|p' "$1" | paste -sd' ' -; }

order=("${patches[@]}")
if [[ $mode == revert ]]; then
    order=(); for ((i = ${#patches[@]} - 1; i >= 0; i--)); do order+=("${patches[$i]}"); done
fi
for p in "${order[@]}"; do
    name="$(basename "$p")"
    if gapply --check -R "$p" 2>/dev/null; then
        state=applied
    elif gapply --check "$p" 2>/dev/null; then
        state=clean
    else
        die "$(files_of "$p") in $ROOT is neither $TAG's nor patched by $name (edited locally?); restore it with: git -C $ROOT checkout $TAG -- $(files_of "$p")"
    fi
    case "$mode:$state" in
        apply:applied)  echo "$name: already applied" ;;
        apply:clean)    gapply "$p"; echo "$name: applied" ;;
        revert:applied) gapply -R "$p"; echo "$name: reverted" ;;
        revert:clean)   echo "$name: not applied" ;;
        check:applied)  echo "$name: already applied" ;;
        check:clean)    echo "$name: would apply" ;;
    esac
done
