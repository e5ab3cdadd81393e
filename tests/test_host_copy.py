"""engine.host_copy: host tensors reach the device with their values, and a CUDA copy does not make the host wait."""

import pytest
import torch

from engine.host_copy import tensor_on, to_device

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_target_converts_the_dtype_and_keeps_the_values():
    t = torch.arange(-3, 5)
    out = to_device(t, "cpu", torch.int32)
    assert out.dtype == torch.int32 and out.tolist() == list(range(-3, 5))
    assert to_device(t, torch.device("cpu")) is t  # nothing to do: the same tensor
    assert tensor_on([[1, 0], [0, 1]], "cpu", torch.bool).tolist() == [[True, False], [False, True]]
    assert tensor_on([[]], "cpu", torch.long).shape == (1, 0)


@gpu
@needs_cuda
def test_cuda_copies_are_queued_and_their_host_blocks_are_not_reused_early():
    """While the stream sleeps (~0.2 s of cycles), 64 copies of distinct values are queued: the host returns from each
    with the stream still busy, and after the sleep every device tensor holds its own values (the caching host
    allocator did not hand a block to the next copy before its copy ran)."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # cycles: ~0.2 s at ~2 GHz
    outs = [to_device(torch.full((1000,), i, dtype=torch.int64), dev, torch.int32) for i in range(64)]
    ids = tensor_on(list(range(7)), dev, torch.long)
    assert not torch.cuda.current_stream().query(), "the host waited for the stream"
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert o.device.type == "cuda" and o.dtype == torch.int32 and bool((o == i).all()), f"copy {i} differs"
    assert ids.tolist() == list(range(7))
