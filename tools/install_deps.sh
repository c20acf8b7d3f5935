#!/usr/bin/env bash
# install_deps.sh -- Installs every build and test dependency of pdserve from Debian packages.
# Idempotent: packages already present are not reinstalled, and apt-get runs only when
# something is missing. Needs root (or sudo).
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git            # toolchain
  libopenblas-dev                                  # CPU backend matrix products
  libjansson-dev                                   # JSON (config.json, tokenizer.json, ...)
  libxxhash-dev                                    # prefix-cache block hashes
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler  # gRPC services
  protobuf-compiler-grpc                           # grpc_python_plugin (test stubs)
  libucx-dev ucx-utils                             # KV transfer (+ ucx_perftest)
  libssl-dev                                       # KV transfer: HMAC-SHA256 (libcrypto)
  libpcre2-dev libutf8proc-dev                     # tokenizer
  libmicrohttpd-dev                                # metrics endpoint
  python3 python3-grpcio python3-protobuf          # external test client
  python3-yaml python3-prometheus-client           # deploy manifests, /metrics parser (tests)
  python3-jinja2                                   # chat-template vectors (tests/chat)
  python3-numpy                                    # independent FP8 references (test_quantize_cli.sh)
  iproute2                                         # network-namespace tests
  clang libclang-rt-14-dev                         # fuzz targets (libFuzzer is in clang-rt)
  openssl                                          # test certificates (TLS tests)
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PKGS[@]} packages present"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install_deps: need root to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
