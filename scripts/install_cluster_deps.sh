#!/usr/bin/env bash
# The cluster tier's system library: Mooncake Store's client loads libibverbs.so.1 at import, TCP
# included. Installed with apt-get when missing and running as root (CI); otherwise says what to do.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
else
  echo "the cluster tier needs libibverbs1 (apt-get install libibverbs1); its tests will be skipped" >&2
fi
