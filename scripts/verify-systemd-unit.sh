#!/usr/bin/env bash
# Check configs/systemd/llamapool.service with `systemd-analyze verify`.
#
# The check runs on a temporary copy with ExecStart=/bin/true and without User=/Group=, so it
# passes on a machine where /opt/llamapool and the llamapool user do not exist. Because
# `systemd-analyze verify` exits 0 on many problems (unknown keys, bad values: "..., ignoring."),
# any diagnostic line that names the unit file counts as a failure too.
# Exit 0 (with a message) when systemd-analyze is not installed.
set -euo pipefail

src="${BASH_SOURCE[0]}"
[[ "$src" == */* ]] || src="./$src"
here="$(cd "${src%/*}" && pwd)"
unit="${1:-$here/../configs/systemd/llamapool.service}"
name="${unit##*/}"

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "SKIP: systemd-analyze not found (Debian: apt-get install systemd); $name not checked"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
sed -e 's|^ExecStart=.*|ExecStart=/bin/true|' -e '/^User=/d' -e '/^Group=/d' "$unit" > "$tmp/$name"

rc=0
out="$(cd "$tmp" && systemd-analyze verify --man=no "$tmp/$name" 2>&1)" || rc=$?
[[ -n "$out" ]] && printf '%s\n' "$out"
if (( rc != 0 )); then
    echo "FAIL: systemd-analyze verify exited $rc for $name"
    exit 1
fi
if grep -qF "$name" <<<"$out"; then
    echo "FAIL: systemd-analyze verify reported problems in $name"
    exit 1
fi
echo "OK: $name ($(systemd-analyze --version | head -n1))"
