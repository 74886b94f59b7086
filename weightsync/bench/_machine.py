"""The machine a ``weightsync bench`` run measures: what the numbers depend
on (CPU, cores, memory, versions, load), as facts for ``--json`` and as one
line above the table.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import weightsync as ws

__all__ = ["cuda_facts", "describe_devices", "describe_machine", "machine_facts"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _uvloop_installed() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None; without importing it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, versions, and the load
    when called (other processes on the machine skew every timing)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "weightsync": ws.__version__,
        "ray": _installed_version("ray"),
        "torch_threads": torch.get_num_threads(),
        # Which event loop runs a send depends on these; the facade decides.
        "uvloop_installed": _uvloop_installed(),
        "weightsync_env": {k: v for k, v in os.environ.items() if k.startswith("WEIGHTSYNC_")},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def cuda_facts(devices: Sequence[str]) -> dict[str, Any]:
    """The CUDA devices among ``devices`` (``cuda:N``, visible here): name,
    memory and UUID of each, torch's CUDA version and the allocator's
    settings (``PYTORCH_CUDA_ALLOC_CONF`` changes what IPC can do)."""
    named: dict[str, Any] = {}
    for device in dict.fromkeys(d for d in devices if d.startswith("cuda")):
        props = torch.cuda.get_device_properties(torch.device(device))
        named[device] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "uuid": str(getattr(props, "uuid", "")) or None,
        }
    return {
        "devices": named,
        "cuda_version": torch.version.cuda,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def describe_devices(trainer_device: str, worker_device: str, facts: Mapping[str, Any]) -> str:
    """One line: where the trainer's and the workers' models live, with the
    GPUs' names (from :func:`cuda_facts`)."""
    names = facts.get("devices", {})

    def one(device: str) -> str:
        return device if device == "cpu" else f"{device} ({names.get(device, {}).get('name', '?')})"

    return (
        f"trainer's model on {one(trainer_device)}, every worker's on {one(worker_device)} "
        f"(CUDA {facts.get('cuda_version')}); checked on CPU copies of the bytes"
    )


def describe_machine(facts: Mapping[str, Any]) -> str:
    """One line of the facts that matter when reading the table."""
    load = facts.get("loadavg")
    return (
        f"{facts['cpu_model']}, {facts['cpus_usable']} cpus, {facts['memory_bytes'] / 2**30:.1f} GiB; "
        f"python {facts['python']}, torch {facts['torch']}, weightsync {facts['weightsync']}"
        + (f", ray {facts['ray']}" if facts.get("ray") else "")
        + ("" if facts["uvloop_installed"] else ", no uvloop")
        + "".join(f", {k}={v}" for k, v in facts["weightsync_env"].items())
        + (f"; load {load[0]:.2f}" if load else "")
    )
