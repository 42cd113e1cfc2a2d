#!/usr/bin/env bash
# The linux-arm64 prebuild (NVIDIA Grace hosts are aarch64), cross-compiled with
# Debian's g++-aarch64-linux-gnu (glibc 2.36). Run by prepack before the x64
# prebuild, which leaves build/ an x64 build again. Without the cross compiler
# the tarball ships x64 only, and this says so: an arm64 prebuild left by an
# earlier pack is removed (prebuildify rewrites only the arch it builds), since
# it may not match this source.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  echo "nixl-node: aarch64-linux-gnu-g++ not found: packing without a linux-arm64 prebuild (apt-get install g++-aarch64-linux-gnu)" >&2
  rm -rf prebuilds/linux-arm64
  exit 0
fi
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
# prebuildify strips with whatever `strip` is first on PATH.
ln -s "$(command -v aarch64-linux-gnu-strip)" "$shim/strip"
# Never against an installed NIXL: those are this host's x86-64 libraries.
NIXL_NODE_NO_NIXL=1 PATH="$shim:$PATH" CC=aarch64-linux-gnu-gcc CXX=aarch64-linux-gnu-g++ LINK=aarch64-linux-gnu-g++ \
  npx prebuildify -t 20.20.2 --napi --strip --arch arm64
