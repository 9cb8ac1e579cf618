#!/usr/bin/env bash
# What the console's browser test needs: Debian's Chromium and ChromeDriver, and Selenium's
# Python bindings from PyPI (pinned). Installs what is missing; prints nothing otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh
SELENIUM_VERSION=4.52.0
need_packages chromium=chromium chromedriver=chromium-driver
if ! python3 -c "import selenium, sys; sys.exit(selenium.__version__ != '$SELENIUM_VERSION')" 2>/dev/null; then
  printf 'tools: installing selenium %s from PyPI\n' "$SELENIUM_VERSION" >&2
  python3 -m pip install --quiet --disable-pip-version-check "selenium==$SELENIUM_VERSION"
fi
