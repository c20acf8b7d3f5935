for g in .gpu .gpu-prev; do tar -xJf $g/bin.tar.xz -C $g; done
G=$PWD/.gpu
source <(sed -n '/^LIB=/,/^export PDSERVE_SHARED/p' tools/gpu_run.sh | sed 's|\$G|'$PWD'/.gpu|g')
run() { # label pkg model prompt
  local l=$1 v=$2 m=$3 n=$4
  printf "%-8s %-11s %5s: " "$l" $m $n
  timeout 60 $v/bin/pdserve-generate --model tools/shapes/$m --load-format dummy --backend cuda --kv-cache-mb 4096 --random-prompt-len $n --max-tokens 256 --ignore-eos --temperature 0 > $OUT/gen.log 2>&1; echo -n "rc=$? "
  grep -o "decode [0-9.]* tok/s" $OUT/gen.log || tail -3 $OUT/gen.log
}
for n in 128 1000; do for r in 1 2 3; do run prev .gpu-prev qwen3-0.6b $n; run cols .gpu qwen3-0.6b $n; done; done
for r in 1 2; do run prev .gpu-prev llama3-8b 128; run cols .gpu llama3-8b 128; done
timeout 200 stdbuf -oL .gpu/bin/test_cuda_backend > $OUT/tcb.log 2>&1; echo "test_cuda_backend rc=$?"; tail -1 $OUT/tcb.log
timeout 150 stdbuf -oL .gpu/bin/test_cuda_golden > $OUT/tcg.log 2>&1; echo "test_cuda_golden rc=$?"; tail -1 $OUT/tcg.log
