"""Test harness: ``launch`` starts torchrun agents on one host as if they were nodes, ``train_tiny`` is the
worker they run (also usable under a real multi-node torchrun); ``gpu`` holds what the GPU tests share."""
