"""The routed experts: one module per GEMM backend, one module for Megatron's interface.

protocol.py     what the layer calls on its experts (``ExpertsBackend``) and each backend's class
                (``experts_class``); ``contract`` says what the experts take
                (``mok_megatron.experts_contract``)
grouped_mlp.py  ``MoKGroupedMLP``: Megatron's experts interface on stacked weights, backend ``torch``;
                checkpoints identical to ``SequentialMLP`` / ``TEGroupedMLP``
torch_mlp.py    the ``torch`` backend's GEMMs (bf16 ``torch._grouped_mm``), with delayed weight gradients
                and activation recompute
fp8_mlp.py      backend ``torch-fp8``: ``MoKFP8GroupedMLP`` (native rowwise FP8), including the permute fused
                into its operands
te.py           backend ``te``: ``MoKTEGroupedMLP`` (Transformer Engine GroupedLinear, Megatron's FP8 recipes)
common.py       what every backend shares: probabilities on the input, per-expert row padding
backend.py      which backend can run here, and its row alignment; recipes.py: the FP8 recipes
late_wgrad.py   the weight gradients of a layer call held until the last exchange flies
checkpoint.py   expert weights between MoK's and Megatron's layouts
"""
