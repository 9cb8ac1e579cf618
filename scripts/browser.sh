#!/usr/bin/env bash
# What the console's browser test needs: Debian's Chromium and ChromeDriver, and Selenium's
# Python bindings from PyPI (pinned). Installs what is missing; prints nothing otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh
# 4.52 needs a certifi newer than the package index may hold (seen here); 4.51 does not.
SELENIUM_VERSION=4.51.0
need_packages chromium=chromium chromedriver=chromium-driver
if ! python3 -c "import selenium, sys; sys.exit(selenium.__version__ != '$SELENIUM_VERSION')" 2>/dev/null; then
  printf 'tools: installing selenium %s from PyPI\n' "$SELENIUM_VERSION" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "selenium==$SELENIUM_VERSION"
fi
