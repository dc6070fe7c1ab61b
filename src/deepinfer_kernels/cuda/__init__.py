"""CUDA kernels (TileLang) and DeepSeek-library adapters, one module per op.

Importing this package requires a CUDA build of torch; each module imports tilelang or its library
inside a try block so one missing library disables only its own op.
"""

import torch

if not torch.cuda.is_available():  # keep CPU machines from importing tilelang at all
    raise ImportError("deepinfer_kernels.cuda needs a CUDA device")
