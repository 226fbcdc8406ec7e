"""``--device cpu|gpu`` (issue 13 item 3): the MLX default device of run, generate, audit and bench.

On a machine without a GPU backend, ``--device gpu`` is a usage error (exit 2)
with one clear line; ``--device cpu`` runs; CPU trace headers are unchanged
(no ``platform.backend``); a GPU header names its backend.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from specparity.cli import main
from specparity.cli.devices import use_device
from traces.records import platform_info

NO_GPU = not mx.is_available(mx.gpu)


@pytest.fixture(autouse=True)
def _restore_device() -> Any:
    prev = mx.default_device()
    yield
    mx.set_default_device(prev)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU backend")
@pytest.mark.parametrize("argv", [
    ["audit", "--targets", "llama", "--device", "gpu"],
    ["bench", "--size", "tiny", "--device", "gpu"],
    ["run", "--targets", "llama", "--device", "gpu"],
    ["generate", "--target", "LLAMA", "--prompt-ids", "1,2", "--device", "gpu"],
    ["record", "--runner", "mlx_lm", "--target", "LLAMA", "--prompt-ids", "1,2", "--device", "gpu"],
], ids=lambda a: a[0])
def test_gpu_unavailable_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    import zoo

    argv = [str(zoo.model_dir("llama")) if a == "LLAMA" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--device gpu: MLX" in err and "no GPU backend" in err, err


def test_device_with_workers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--targets", "llama", "--device", "cpu", "--workers", "2"]) == 2
    assert "--device sets this process's MLX device" in capsys.readouterr().err


def test_cpu_device_and_header() -> None:
    assert use_device("cpu").startswith("Device(cpu")
    info = platform_info()
    assert info["device"] == "Device(cpu, 0)" and "backend" not in info, info
    with pytest.raises(ValueError, match="--device must be one of"):
        use_device("tpu")


@pytest.mark.skipif(NO_GPU, reason="no GPU backend here")
def test_gpu_header_names_its_backend() -> None:
    use_device("gpu")
    info = platform_info()
    assert info["device"].startswith("Device(gpu") and info["backend"] in ("cuda", "metal"), info
