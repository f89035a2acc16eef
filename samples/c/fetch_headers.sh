#!/usr/bin/env bash
# Fetch the ONNX Runtime C API headers into DEST/include (cached: a second run does nothing).
#
#   bash samples/c/fetch_headers.sh DEST
#
# The headers come from Debian 13 ("trixie")'s libonnxruntime-dev package (ONNX Runtime
# 1.21, C API version 21), downloaded with apt-get from a Debian 12 (or 13) machine
# without root: a temporary source list for the trixie suite, with its own package lists
# and cache, then `apt-get download` and `dpkg -x`. Only the headers are kept; the library
# is the one inside the onnxruntime Python wheel.
#
# Environment: DEBIAN_MIRROR overrides the mirror (default: the one in /etc/apt/sources.list*,
# else http://deb.debian.org/debian).
# Exit status: 0 headers in place; 3 could not download (no network, no apt-get); 1 other error.
set -euo pipefail

dest=${1:?usage: fetch_headers.sh DEST}
if [ -f "$dest/include/onnxruntime_c_api.h" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
    echo "fetch_headers.sh: apt-get and dpkg are needed to fetch libonnxruntime-dev" >&2
    exit 3
fi

# The configured Debian mirror: a "URIs:" line (deb822) or a "deb URL suite" line, not the security archive.
mirror=${DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
    2>/dev/null | grep -oE '(URIs:[[:space:]]*|^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?)https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
    | grep -oE 'https?://[^[:space:]]+' | head -n 1 || true)}
mirror=${mirror:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
if [ ! -f "$keyring" ]; then
    echo "fetch_headers.sh: $keyring not found (install debian-archive-keyring) to verify the trixie archive" >&2
    exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/parts" "$tmp/deb"
touch "$tmp/status"
echo "deb [signed-by=$keyring] $mirror trixie main" > "$tmp/sources.list"
apt_options=(
    -o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=$tmp/parts"
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "Dir::State::status=$tmp/status"
    -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)"
)
echo "fetch_headers.sh: downloading libonnxruntime-dev from $mirror (trixie)" >&2
if ! apt-get "${apt_options[@]}" -q update >"$tmp/update.log" 2>&1 \
        || grep -qE '^(W|E): (Failed to fetch|Some index files failed)' "$tmp/update.log"; then
    cat "$tmp/update.log" >&2
    echo "fetch_headers.sh: apt-get update of $mirror trixie failed (network?)" >&2
    exit 3
fi
if ! (cd "$tmp/deb" && apt-get "${apt_options[@]}" -q download libonnxruntime-dev >&2); then
    echo "fetch_headers.sh: apt-get download libonnxruntime-dev failed (network?)" >&2
    exit 3
fi
dpkg -x "$tmp"/deb/libonnxruntime-dev_*.deb "$tmp/x"
if [ ! -f "$tmp/x/usr/include/onnxruntime/onnxruntime_c_api.h" ]; then
    echo "fetch_headers.sh: the package has no usr/include/onnxruntime/onnxruntime_c_api.h" >&2
    exit 1
fi
mkdir -p "$dest"
rm -rf "$dest/include.partial"
cp -r "$tmp/x/usr/include/onnxruntime" "$dest/include.partial"
basename "$tmp"/deb/libonnxruntime-dev_*.deb > "$dest/include.partial/PACKAGE"
mv "$dest/include.partial" "$dest/include"
echo "fetch_headers.sh: headers in $dest/include ($(cat "$dest/include/PACKAGE"))" >&2
