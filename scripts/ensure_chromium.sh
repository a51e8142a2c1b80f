#!/bin/sh
# Make sure Chromium is installed for the browser tests (tests/e2e). `make test` calls this.
# Playwright drives the system's Chromium; it never downloads a browser of its own.
# As root on Debian/Ubuntu it installs the `chromium` package; otherwise it says how, and the browser
# tests skip with the same message. It never fails the build.
CHROMIUM="${KVCOURSE_CHROMIUM:-/usr/bin/chromium}"
[ -x "$CHROMIUM" ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing Chromium for the browser tests: apt-get install -y chromium"
    if apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; then
        exit 0
    fi
    echo "apt-get could not install chromium; the browser tests will be skipped." >&2
    exit 0
fi

cat >&2 <<MSG
No Chromium at $CHROMIUM, so the browser tests (tests/e2e) will be skipped. To run them:
  Debian:  sudo apt-get install -y chromium
  other:   install Chromium or Chrome and set KVCOURSE_CHROMIUM=/path/to/the/binary
MSG
exit 0
