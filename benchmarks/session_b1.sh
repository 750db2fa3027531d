#!/usr/bin/env bash
# One device call on 2 x H200: issue 4 (GPU 0) and issue 5 (GPU 1) side by side, each on its own GPU.
set -u
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
r=/tmp/b1; mkdir -p $r/i4 $r/fp8
CUDA_VISIBLE_DEVICES=0 T_TESTS=100 T_PROFILE=45 T_PEERS=80 T_TITAN_EAGER=45 T_TITAN=90 OUT=$r/i4 \
  bash benchmarks/issue4_h200.sh > $r/i4.txt 2>&1 & p4=$!
CUDA_VISIBLE_DEVICES=1 timeout 260 python3 benchmarks/fp8_h200.py --with-tests --budget-s 220 --out $r/fp8 > $r/fp8.txt 2>&1
echo "fp8 rc=$?" >> $r/fp8.txt
wait $p4
tar czf $OUT/b1.tgz -C /tmp b1
echo "######## issue 4"; cat $r/i4.txt | cut -c1-220
echo "######## issue 5"; tail -60 $r/fp8.txt | cut -c1-220
