"""The start-up checks of the multi-node harness, without launching anything: the MoE settings
comparison and the checkpoint file check (their end-to-end twins are in test_multinode.py)."""

from __future__ import annotations

import pytest

from mok_megatron.training.consistency import describe_mismatch, moe_fingerprint
from mok_megatron.training.checkpoint_files import CheckpointError, check_checkpoint_files


def test_fingerprints_that_agree_describe_no_mismatch():
    fp = {"num_moe_experts": "8", "moe_router_topk": "2"}
    assert describe_mismatch([fp, dict(fp), dict(fp)]) is None


def test_mismatch_names_each_setting_and_the_ranks_per_value():
    fps = [{"num_moe_experts": "8", "moe_router_topk": "2"} for _ in range(4)]
    fps[2]["num_moe_experts"] = fps[3]["num_moe_experts"] = "16"
    fps[3]["moe_router_topk"] = "1"
    assert describe_mismatch(fps) == (
        "  moe_router_topk: 2 on ranks [0, 1, 2]; 1 on ranks [3]\n"
        "  num_moe_experts: 8 on ranks [0, 1]; 16 on ranks [2, 3]"
    )


def test_fingerprint_reads_the_moe_fields_of_a_config():
    from mok_megatron.tools.demo import DemoArgs, model_config

    fp = moe_fingerprint(model_config(DemoArgs(nproc=4, experts=8, topk=2), ep=4), extra={"layer": "mok"})
    assert (fp["num_moe_experts"], fp["moe_router_topk"], fp["expert_model_parallel_size"]) == ("8", "2", "4")
    assert fp["layer"] == "'mok'"


def test_checkpoint_check_names_what_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match=r"does not exist"):
        check_checkpoint_files(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match=r"has no metadata.json: .* Resume from an earlier checkpoint"):
        check_checkpoint_files(str(tmp_path))
    (tmp_path / "metadata.json").write_text("{}")
    (tmp_path / ".metadata").write_bytes(b"\x80\x04 truncated")
    with pytest.raises(CheckpointError, match=r"its index \(.metadata\) cannot be read"):
        check_checkpoint_files(str(tmp_path))
