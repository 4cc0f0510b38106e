r"""
The whole tree step compiled ahead of time with its weights frozen in: `StaticStep` over plain weights, exported
and compiled by AOTInductor into one package on disk, which later processes load in seconds.

The products are most of a step (64% on this project's Xeon with AMX). oneDNN's packed bf16 products, which the
in-process graphs of `static_step.py` call, stream the weights at about 14 GB/s there; inductor's own AMX
micro-kernels, over weights it lays out itself when it compiles, do the same products in about half the time
(docs/experiments.md). Inductor lays out only weights it sees as constants, and its disk cache does not keep such
graphs (their laid-out constants do not pickle), so each process would spend minutes compiling again. An
AOTInductor package keeps the compiled code and the laid-out weights together.

It applies where the micro-kernels pay and the packages fit: bf16 on a CPU with AMX tiles, backbones of up to 1 GB
(`applies`); elsewhere the in-process graphs step. A package is named by a digest of the weights, the tree, this
code, torch's version and the thread count, so a changed model or release compiles afresh instead of loading a stale
step.
"""

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from medusa_heads.backbone import cache_home, first_line, weight_bytes
from medusa_heads.cpu_ops import has_amx
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from .acceptance import StepRule
from .cache import BUCKET

logger = logging.getLogger(__name__)

CONTEXT = 16  # the example step's context: the windows and the caches' sizes are dynamic in the package
PARTIAL, LOADING = "partial-", "loading-"  # a package being written; a folder a package is unpacked into
# A package holds the weights laid out (1.5 times the bf16 weights with the heads) and a process loads one per tree:
# `generate` peaks at 2.6 GB resident for the 270 MB default with two trees, so a 7B model's would not fit this way
MAX_WEIGHT_BYTES = 1 << 30
KEEP_BYTES = 4 << 30  # packages kept in the cache folder at most (a 135M model's is ~400 MB), the least recent go


def applies(model: MedusaModel) -> bool:
    """Whether `model`'s whole steps take frozen packages: bf16 on a CPU with AMX, a backbone of at most
    `MAX_WEIGHT_BYTES`."""
    like = model.backbone.get_input_embeddings().weight
    size = weight_bytes(model.backbone)
    return like.device.type == "cpu" and like.dtype == torch.bfloat16 and size <= MAX_WEIGHT_BYTES and has_amx()


class _Exportable(nn.Module):
    """A `StaticStep` as the module `torch.export` takes."""

    def __init__(self, step: Callable):
        super().__init__()
        self.step = step

    def forward(self, root, state, sampling, chain, length, key_slots, kv, own_cache):
        return self.step(root, state, sampling, chain, length, key_slots, kv, own_cache)


def package_path(model: MedusaModel, tree: TreeBuffers, top_k: int, chain: bool, rule: StepRule | None = None) -> Path:
    """Where the package of `model`'s whole step on `tree` (with the n-gram branch if `chain`, accepting by `rule`:
    greedy if None) is kept: named by a digest of the weights, the step's code, the tree, the rule, the software and
    the threads. The root alone (plain decoding) has no drafting: its package is the backbone's whatever the heads."""
    drafts = tree.size > 1
    digest = hashlib.blake2b(_weights_digest(model.backbone), digest_size=16)
    modules = ["medusa_heads.fast_llama", "medusa_heads.inference.static_step", "medusa_heads.inference.frozen_step",
               "medusa_heads.inference.acceptance", "medusa_heads.inference.sampling"]
    if drafts:
        digest.update(_weights_digest(model.heads))
        modules += ["medusa_heads.inference.drafters.heads", "medusa_heads.inference.drafters.eagle3_tree",
                    "medusa_heads.fast_eagle3", type(model.heads).__module__]
    for name in modules:
        digest.update(Path(sys.modules[name].__file__).read_bytes())
    # the thread count too: inductor's products split their work among the threads it compiles for
    for part in (torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), tree.paths,
                 top_k, chain, rule):
        digest.update(repr(part).encode())
    return cache_home() / "steps" / f"{digest.hexdigest()}.pt2"


_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, bytes]]" = weakref.WeakKeyDictionary()


