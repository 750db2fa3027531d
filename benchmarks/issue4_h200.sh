#!/usr/bin/env bash
# Issue 4 on one H200 (<= ~150 s): GPU tests of the wired kernels, the layer profile, and mok bench layer
# on Qwen3-30B-A3B and the DeepSeek-V3 slice (uniform routing, median of 20). Run from the repo root:
#   OUT=/some/dir bash benchmarks/issue4_h200.sh
# Writes $OUT/{gpu_tests,profile_layer,layer-peers,layer-titan-eager,layer-titan-compiled}.txt (+ .json/.png)
# and prints a summary.
# Each step has its own timeout (seconds, overridable) so that one slow step cannot eat the others.
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
py=python3
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
timeout ${T_TESTS:-50} $py -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs -s \
  tests/test_kernels.py tests/test_layer_launches.py "tests/test_gpu.py::test_layer_parity_vs_megatron_on_gpu" \
  "tests/test_gpu.py::test_layer_parity_vs_te_grouped_mlp_and_te_spec" \
  "tests/test_gpu.py::test_mok_layer_is_bitwise_deterministic_on_gpu" 2>&1 \
  | grep -v -i warn | tail -40 > "$out/gpu_tests.txt"
echo "== gpu tests ($(el)): $(tail -1 "$out/gpu_tests.txt")"
grep -E "CUDA kernels/memsets per step|FAILED|Error" "$out/gpu_tests.txt" | head -12
timeout ${T_PROFILE:-18} $py benchmarks/profile_layer.py qwen3-30b-a3b deepseek-v3-ep32 2>&1 | grep -v -i warn \
  > "$out/profile_layer.txt"
echo "== profile ($(el))"; grep "^== " "$out/profile_layer.txt"
timeout ${T_PEERS:-37} $py -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 --routing uniform \
  --iters 20 --impl mok,megatron,megatron-te,plain-pytorch --json "$out/layer-peers.json" \
  --png "$out/layer-peers.png" 2>&1 | grep -v -i warn > "$out/layer-peers.txt"
echo "== bench peers ($(el))"; grep -E "^(###|\| (mok|megatron|plain))" "$out/layer-peers.txt"
# torchtitan: eager on both shapes first (always fits), then compiled (torch.compile) on the Qwen3 shape.
MOK_BENCH_TORCHTITAN_COMPILE=0 timeout ${T_TITAN_EAGER:-20} $py -m mok_megatron.cli bench layer \
  --shape qwen3-30b-a3b,deepseek-v3-ep32 --routing uniform --iters 20 --impl mok,torchtitan \
  --json "$out/layer-titan-eager.json" 2>&1 | grep -v -i warn > "$out/layer-titan-eager.txt"
echo "== bench torchtitan eager ($(el))"; grep -E "^(###|\| (mok|torchtitan))" "$out/layer-titan-eager.txt"
timeout ${T_TITAN:-25} $py -m mok_megatron.cli bench layer --shape ${TITAN_SHAPES:-qwen3-30b-a3b} --routing uniform \
  --iters 20 --impl mok,torchtitan --json "$out/layer-titan-compiled.json" 2>&1 | grep -v -i warn \
  > "$out/layer-titan-compiled.txt"
echo "== bench torchtitan compiled ($(el); an empty table = compile ran past T_TITAN)"
grep -E "^(###|\| (mok|torchtitan))" "$out/layer-titan-compiled.txt"
