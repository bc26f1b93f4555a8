#!/bin/sh
# Install the Debian/Ubuntu packages named on the command line that the base lacks.
# A base that already has them all (the local test base, an air-gapped mirror image) needs no network.
set -eu
missing=""
for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $pkg"
    fi
done
if [ -z "$missing" ]; then
    echo "dzctl: system packages already present: $*"
    exit 0
fi
echo "dzctl: installing system packages:$missing"
apt-get update
# shellcheck disable=SC2086 # word splitting of the package list is intended
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
rm -rf /var/lib/apt/lists/*
