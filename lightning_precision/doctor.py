"""``lightning-precision doctor``: what this machine can do for low precision, and what to use."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from typing import Optional

import torch

from lightning_precision.fp8 import MXFP8_MIN_CAPABILITY, fp8_capable


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2])


def _imports_cleanly(module: str) -> tuple[bool, str]:
    """Import in a child process: a broken build (torchvision for another torch) or IPEX beside the wrong torch
    (which calls os._exit) must not take this process down."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, last[:100]


def package_rows() -> list[tuple[str, str, str]]:
    torch_mm = _major_minor(torch.__version__)
    rows = [("python", platform.python_version(), "ok"), ("torch", torch.__version__, f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build")]
    for dist in ("lightning", "torchmetrics", "transformers"):
        v = _version(dist)
        rows.append((dist, v or "not installed", "ok" if v else "-"))
    ao = _version("torchao")
    rows.append(("torchao", ao or "not installed", "ok (fp8 backend)" if ao else "pip install 'lightning-precision[fp8]'"))
    te = _version("transformer-engine") or _version("transformer_engine")
    rows.append(("transformer-engine", te or "not installed",
                 "ok" if te and _major_minor(te) >= (2, 9) else ("needs >= 2.9" if te else "CUDA only: lightning-precision[te]")))
    ipex = _version("intel-extension-for-pytorch")
    if ipex is None:
        rows.append(("intel-extension-for-pytorch", "not installed", "not needed: upstream torch has torch.xpu"))
    else:
        same = _major_minor(ipex) == torch_mm
        rows.append(("intel-extension-for-pytorch", ipex, "ok" if same else
                     f"INCOMPATIBLE with torch {torch.__version__} (importing it would exit the process)"))
    tv = _version("torchvision")
    if tv is None:
        rows.append(("torchvision", "not installed", "optional (pretrained weights, FashionMNIST download)"))
    else:
        ok, why = _imports_cleanly("torchvision")
        rows.append(("torchvision", tv, "ok" if ok else f"BROKEN with this torch: {why}"))
    return rows


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def device_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(device, bf16, fp16, fp8, notes, recommended)."""
    flags = _cpu_flags()
    native_bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})
    rows = [(
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "native" if native_bf16 else "emulated (slow)",
        "native" if "amx_fp16" in flags or "avx512_fp16" in flags else "emulated (slow)",
        "emulated only (FP8Precision(emulate=True))",
        "AMX" if "amx_bf16" in flags else ("AVX512-BF16" if native_bf16 else "no bf16 instructions"),
        "BF16MixedPrecision" if native_bf16 else "32-true for speed; mixed precisions to test numerics",
    )]
    for i in range(torch.cuda.device_count()):
        cc = torch.cuda.get_device_capability(i)
        fp8 = "yes" + (", MXFP8" if cc >= MXFP8_MIN_CAPABILITY else "") if fp8_capable(cc) else "no (needs 8.9)"
        recommended = "FP8Precision for large layers, else BF16MixedPrecision" if fp8_capable(cc) else (
            "BF16MixedPrecision" if cc >= (8, 0) else "FP16MixedPrecision")
        rows.append((f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{cc[0]}{cc[1]})", "yes" if cc >= (8, 0) else "no",
                     "yes", fp8, f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB", recommended))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        for i in range(torch.xpu.device_count()):
            props = torch.xpu.get_device_properties(i)
            fp16 = "yes" if getattr(props, "has_fp64", True) else "autocast only (no fp64: no GradScaler)"
            rows.append((f"xpu:{i} {torch.xpu.get_device_name(i)}", "yes", fp16, "no", "Intel GPU",
                         "XPUPrecision() (bf16)"))
    if torch.backends.mps.is_available():
        rows.append(("mps", "yes", "yes", "no", "Apple GPU", "BF16MixedPrecision"))
    return rows


def main(argv: list[str]) -> int:
    from rich.table import Table

    from lightning_precision._console import console as make_console

    console = make_console()
    packages = Table(title="packages")
    for column in ("package", "version", "status"):
        packages.add_column(column)
    for row in package_rows():
        packages.add_row(*row)
    devices = Table(title="devices")
    for column in ("device", "bf16", "fp16", "fp8", "notes", "recommended"):
        devices.add_column(column)
    for row in device_rows():
        devices.add_row(*row)
    console.print(packages)
    console.print(devices)
    return 0
