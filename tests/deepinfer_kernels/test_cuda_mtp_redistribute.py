"""cuda ``mtp_redistribute`` (TileLang) against the torch reference: exact, ties and odd sizes included."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _ops():
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG
    cuda, ref = get_op("mtp_redistribute", "cuda"), get_op("mtp_redistribute", "reference")
    assert cuda is not ref
    return cuda, ref


@pytest.mark.parametrize(("r", "d"), [(1, 5), (7, 5), (300, 5), (64, 3), (0, 5)])
def test_matches_reference(r: int, d: int) -> None:
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(r * 10 + d)
    for trial in range(4):
        conf = torch.rand(r, d, generator=g, dtype=torch.float64)
        if trial % 2:  # coarse values: many exact ties in the cumulative rates
            conf = (conf * 4).round() / 4
        nd = torch.randint(0, d + 1, (r,), generator=g)
        total = int(torch.randint(0, r * d + 1, (1,), generator=g)) if r else 0
        want = ref(total, conf, nd)
        got = cuda(torch.tensor(total).cuda(), conf.float().double().cuda(), nd.cuda())
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
        assert int(got.sum()) == min(total, int(nd.clamp(0, d).sum()))


def test_float32_confidences_and_default_drafts() -> None:
    cuda, ref = _ops()
    conf = torch.rand(50, 5, device="cuda")
    assert torch.equal(cuda(77, conf), ref(77, conf))
