# gpu_env.sh -- Sourced by the scripts that run on the lent GPU machine (tools/gpu_run.sh,
# tools/gpu_kv.sh), in the repository root: unpacks what tools/gpu_package.sh packed into .gpu/
# (PD_GPU_DIR), sets LD_LIBRARY_PATH for its libraries, OUT (logs, default /tmp/pd-gpu), G (the
# package folder) and PDSERVE_SHARED, and prints the GPUs.
OUT=${OUT:-/tmp/pd-gpu}
G=$PWD/${PD_GPU_DIR:-.gpu}
mkdir -p "$OUT"
LIB=/tmp/pd-gpu-lib
rm -rf "$LIB" && mkdir -p "$LIB"
unpack() { # unpack ARCHIVE DIR
    tar -xJf "$1" -C "$2" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$1" "$2" || { echo "cannot unpack $1"; exit 1; }
}
unpack "$G/lib.tar.xz" "$LIB"
# The binaries travel compressed (their CUDA code is mostly the same in each: 58 MB -> 2 MB).
[ -f "$G/bin.tar.xz" ] && unpack "$G/bin.tar.xz" "$G"
export LD_LIBRARY_PATH="$LIB/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuBLAS is not packed: when the toolkit's is missing, take a Python wheel's.
if ldd "$G/bin/test_cuda_backend" | grep -q 'not found'; then
    d=$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
    [ -n "$d" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
    ldd "$G/bin/test_cuda_backend" | grep 'not found' && echo "libraries missing"
fi
export PDSERVE_SHARED="$G/shared"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
# A build with PD_SANITIZE=ON cannot start CUDA (ASan's shadow memory: cudaGetDeviceCount
# answers "out of memory" for every binary), which reads like a broken machine: say so first.
if ldd "$G/bin/test_cuda_backend" | grep -q libasan; then
    echo "warning: $G was built with PD_SANITIZE=ON; CUDA will not start under ASan (package a" \
         "build configured with -DPD_SANITIZE=OFF)"
fi

