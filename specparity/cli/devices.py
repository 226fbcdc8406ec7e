"""``--device cpu|gpu``: MLX's default device for a command (MLX ``mx.set_default_device``).

The device is process-wide: every model call of the command (engine, live
references, plain decode, serial replays) runs on it, so a GPU run compares
engine vs references and speculative vs plain on the same device. Trace headers
record it (``platform.device``, plus ``platform.backend`` off the CPU:
``traces.records.platform_info``). Goldens are CPU traces (``specparity/goldens/manifest.py``).
"""

from __future__ import annotations

import argparse

DEVICES = ("cpu", "gpu")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="MLX default device (default: MLX's own, the GPU where one is available)")


def gpu_backend() -> str | None:
    """``cuda`` / ``metal`` when MLX has a usable GPU backend here, else None."""
    import mlx.core as mx

    if not mx.is_available(mx.gpu):
        return None
    if mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "gpu"


def use_device(name: str | None) -> str:
    """Make ``name`` (``cpu``/``gpu``, None: leave MLX's default) the default device.

    Returns the device in use, e.g. ``Device(gpu, 0) (cuda)``. Raises ValueError
    (a usage error) when ``gpu`` is asked for and MLX has no GPU backend here.
    """
    import mlx.core as mx

    if name not in (None, *DEVICES):
        raise ValueError(f"--device must be one of {DEVICES}, got {name!r}")
    if name == "gpu":
        if gpu_backend() is None:
            raise ValueError(
                f"--device gpu: MLX {mx.__version__} has no GPU backend on this machine "
                "(Apple silicon has Metal; on Linux install the mlx[cuda] wheels); use --device cpu")
        mx.set_default_device(mx.gpu)
    elif name == "cpu":
        mx.set_default_device(mx.cpu)
    return describe_device()


def describe_device() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    backend = gpu_backend() if dev.type == mx.gpu else None
    return f"{dev}" + (f" ({backend})" if backend else "")


def on_gpu() -> bool:
    import mlx.core as mx

    return bool(mx.default_device().type == mx.gpu)
