#!/usr/bin/env bash
# Puts promtool and prometheus into .tools/bin (used by tests/operator/test_monitoring.py), without root.
# Idempotent: a no-op when both are already there.
#
# Debian's `prometheus` package ships both (statically built Go, needing only libc). `apt-get download` fetches
# the .deb into the working directory as any user, and `dpkg-deb -x` unpacks it anywhere; nothing is installed.
# If this machine's package lists are missing or stale (404), they are fetched into a private directory first.
# Failure to fetch is not fatal here: the promtool tests then skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.tools/bin
PKG=prometheus

if [ -x "$BIN/promtool" ] && [ -x "$BIN/prometheus" ]; then
  exit 0
fi
for tool in apt-get dpkg-deb; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "get-promtool: $tool not found (not Debian?); install promtool and prometheus into $BIN yourself" >&2
    exit 0
  fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download() {  # extra apt-get options, e.g. a private list directory
  (cd "$tmp" && apt-get download "$@" "$PKG" >download.out 2>download.err)
}
if ! download; then
  # Private lists: `apt-get update` writes only there, so no root is needed (the sources are the system's).
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  private=(-o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o Debug::NoLocking=1)
  if ! apt-get "${private[@]}" update >"$tmp/update.out" 2>&1 || ! download "${private[@]}"; then
    echo "get-promtool: 'apt-get download $PKG' failed (no Debian registry access?); promtool tests will skip:" >&2
    sed 's/^/  /' "$tmp/download.err" "$tmp/update.out" >&2 || true
    exit 0
  fi
fi
deb=$(ls "$tmp"/"$PKG"_*.deb)
dpkg-deb -x "$deb" "$tmp/root"
mkdir -p "$BIN"
for tool in promtool prometheus; do
  install -m 0755 "$tmp/root/usr/bin/$tool" "$BIN/$tool.partial"
  mv -f "$BIN/$tool.partial" "$BIN/$tool"
done
echo "get-promtool: $("$BIN/promtool" --version 2>&1 | head -n 1) in $BIN"
