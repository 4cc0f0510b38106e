r"""
The C++ operators of CPU decoding (`csrc/packed_linear.cpp`), built once into the medusa-heads cache folder: the
packed products a compiled graph calls by index (`compiled_llama.py`), and the bf16 panel products that replace
oneDNN's where they are faster (`packing.py`).
"""

import logging
import platform
import sys
from functools import lru_cache
from pathlib import Path

import torch

from .home import cache_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "packed_linear.cpp"


def load_packed_linear() -> str | None:
    """Make `torch.ops.medusa_heads.packed_linear` (and the others) available, building them once into the cache
    folder; None when they are, else why not (in words)."""
    if hasattr(torch.ops.medusa_heads, "packed_linear"):
        return None
    from torch.utils.cpp_extension import load  # imported here: it looks for a compiler and ninja

    folder = cache_home() / "ops" / f"torch-{torch.__version__}"
    # torch's own OpenMP runtime, already loaded, runs the panel products on its threads
    openmp = ["-fopenmp"] if sys.platform == "linux" else []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        load(name="medusa_heads_ops", sources=[str(SOURCE)], build_directory=str(folder), is_python_module=False,
             extra_cflags=["-O2", *openmp], extra_ldflags=openmp)
    except (OSError, RuntimeError, ImportError, SystemExit) as err:  # no compiler, no ninja, no headers
        lines = str(err).strip().splitlines()
        return f"the packed-product operator could not be built ({lines[0] if lines else type(err).__name__})"
    torch.library.register_fake("medusa_heads::packed_linear")(_packed_linear_shape)
    torch.library.register_fake("medusa_heads::panel_linear")(_panel_linear_shape)
    return None


def _packed_linear_shape(x: torch.Tensor, index: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _panel_linear_shape(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], panels.shape[0] * panels.shape[2]))


@lru_cache(maxsize=1)
def panel_products() -> bool:
    """Whether `torch.ops.medusa_heads.panel_linear` runs here (built, on a CPU with AVX512-BF16)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    why_not = load_packed_linear()
    if why_not is not None:
        logger.info("bf16 products stay oneDNN's: %s", why_not)
        return False
    return torch.ops.medusa_heads.has_panels()


def has_amx() -> bool:
    """Whether this CPU computes with AMX tiles (asking the kernel for them; False without them)."""
    return getattr(torch._C._cpu, "_init_amx", lambda: False)()


@lru_cache(maxsize=1)
def panels_by_default() -> bool:
    """Whether bf16 products are panel products unless the user says otherwise: on CPUs with AVX512-BF16 and no
    AMX (there oneDNN's AMX kernels are the faster ones)."""
    return panel_products() and not has_amx()
