#!/usr/bin/env bash
# What the console's browser test needs: Debian's Chromium and ChromeDriver, Python 3, and
# Selenium's Python bindings. Installs what is missing; prints nothing otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh
# From PyPI, for a Python of its own (pyenv, a virtualenv): 4.52 needs a certifi newer than
# the package index may hold (seen here); 4.51 does not.
SELENIUM_VERSION=4.51.0
need_packages chromium=chromium chromedriver=chromium-driver python3=python3
if ! python3 -c "import selenium" 2>/dev/null; then
  if [ "$(python3 -c 'import sys; print(sys.prefix)')" = /usr ]; then
    # Debian's own Python refuses pip installs (PEP 668): Debian's Selenium (4.8 in Debian
    # 12; the story passes the driver's path, which every Selenium 4 takes).
    install_debian_packages python3-selenium
  else
    printf 'tools: installing selenium %s from PyPI\n' "$SELENIUM_VERSION" >&2
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "selenium==$SELENIUM_VERSION"
  fi
fi
