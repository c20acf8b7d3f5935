#!/usr/bin/env bash
# gpu_package.sh -- Builds pdserve for the lent GPU machine (Release, -DPD_CUDA=ON, sm_90a) into
# build-gpu/ and packs what a run there needs into the git-ignored folder .gpu/: the CUDA test
# binaries, pdserve-generate and pdserve-bench-offline, the services (pdserve-prefill,
# pdserve-decode, pdserve-router, pdserve-cli and the pdserve-up launcher), the shared libraries
# they load that the GPU machine lacks (gRPC, protobuf-c, ...; xz-compressed: OpenBLAS alone is
# 36 MB), and the test models from the shared folder (stories260k and testdata/golden).
# tools/gpu_run.sh unpacks and runs it there.
#   PDSERVE_SHARED=DIR   shared folder (default ../shared)
#   PD_CUDA_ARCHS=LIST   CUDA architectures (default 90a)
#   PD_GPU_BUILD=DIR     build folder (default build-gpu)
#   PD_GPU_DIR=DIR       package folder, git-ignored (default .gpu; any /.gpu*/ name)
#   PD_GPU_EXTRA="T..."  further build targets to pack
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${PDSERVE_SHARED:-../shared}
B=${PD_GPU_BUILD:-build-gpu}
G=${PD_GPU_DIR:-.gpu}
BINS="test_cuda_backend test_cuda_golden test_cuda_sample test_cuda_comm test_cuda_tp test_cuda_tpkv test_cuda_fp8 test_cuda_kv_fp8 test_cuda_fp8_fused test_cuda_moe test_cpu_backend pdserve-generate
      pdserve-bench-offline pdserve-bench-kernels pdserve-bench-exchange pdserve-prefill
      pdserve-decode pdserve-router pdserve-cli ${PD_GPU_EXTRA:-}"

# PD_SANITIZE=OFF: a folder configured for ASan before keeps it cached, and CUDA does not
# start under ASan.
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DPD_CUDA=ON -DPD_SANITIZE=OFF \
      -DPD_CUDA_ARCHS="${PD_CUDA_ARCHS:-90a}" >/dev/null
# shellcheck disable=SC2086
cmake --build "$B" -j "$(nproc)" --target $BINS

rm -rf "$G"
mkdir -p "$G/bin" "$G/lib" "$G/shared/models" "$G/shared/testdata"
for b in $BINS; do cp "$B/bin/$b" "$G/bin/"; done
cp "$B/bin/pdserve-up" "$B/bin/pdserve-plan" "$G/bin/"

# Every library ldd resolves, except glibc, the GCC runtime, cuBLAS and UCX (the GPU machine has
# newer ones of the first two, CUDA 13.0 with cuBLAS under /usr/local/cuda (cuBLASLt is 540
# MB), and UCX 1.16 with its transport modules, which a copied libucp would not find).
# libcudart is small and goes along.
for b in $BINS; do ldd "$B/bin/$b"; done | awk '/=> \// {print $3}' | sort -u |
while read -r lib; do
    case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
    libcublas.so*|libcublasLt.so*) ;;
    libucp.so*|libucs.so*|libuct.so*|libucm.so*) ;;
    *) cp -L "$lib" "$G/lib/" ;;
    esac
done
tar -cJf "$G/lib.tar.xz" -C "$G" lib
rm -rf "$G/lib"
# The binaries too: each holds much the same CUDA code (a carry is at most 64 MiB). A window
# larger than the binaries (about 10 MB each) lets xz find each one in the previous one.
XZ_OPT="--lzma2=preset=6,dict=64MiB" tar -cJf "$G/bin.tar.xz" -C "$G" bin
rm -rf "$G/bin"

cp -r "$SHARED/models/stories260k" "$G/shared/models/"
cp -r "$SHARED/testdata/golden" "$G/shared/testdata/"
tar -tJf "$G/lib.tar.xz" | sed 's/^/  /'
du -sh "$G"
