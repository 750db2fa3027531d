"""The ``mok`` tools: ``env`` (what this machine has), ``demo`` (the main job), ``recipe`` (check a recipe's
layout and memory), ``planner`` (``mok plan``: MoK vs Megatron at cluster scale from measurements)."""
