"""What the machine is, in one place: ``doctor`` shows it, ``compare`` records it beside every figure and chooses its
default precisions from it.

Everything here reads the host (``/proc/cpuinfo``, ``torch.cuda``, package metadata) and never raises: a fact that
cannot be read is reported as unknown.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from lightning_precision._imports import installed_version

__all__ = ["cpu_info", "describe", "describe_cpu", "machine_info"]

# The instruction sets that decide low-precision speed on a CPU, by their /proc/cpuinfo flag, with their usual name.
CPU_ISA = {
    "avx2": "AVX2",
    "avx512f": "AVX512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_fp16": "AVX512-FP16",
    "amx_bf16": "AMX-BF16",
    "amx_fp16": "AMX-FP16",
    "amx_int8": "AMX-INT8",
}
_NATIVE = {"bf16": {"avx512_bf16", "amx_bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}
# Packages whose versions decide the figures of a report.
PACKAGES = ("lightning-precision", "torch", "lightning", "torchmetrics", "torchao", "transformer-engine",
            "transformers")


def _cpuinfo() -> list[dict[str, str]]:
    """One dict per logical CPU of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().strip().split("\n\n")
    except OSError:
        return []
    cpus = []
    for block in blocks:
        entry = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            entry[key.strip()] = value.strip()
        cpus.append(entry)
    return cpus


def cpu_info() -> dict[str, Any]:
    """Model, physical cores, logical CPUs, torch's threads and the low-precision instruction sets of this CPU."""
    cpus = _cpuinfo()
    flags = set(cpus[0].get("flags", "").split()) if cpus else set()
    cores = {(c.get("physical id"), c.get("core id")) for c in cpus if "core id" in c}
    return {
        "model": (cpus[0].get("model name") if cpus else None) or platform.processor() or platform.machine(),
        "physical_cores": len(cores) or None,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "isa": [name for flag, name in CPU_ISA.items() if flag in flags],
        "native_bf16": bool(flags & _NATIVE["bf16"]),
        "native_fp16": bool(flags & _NATIVE["fp16"]),
    }


def gpu_info() -> list[dict[str, Any]]:
    """Name, compute capability and memory of every visible CUDA device."""
    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append({
            "index": i,
            "name": torch.cuda.get_device_name(i),
            "capability": f"{major}.{minor}",
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        })
    return gpus


def machine_info() -> dict[str, Any]:
    """The machine as a report records it: OS, Python, CPU, GPUs and package versions (None: not installed)."""
    return {
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu": cpu_info(),
        "gpus": gpu_info(),
        "torch_cuda": torch.version.cuda,
        # torch's own version string: it names the build (+cpu, +cu126), which its package metadata may not
        "packages": {name: torch.__version__ if name == "torch" else installed_version(name) for name in PACKAGES},
    }


def describe_cpu(cpu: dict[str, Any]) -> str:
    """One line: "AMD EPYC, 2 cores / 2 threads, AVX2 AVX512 AVX512-BF16 (bf16 native, fp16 emulated)"."""
    cores = f"{cpu['physical_cores']} cores / " if cpu.get("physical_cores") else ""
    isa = " ".join(cpu["isa"]) or "no AVX2"
    native = ", ".join(f"{fmt} {'native' if cpu[f'native_{fmt}'] else 'emulated'}" for fmt in ("bf16", "fp16"))
    return f"{cpu['model']}, {cores}{cpu['logical_cpus']} threads, {isa} ({native})"


def describe(machine: dict[str, Any], device: str = "cpu") -> str:
    """The machine a figure was measured on, in one line, for the device the run used."""
    torch_version = machine["packages"].get("torch")
    if device != "cpu" and machine["gpus"]:
        gpu = machine["gpus"][0]
        return (f"{gpu['name']} (compute capability {gpu['capability']}, {gpu['memory_gib']:.0f} GiB),"
                f" torch {torch_version}")
    return f"{describe_cpu(machine['cpu'])}, torch {torch_version}"
