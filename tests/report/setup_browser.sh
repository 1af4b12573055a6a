#!/usr/bin/env bash
# Installs what the report's browser tests need on a Debian/Ubuntu machine or CI image: the
# distribution's chromium (driven by Playwright's Python client with executable_path; never
# `playwright install`, which downloads its own browser). Idempotent; needs root or sudo.
# Also used by kaleido for the report's static PNG/SVG images.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    chromium --version
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
chromium --version
