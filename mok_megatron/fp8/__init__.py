"""FP8 foundations (issue 5): recipes, alignment padding, scaling, FP8 dispatch packing, and the native
``torch._scaled_grouped_mm`` expert GEMMs. The experts use them through ``--mok-expert-backend`` (default
bf16 ``torch``); FP8 token dispatch (``dispatch_pack``) is the pipeline's ``--mok-fp8-dispatch``.

    recipes         the FP8/FP4 recipes Megatron exposes, their row alignment and what each needs
    align           per-expert offsets padded to a recipe's alignment; the padded permute plan
    quantize        rowwise and 1x128 blockwise e4m3 quantize / dequantize (fp32 scales)
    dispatch_pack   FP8 token rows + scales packed into one uint8 row for one exchange
    native          rowwise-scaled FP8 grouped GEMMs (forward, dgrad, wgrad) on Hopper+
    token_experts   the native FP8 experts on token rows: permute / combine fused into their FP8 operands
    backend         --mok-expert-backend torch | torch-fp8 | te: checks and row alignment
    layers          MoK layers with an FP8 backend under Megatron's FP8 context (benchmarks, tests)
"""
