#!/usr/bin/env bash
# Debian packages pdkv's build, tests and benchmarks use. Run by `make` (every target
# that installs) and by .ci/run, so a fresh machine needs nothing done by hand.
#
#   libibverbs1    Mooncake's engine links it even for TCP (benchmark peer)
#   iproute2       network-namespace tests (`ip netns`, veth, tc)
#   etcd-server    discovery tests (docs/discovery.md)
#   libgtest-dev   C++ unit tests (ctest)
#   clang, libclang-rt-14-dev   libFuzzer targets and sanitizer runtimes
#   libssl-dev     libcrypto: the handshakes' HMAC-SHA256, X25519, PBKDF2 (cpp/src/core/auth.cc)
#   libzstd-dev, liblz4-dev, libxxhash-dev   the lossless codecs and the frame checksum (cpp/src/codec)
#
# Needs root (or password-less sudo) and apt-get; elsewhere it says what is missing
# and returns 0: the tests that need a package skip with a reason naming it.
set -uo pipefail
PKGS="libssl-dev libibverbs1 iproute2 libgtest-dev clang libclang-rt-14-dev etcd-server libzstd-dev liblz4-dev libxxhash-dev"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "sysdeps: no apt-get; install by hand:$missing (tests that need them will skip)"; exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "sysdeps: not root; install by hand:$missing (tests that need them will skip)"; exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null 2>&1 || true
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 || \
  echo "sysdeps: apt-get install$missing failed (tests that need them will skip)"
exit 0
