"""Torch-level operations the engines and experts compose, each with its autograd and input checks.

routing.py, permute.py   slot maps, permute / combine of token rows (fixed-order, deterministic)
grouped_gemm.py          ``torch._grouped_mm`` with its per-expert reference; fp8_grouped_gemm.py: native FP8
activation.py            the expert activations Megatron supports (GLU or not), fused SwiGLU on CUDA
router_gemm.py           the fp32 gating GEMM on bf16 tensor cores
align.py                 per-expert padding plans (e4m3 quantization: ``kernels.fp8_quant``)
fast.py                  the Triton-or-reference switch
"""