def _weights_digest(module: nn.Module) -> bytes:
    """A digest of the bytes of `module`'s weights, hashed again only where a tensor changed since (about 0.3 s for
    the default's 270 MB): a tensor's version counts its in-place writes."""
    tensors = module.state_dict().values()
    seen = tuple((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in tensors)
    if module in _WEIGHTS and _WEIGHTS[module][0] == seen:
        return _WEIGHTS[module][1]
    digest = hashlib.blake2b(digest_size=32)
    for tensor in tensors:
        digest.update(repr((tensor.dtype, tuple(tensor.shape))).encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    _WEIGHTS[module] = seen, digest.digest()
    return _WEIGHTS[module][1]


def _export(step: Callable, tree: TreeBuffers, args: tuple) -> torch.export.ExportedProgram:
    """`step` on `tree` exported for arguments like `args` (`StaticSteps.scratch_args`), over any window and cache
    size."""
    root, state, sampling, chain, length, key_slots, kv, own_cache = args
    cache = torch.export.Dim("cache", min=key_slots.shape[0], max=1 << 24)
    window = torch.export.Dim("window", min=tree.size + 1, max=1 << 24)
    own = ()
    if own_cache:  # the drafter's key slots, keys and values; its windows are rounded up to buckets
        own_window = torch.export.Dim("own_window", min=BUCKET, max=1 << 24)
        own_size = torch.export.Dim("own_size", min=own_cache[0].shape[0], max=1 << 24)
        own = ({0: own_window}, {2: own_size}, {2: own_size})
    shapes = (None, (None,) * len(state), (None,) * len(sampling), None, None, {0: window},
              [({2: cache}, {2: cache}) for _ in kv], own)
    return torch.export.export(_Exportable(step), args, dynamic_shapes=shapes)


def load_or_build(model: MedusaModel, tree: TreeBuffers, top_k: int, chain: bool, rule: StepRule | None,
                  plain_step: Callable[[], tuple[Callable, tuple]]) -> Callable:
    """The frozen package of `model`'s whole step on `tree` (with the n-gram branch if `chain`, accepting by `rule`),
    loaded from the cache folder, or built there first (again, where the one there does not load) from
    `plain_step()`: that `StaticStep` over plain weights and example arguments; called as `StaticStep` is."""
    path = package_path(model, tree, top_k, chain, rule)
    if path.exists():
        try:
            os.utime(path)  # recently used: `prune` keeps it
            return _load(path)
        except Exception as err:  # a truncated or foreign file: its loader's errors have no common base
            logger.warning("%s does not load (%s): compiling it again", path, first_line(err))
    _build(tree, *plain_step(), path)
    prune(path.parent, keep=path)
    return _load(path)


def _load(path: Path) -> Callable:
    """The package at `path`, loaded. Its loader unpacks it (its libraries, the weights among them) into a folder
    under TMPDIR that it deletes only when the loaded step is collected, which the end of a process skips: here it
    unpacks into a folder of ours, deleted once loaded (the libraries stay mapped)."""
    unpacked = tempfile.mkdtemp(prefix=LOADING, dir=path.parent)
    tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = unpacked
    try:
        return torch._inductor.aoti_load_package(str(path))
    finally:
        if tmpdir is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = tmpdir
        shutil.rmtree(unpacked, ignore_errors=True)


def prune(folder: Path, keep: Path, limit: int = KEEP_BYTES) -> None:
    """Delete the least recently used packages of `folder` (other than `keep`) while they hold more than `limit`
    bytes: each changed model, tree or release of this code makes new ones. Also what builds and loads stopped over a
    day ago left."""
    for stopped in (*folder.glob(f"{PARTIAL}*"), *folder.glob(f"{LOADING}*")):
        if time.time() - stopped.stat().st_mtime > 86400:
            shutil.rmtree(stopped) if stopped.is_dir() else stopped.unlink(missing_ok=True)
    packages = sorted((p for p in folder.glob("*.pt2") if not p.name.startswith(PARTIAL)),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for package in packages:
        total += package.stat().st_size
        if total > limit and package != keep:
            logger.info("Deleting %s, the least recently used whole-step package", package)
            package.unlink(missing_ok=True)


def _build(tree: TreeBuffers, step: Callable, args: tuple, path: Path) -> None:
    logger.info("Compiling the whole step of a %d-node tree ahead of time, its weights laid out for this CPU: a few "
                "minutes once, then loaded from %s", tree.size, path.parent)
    with torch.no_grad():
        program = _export(step, tree, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The weights are the exported graph's constants, which inductor's C++ GEMM template lays out for its AMX
    # micro-kernels (and then drops, where nothing else reads them: `plain_product`); max_autotune: those kernels
    # or ATen's, whichever times faster here for each product (its tables not printed). Not `freezing`: its
    # constant folding deletes a constant that another node of the graph still reads (torch 2.13).
    options = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
               "emulate_precision_casts": True, "autotune_num_choices_displayed": 0,
               "max_autotune_report_choices_stats": False}
    handle, partial = tempfile.mkstemp(prefix=PARTIAL, suffix=".pt2", dir=path.parent)  # the compiler wants .pt2
    os.close(handle)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(TypedStorage|LeafSpec)")  # torch's own deprecations
            torch._inductor.aoti_compile_and_package(program, package_path=partial, inductor_configs=options)
        os.replace(partial, path)  # whole or not at all: a stopped build leaves no package behind
    finally:
        Path(partial).unlink(missing_ok=True)
