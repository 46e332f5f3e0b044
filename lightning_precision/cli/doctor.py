"""``lightning-precision doctor``: what this machine can do for low precision, and what to use."""

from __future__ import annotations

import argparse
import json
import platform

import torch
from lightning_utilities.core.imports import RequirementCache
from rich.text import Text

from lightning_precision import _imports
from lightning_precision._core.devices import bf16_capable
from lightning_precision._imports import installed_version as _version
from lightning_precision.cli.machine import cpu_info, describe_cpu, machine_info
from lightning_precision.fp8._hardware import FP8_MIN_CAPABILITY, MXFP8_MIN_CAPABILITY, fp8_capable

__all__ = ["main"]


def _optional_row(package: str, available: RequirementCache, ok: str, missing: str) -> tuple[str, str, str]:
    """An optional package's row: ``ok`` when it meets ``_imports``' requirement, ``missing`` when absent."""
    version = _version(package)
    status = ok if available else f"needs {available.requirement}" if version else missing
    return package, version or "not installed", status


def _ipex_row() -> tuple[str, str, str]:
    version = _version(_imports.IPEX)
    if version is None:
        return _imports.IPEX, "not installed", "not needed: upstream torch has torch.xpu"
    usable, _ = _imports.ipex_status()
    return _imports.IPEX, version, "ok" if usable else (
        f"INCOMPATIBLE with torch {torch.__version__} (importing it would exit the process)")


def _package_rows() -> list[tuple[str, str, str]]:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    rows = [("python", platform.python_version(), "ok"), ("torch", torch.__version__, build)]
    for dist in ("lightning", "torchmetrics", "transformers"):
        v = _version(dist)
        rows.append((dist, v or "not installed", "ok" if v else "-"))
    rows.append(_optional_row("torchao", _imports.TORCHAO_AVAILABLE, "ok (fp8 backend)",
                              _imports.install_command("torchao")))
    rows.append(_optional_row("transformer-engine", _imports.TRANSFORMER_ENGINE_AVAILABLE, "ok",
                              f"CUDA only: lightning-precision[{_imports.EXTRA_OF['transformer-engine']}]"))
    rows.append(_ipex_row())
    tv = _version("torchvision")
    if tv is None:
        rows.append(("torchvision", "not installed", "optional (pretrained weights, FashionMNIST download)"))
    else:
        ok, why = _imports.imports_cleanly("torchvision")
        rows.append(("torchvision", tv, "ok" if ok else f"BROKEN with this torch: {why}"))
    return rows


# Every recommendation rests on what the hardware has (instruction sets, compute capability), never on a measured
# speed: on a CPU with native bf16, bf16-mixed has measured slower than fp32 on some models. Each row says so and
# names the command that measures it.
_MEASURE = "not a measured speed: `lightning-precision compare` measures each precision's speed on this machine"


def _cpu_row(cpu: dict) -> tuple[str, str, str, str, str, str, str]:
    if cpu["native_bf16"]:
        found = " ".join(name for name in cpu["isa"] if "BF16" in name)
        recommended = "BF16MixedPrecision if `compare` finds it faster, else 32-true"
        basis = (f"native bf16 instructions ({found}), {_MEASURE} (bf16-mixed can still be slower than fp32 on a"
                 " CPU: casts, operations without bf16 kernels)")
    else:
        recommended = "32-true for speed; mixed precisions to test numerics"
        basis = (f"no native bf16 or fp16 instructions (such as AVX512-BF16, AMX-BF16: both run emulated, slowly),"
                 f" {_MEASURE}")
    return (
        f"cpu: {describe_cpu(cpu).split(' (')[0]}",
        "native" if cpu["native_bf16"] else "emulated (slow)",
        "native" if cpu["native_fp16"] else "emulated (slow)",
        "emulated only (FP8Precision(emulate=True))",
        f"torch uses {cpu['torch_threads']} threads",
        recommended,
        basis,
    )


def _device_rows() -> list[tuple[str, str, str, str, str, str, str]]:
    """(device, bf16, fp16, fp8, notes, recommended, basis): ``basis`` is what the recommendation rests on."""
    rows = [_cpu_row(cpu_info())]
    for i in range(torch.cuda.device_count()):
        cc = torch.cuda.get_device_capability(i)
        fp8 = ("yes" + (", MXFP8" if cc >= MXFP8_MIN_CAPABILITY else "") if fp8_capable(cc)
               else f"no (needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]})")
        recommended = "FP8Precision for large layers, else BF16MixedPrecision" if fp8_capable(cc) else (
            "BF16MixedPrecision" if bf16_capable(cc) else "FP16MixedPrecision")
        bf16 = "yes" if bf16_capable(cc) else "no"
        basis = f"compute capability {cc[0]}.{cc[1]} (the formats its tensor cores compute), {_MEASURE}"
        rows.append((f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{cc[0]}{cc[1]})", bf16, "yes", fp8,
                     f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB", recommended, basis))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        for i in range(torch.xpu.device_count()):
            props = torch.xpu.get_device_properties(i)
            fp16 = "yes" if getattr(props, "has_fp64", True) else "autocast only (no fp64: no GradScaler)"
            rows.append((f"xpu:{i} {torch.xpu.get_device_name(i)}", "yes", fp16, "no", "Intel GPU",
                         "XPUPrecision() (bf16)", f"Intel GPUs' native bf16, {_MEASURE}"))
    if torch.backends.mps.is_available():
        rows.append(("mps", "yes", "yes", "no", "Apple GPU", "BF16MixedPrecision",
                     f"Apple GPUs' native bf16 and fp16, {_MEASURE}"))
    return rows


_PACKAGE_COLUMNS = ("package", "version", "status")
_DEVICE_COLUMNS = ("device", "bf16", "fp16", "fp8", "notes", "recommended", "basis")
# the devices' basis, too long for a cell, follows the table
_TABLE_COLUMNS = {"packages": _PACKAGE_COLUMNS, "devices": _DEVICE_COLUMNS[:-1]}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-precision doctor",
        description="What this machine can do for low precision: packages, devices, native or emulated bf16/fp16/fp8"
                    " per device, and the plugin to use.")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON (for scripts and bug reports)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    packages = [dict(zip(_PACKAGE_COLUMNS, row, strict=True)) for row in _package_rows()]
    devices = [dict(zip(_DEVICE_COLUMNS, row, strict=True)) for row in _device_rows()]
    if args.json:
        from lightning_precision.cli.console import echo

        # `doctor --json | jq ...` whose reader has gone: quiet, as Unix tools are (no BrokenPipeError at exit)
        echo(json.dumps({"machine": machine_info(), "packages": packages, "devices": devices}, indent=2))
        return 0
    from rich.table import Table

    from lightning_precision.cli.console import console as make_console

    console = make_console()
    for title, rows in (("packages", packages), ("devices", devices)):
        table = Table(title=title)
        columns = _TABLE_COLUMNS[title]
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(Text(row[c]) for c in columns))  # plain text: "[te]" in a pip extra is not markup
        console.print(table)
    for device in devices:
        name = device["device"].split(" ")[0].rstrip(":")
        console.print(Text(f"{name}: the recommendation rests on {device['basis']}."))
    return 0
