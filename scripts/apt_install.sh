#!/usr/bin/env bash
# Installs the given Debian packages when any is missing; shared by the backends' setup scripts.
# Usage: apt_install.sh NAME SKIP_NOTE PACKAGE...
#   NAME prefixes the messages, SKIP_NOTE says what skips when the packages cannot be installed.
# Idempotent: prints nothing when all packages are already present.
set -euo pipefail

name="$1"
skip_note="$2"
shift 2
missing=()
for package in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    # Not fatal: without the packages the tests that need them skip (and say why); everything else still runs.
    echo "$name: cannot install ${missing[*]} without root; $skip_note" >&2
    exit 0
  fi
fi

echo "$name: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
