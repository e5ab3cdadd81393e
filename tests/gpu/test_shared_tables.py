"""The node's shared Engram tables on CUDA (run on the device machine; not yet run): the read-only /dev/shm mapping
is page-locked by SharedTables.pin (cudaHostRegister portable | mapped | read-only), so Tensor.is_pinned() is True,
HostEngramTable takes the tensors as they are (no second registration, no copy), and the gather kernel reads them
over PCIe bit for bit as the golden EngramEmbedding does."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.engram_gather import HostEngramTable, engram_gather, engram_gather_ref
from engine.load import load_model
from engine.presets import tiny_config
from engine.tools.make_checkpoint import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_shared_tables_are_pinned_in_place_and_gathered_bitwise(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny_config(), seed=0)
    loaded = load_model(ckpt, "cuda", with_mtp=False, progress=False, shared_engram=True)
    host = loaded.engram_host
    assert host is not None and str(host.path).startswith("/dev/shm/")
    for layer in (loaded.model.layers[i] for i in loaded.cfg.engram_layer_ids):
        embed = layer.engram.embed
        assert embed.weight.device.type == "cpu" and embed.weight.is_pinned() and embed.scale.is_pinned()
        table = HostEngramTable.from_embedding(embed)
        assert table.pinned and table.weight.data_ptr() == embed.weight.data_ptr(), "used in place, not copied"
        ids = torch.randint(-1, embed.weight.size(0), (37, 24), device="cuda")
        got = engram_gather(table, ids)
        want = engram_gather_ref(embed, ids.cpu()).cuda()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    host.release()
