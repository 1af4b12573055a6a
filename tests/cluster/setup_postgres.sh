#!/usr/bin/env bash
# Installs what tests/cluster's shared-store tests need on a Debian/Ubuntu machine or CI image:
# the distribution's PostgreSQL server (initdb, pg_ctl; started by the tests themselves on
# 127.0.0.1 in a temporary folder, never as a system service). Idempotent; needs root or sudo.
# Debian keeps the server binaries in /usr/lib/postgresql/VERSION/bin, off PATH: the tests
# look there too (tests/cluster/_servers.py). Also iproute2's `ip`, which test_two_nodes.py
# uses to bring up `lo` in the loopback-only network namespace its Ray cluster runs in.
set -euo pipefail
found="$(command -v initdb || ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | tail -n 1 || true)"
if [ -n "$found" ] && command -v ip >/dev/null 2>&1; then
    "$found" --version
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
if ! command -v ip >/dev/null 2>&1; then
    $SUDO apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
fi
if [ -n "$found" ]; then
    "$found" --version
    exit 0
fi
# postgresql-common's postinst would create and start a `main` cluster on port 5432: the
# policy-rc.d answer 101 keeps the service from starting; the tests start their own server.
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
fi
$SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null
ls /usr/lib/postgresql/*/bin/initdb | tail -n 1 | xargs -I{} {} --version
