#!/bin/sh
# Make sure bubblewrap (`bwrap`) is installed: `kvcourse grade` runs every submission in a bwrap sandbox
# (course/grade/sandbox.py). `make test`, `make bench` and `make grade` call this.
# As root on Debian/Ubuntu it installs the `bubblewrap` package; otherwise it says how. It never fails the
# build: without bwrap, `kvcourse grade` stops with the same advice and the grading tests say why they skip.
command -v bwrap >/dev/null 2>&1 && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing bubblewrap for the sealed grader: apt-get install -y bubblewrap"
    if apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; then
        exit 0
    fi
    echo "apt-get could not install bubblewrap; kvcourse grade will refuse to grade until it is installed." >&2
    exit 0
fi

cat >&2 <<MSG
No bwrap (bubblewrap) on PATH, so kvcourse grade cannot seal submissions off and will refuse to grade. To fix:
  Debian/Ubuntu:  sudo apt-get install -y bubblewrap
  Fedora/RHEL:    sudo dnf install -y bubblewrap
  Arch:           sudo pacman -S bubblewrap
As a normal (non-root) user bwrap needs unprivileged user namespaces; if bwrap then fails with
"No permissions to create new namespace", ask an administrator to allow them
(sysctl kernel.unprivileged_userns_clone=1; Ubuntu 24.04: an AppArmor profile for bwrap) or to make
/usr/bin/bwrap setuid root.
MSG
exit 0
