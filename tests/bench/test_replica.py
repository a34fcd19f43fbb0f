"""Arms of a benchmark (bench/replica.py): names with overrides of the synthesizer's config,
values read as YAML, nested keys dotted, the merged config validated as a replica's is."""
from __future__ import annotations

import pytest

from bench.replica import Arm
from deployments.synthesizer_config import SynthesizerConfig


def test_an_arm_is_a_name_and_dotted_overrides_read_as_yaml():
    assert Arm.parse("default") == Arm("default", {})
    arm = Arm.parse("edf:token2wav.deadline_slack_s=null, token2wav.scheduler=batch,cuda_graphs=false,dtype=float16")
    assert arm.name == "edf"
    assert arm.overrides == {"token2wav": {"deadline_slack_s": None, "scheduler": "batch"}, "cuda_graphs": False,
                             "dtype": "float16"}
    assert arm.describe() == "token2wav.deadline_slack_s=None, token2wav.scheduler=batch, cuda_graphs=False, dtype=float16"
    for bad in (":dtype=float32", "a:dtype", "a:=1", "a:token2wav=1,token2wav.scheduler=steps"):
        with pytest.raises(ValueError):
            Arm.parse(bad)


def test_an_arm_overrides_the_base_config_over_the_tools_settings():
    base = SynthesizerConfig(dtype="bfloat16", max_running=64, max_ongoing_requests=64,
                             token2wav={"max_batch_size": 16, "early_first_chunk": False})
    cfg = Arm.parse("a:token2wav.cv2_flow=recompute,max_running=32").config(
        base, {"max_ongoing_requests": 32, "token2wav": {"max_batch_size": 8}})
    assert (cfg.dtype, cfg.max_running, cfg.max_ongoing_requests) == ("bfloat16", 32, 32)
    t2w = cfg.token2wav  # the base's section kept, the tool's and the arm's keys set in it
    assert (t2w.max_batch_size, t2w.early_first_chunk, t2w.cv2_flow) == (8, False, "recompute")
    assert base.max_running == 64  # the base is not changed
    with pytest.raises(ValueError, match="arm 'b'"):  # the replica's own validation: slots for every request
        Arm.parse("b:max_running=8").config(base)
