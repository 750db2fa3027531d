"""The Megatron-Core adapter: layer, dispatcher and experts. Importing it checks the megatron-core version."""

from mok_megatron.compat import check_mcore_version

check_mcore_version()
