#!/bin/sh
# install-deps.sh - the Debian 12 packages glmspark needs to build, test and run locally.
# Idempotent; run as root (or through sudo). Installs nothing from outside Debian's
# archive except npm packages that the browser/client tests declare in their package.json.
set -eu
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

PKGS="build-essential cmake ninja-build pkg-config git ca-certificates
      clang libclang-rt-dev
      libjson-c-dev libpcre2-dev libutf8proc-dev libssl-dev
      libpq-dev libfcgi-dev postgresql postgresql-client nginx-light openssl
      curl procps wrk slowhttptest
      shellcheck iproute2 openmpi-bin
      chromium fonts-dejavu-core"

missing=""
# Node.js may come from elsewhere (nodesource's nodejs bundles npm and conflicts with Debian's
# npm package): install Debian's only when the commands are missing.
command -v node >/dev/null 2>&1 || missing="$missing nodejs"
command -v npm >/dev/null 2>&1 || missing="$missing npm"
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "install-deps: installing$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
else
    echo "install-deps: all packages present"
fi
