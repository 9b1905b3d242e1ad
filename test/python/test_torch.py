"""torch tensors: CPU tensors register through data_ptr(); CUDA tensors are
device memory, registered and transferred through the engine's CUDA runtime
(skipped without a GPU or a kvlink built with kvlink::cuda; the same paths
run on the emulated device in test_device.py). Skipped where torch is not
installed."""

import subprocess
import sys
from pathlib import Path

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


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False)")
    if not kvlink._kvlink.HAS_CUDA:
        pytest.skip("this kvlink module was built without kvlink::cuda")


def test_gpu_tensor_write_and_read():
    _cuda_or_skip()
    with kvlink.Engine(transports="tcp", device="cuda", use_env=False) as a, \
            kvlink.Engine(transports="tcp", device="none", use_env=False) as b:
        src = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
        host = torch.zeros(1 << 18, dtype=torch.int32)
        n = src.numel() * src.element_size()
        a.register(src)
        seg = b.register(host)
        peer = a.connect(b.local_address)
        torch.cuda.synchronize()
        a.write(peer, src.data_ptr(), 0, n, segment=seg)
        assert torch.equal(host, src.cpu())
        host.neg_()
        a.read(peer, src.data_ptr(), 0, n, segment=seg)
        assert torch.equal(src.cpu(), host)


def test_gpu_tensor_view_registers_its_storage():
    _cuda_or_skip()
    with kvlink.Engine(device="cuda", use_env=False) as a:
        base = torch.zeros(2, 1024, device="cuda", dtype=torch.uint8)
        view = base[:, 1:]  # not contiguous; its storage from data_ptr() on
        sid = a.register(view)
        seg = [s for s in a.segments() if s.id == sid][0]
        assert seg.base == view.data_ptr() and seg.length == 2 * 1024 - 1


def test_gpu_tensor_without_a_device_runtime():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False)")
    with kvlink.Engine(device="none", use_env=False) as a:
        with pytest.raises(kvlink.Error) as e:
            a.register(torch.zeros(1024, device="cuda"))
        assert e.value.errc == "invalid_argument" and "device runtime" in str(e.value)


def test_vllm_pattern_example_with_cuda_kv_caches():
    """examples/python/vllm_pattern.py --memory cuda: prefill and decode in
    two processes, each KV cache a torch CUDA tensor registered per layer by
    data_ptr() with the "cuda:0" location; decode checks every block."""
    _cuda_or_skip()
    example = Path(__file__).resolve().parents[2] / "examples" / "python" / "vllm_pattern.py"
    done = subprocess.run([sys.executable, str(example), "--memory", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda memory on both sides" in done.stdout, done.stdout
    assert "results {0}, blocks with wrong bytes: 0" in done.stdout, done.stdout
