"""Device probes for the CUDA-graph decode path (issue #24): does torch._grouped_mm run (bf16, offsets on
the device) and capture, and do the cuda backend's TileLang KV kernels launch on torch's current stream
(so a CUDA graph captures them)? Prints one line per probe."""

import torch

from deepinfer_kernels import get_backend


def probe_grouped_mm() -> None:
    e, d, i, n = 8, 512, 256, 96
    w = torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([10, 0, 30, 5, 20, 11, 0, 20], device="cuda")
    offs = torch.cumsum(counts, 0).to(torch.int32)
    try:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    except Exception as ex:
        print("grouped_mm: FAILED", type(ex).__name__, str(ex)[:200])
        return
    ref, s = torch.empty(n, i, device="cuda", dtype=torch.float32), 0
    for k, c in enumerate(counts.tolist()):
        ref[s : s + c] = x[s : s + c].float() @ w[k].float().t()
        s += c
    err = ((y.float() - ref).norm() / ref.norm()).item()
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    torch.cuda.current_stream().wait_stream(st)
    with torch.cuda.graph(g):
        y2 = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    g.replay()
    torch.cuda.synchronize()
    print(f"grouped_mm: ok rel err {err:.2e}; graph replay equal: {torch.equal(y2, y)}")


def probe_tilelang_capture() -> None:
    be = get_backend("cuda")
    pool = torch.zeros(64, 16, 528, dtype=torch.uint8, device="cuda")
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, 100, -1, 200, 5, 999, 64], device="cuda")
    store = be.op("kv_store")
    store(pool, x, slots, "fp8", check=False)
    ref = pool.clone()
    pool.zero_()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            store(pool, x, slots, "fp8", check=False)
        pool.zero_()
        g.replay()
        torch.cuda.synchronize()
        print("tilelang kv_store capture: ok, replay equal:", torch.equal(pool, ref))
    except Exception as ex:
        print("tilelang kv_store capture: FAILED", type(ex).__name__, str(ex)[:300])


if __name__ == "__main__":
    print("torch", torch.__version__, torch.cuda.get_device_name())
    probe_grouped_mm()
    probe_tilelang_capture()
