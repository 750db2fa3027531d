"""The packages: mok_megatron and its subpackages, mok_megatron.patches, which pyproject's package-dir
builds from the repository's top-level patches/ (the Megatron-LM patch set's one source), and the
planner's data folder (JSON only, no __init__). pyproject.toml holds everything else."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["mok_megatron*"]),
        "mok_megatron.patches",
        "mok_megatron.tools.planner.data",
    ]
)
