"""DeepSeek's kernel libraries (FlashMLA, DeepGEMM, DeepSelect) seen from this project, without a GPU.

- :mod:`.layouts`: the pure-torch conversions from the project's formats to each library's layout at its
  boundary (one documented function per conversion), importable and tested on any CPU;
- :mod:`.switch`: which libraries the cuda backend uses (``DEEPINFER_KERNEL_LIBS``).

The calls into the libraries themselves are in ``deepinfer_kernels.cuda.adapters`` (CUDA only).
"""

from deepinfer_kernels.libs.switch import AUTO_LIBRARIES, SWITCHABLE, enabled, selected

__all__ = ["AUTO_LIBRARIES", "SWITCHABLE", "enabled", "selected"]
