tar -xJf .gpu/bin.tar.xz -C .gpu; tar -xJf .gpu-li/bin.tar.xz -C .gpu-li
G=$PWD/.gpu
source <(sed -n '/^LIB=/,/^export PDSERVE_SHARED/p' tools/gpu_run.sh | sed 's|\$G|'$PWD'/.gpu|g')
[ -e /work/main ] || { mkdir -p /work && ln -s $PWD /work/main; }
ls -la /work/main/kernels/cuda/cuda_decode_layers.cu
NCU=/usr/local/cuda/bin/ncu
timeout 250 $NCU --kernel-name regex:decode_layers --launch-skip 20 --launch-count 1 --section WarpStateStats --section SourceCounters --import-source yes -o $OUT/rep \
  .gpu-li/bin/pdserve-generate --model tools/shapes/qwen3-0.6b --load-format dummy --backend cuda --kv-cache-mb 4096 --random-prompt-len 128 --max-tokens 40 --ignore-eos --temperature 0 --enforce-eager > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"
$NCU -i $OUT/rep.ncu-rep --page source --csv --print-source cuda,sass > $OUT/mix.csv 2>&1; xz -9 $OUT/mix.csv

ls -la $OUT; rm -f $OUT/rep.ncu-rep
