"""The fixed CFM noise equals the official seed-0 buffer."""
import torch


def test_fixed_noise_matches_official_recipe():
    """First 512 frames of the CFM noise equal the stored head of the official buffer."""
    from safetensors.torch import load_file

    from cosyvoice_runtime.flow.cfm import fixed_noise
    from tests.runtime.parity.common import parity_dir

    heads = load_file(str(parity_dir() / "cfm_rand_noise_head.safetensors"))
    (name, head), = heads.items()
    ours = fixed_noise(80, 15000)[..., : head.shape[-1]]
    assert torch.equal(ours.reshape(head.shape), head), name
