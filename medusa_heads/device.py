r"""
What this machine's processor is, and the cache files named after it: latency profiles and `medusa-heads tune`'s
record are measurements of one device, so a file written on one CPU is never read on another.
"""

import platform
import re
from pathlib import Path

import torch

from .backbone import cache_home

# The instruction sets a CPU's decoding speed turns on (bf16 and int8 products, AMX tiles), as /proc/cpuinfo names them.
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_description(cpuinfo: str, machine: str) -> tuple[str, list[str]]:
    """(the CPU's name with its family and model numbers, the `CPU_FEATURES` it has) from /proc/cpuinfo's text.
    The numbers tell apart generations that a virtual machine names alike (an "AMD EPYC" of family 25 or 26
    decodes at about half or the whole speed of the other)."""
    fields = dict(re.findall(r"^(model name|cpu family|model|flags)\s*:\s*(.*)$", cpuinfo, re.MULTILINE))
    name = fields.get("model name", "").strip() or platform.processor() or "cpu"
    family, model = fields.get("cpu family", "").strip(), fields.get("model", "").strip()
    generation = f", family {family} model {model}" if family and model else ""
    flags = set(fields.get("flags", "").split())
    return f"{name} ({machine}{generation})", [f for f in CPU_FEATURES if f in flags]


def device_name(device: torch.device) -> str:
    """The processor's model name: the GPU's, or the CPU's from /proc/cpuinfo (with its family and model) where
    there is one."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_description(_cpuinfo(), platform.machine())[0]


def cpu_features() -> list[str]:
    """The `CPU_FEATURES` this machine's CPU has (empty where /proc/cpuinfo is not there)."""
    return cpu_description(_cpuinfo(), platform.machine())[1]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cache_file(*parts: str) -> Path:
    """The file named by `parts` (model, what, device, dtype, threads) among the cached measurements of devices."""
    slug = "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", part).strip("-") for part in parts)
    return cache_home() / "profiles" / f"{slug}.json"
