#!/usr/bin/env bash
# Installs the system packages the tests need and that are missing: sshd (the SSH
# target and the simulated pods), PostgreSQL (the server test on Postgres), Chromium
# (the UI tests). Runs `apt-get update` only when something is missing; does nothing
# when everything is there. `make test` runs it first.
set -euo pipefail
missing=()
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then missing+=(openssh-server); fi
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then missing+=(postgresql); fi
if ! command -v chromium >/dev/null 2>&1; then missing+=(chromium); fi
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "test-deps: missing ${missing[*]} and no apt-get here: install them, then run \`make test\` again" >&2
    exit 1
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "test-deps: missing ${missing[*]}: install them as root (\`apt-get install -y ${missing[*]}\`), then run \`make test\` again" >&2
        exit 1
    fi
    sudo=(sudo)
fi
echo "test-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
