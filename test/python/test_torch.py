"""torch tensors: CPU tensors register through data_ptr(); GPU tensors need
kvlink's GPU support (not there yet), so they are refused clearly. Skipped
where torch is not installed."""

import pytest

import kvlink

torch = pytest.importorskip("torch")


def test_cpu_tensor_roundtrip():
    with kvlink.Engine() as a, kvlink.Engine() as b:
        src = torch.arange(4096, dtype=torch.int32)
        dst = torch.zeros(4096, dtype=torch.int32)
        a.register(src)
        seg = b.register(dst)
        peer = a.connect(b.local_address)
        a.write(peer, src.data_ptr(), 0, src.numel() * src.element_size(), segment=seg)
        assert torch.equal(src, dst)


def test_gpu_tensor():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    with kvlink.Engine() as a:
        t = torch.zeros(1024, device="cuda")
        with pytest.raises(kvlink.Error) as e:
            a.register(t)
        assert e.value.errc == "invalid_argument" and "GPU" in str(e.value)
