"""The execution backends of ``--workers N`` and ``--ray [ADDRESS]``: in this process, a ``spawn``
process pool, or Ray — one module shared by the main job (``specparity.jobs.run.execute``:
``run``, ``grade DIR``) and the golden regeneration (``specparity.goldens.regen``).

:func:`execute` runs ``task(*job)`` for every job and calls ``on_done(job, result, error)`` in
THIS process as each finishes (only the caller writes); the caller decides whether an error is
recorded (regen) or raised (the run: raising stops the queue). The same task function on every
backend, so their outputs are identical. Pool workers keep one BLAS thread each and die with
their parent, even when it is killed with ``kill -9`` (:func:`die_with_parent`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

Job = tuple[Any, ...]
OnDone = Callable[[Job, Any, "BaseException | None"], None]


def die_with_parent() -> None:
    """Make this (worker) process end when its parent dies, even by ``kill -9``.

    Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes (prctl(2)), plus
    a daemon thread that exits when the process is re-parented (other
    platforms, or a parent that died before the prctl). Pool workers of a
    killed ``regen``/``run`` thus never linger.
    """
    import multiprocessing as mp
    import signal
    import threading

    # The parent multiprocessing recorded at spawn, not getppid(): a parent killed while this
    # worker was still starting up has already been replaced by the reaper.
    spawner = mp.parent_process()
    parent = spawner.pid if spawner is not None and spawner.pid else os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def pool_init() -> None:
    """Initializer of every pool worker: one BLAS thread (workers of a 2-core pool), and the
    worker dies with its parent."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    die_with_parent()


@contextmanager
def ray_session(address: str | None, num_cpus: int | None) -> Iterator[Any]:
    """Ray, joined at ``address`` or started locally (and shut down after)."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError("--ray needs Ray: pip install 'specparity[ray]'") from exc
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def execute(task: Callable[..., Any], jobs: Sequence[Job], on_done: OnDone, *, workers: int = 0,
            ray_address: str | None = None, ray_cpus: int | None = None) -> None:
    """``task(*job)`` for every job; ``on_done(job, result, None)`` or ``on_done(job, None, error)``
    here as each finishes.

    ``ray_address`` not None: Ray ("" = a local cluster of ``ray_cpus``); else ``workers <= 0``: in
    this process, in order (an ``Exception`` is handed to ``on_done``; anything else propagates);
    else a ``spawn`` process pool of ``workers`` (each worker loads its models once). An exception
    raised by ``on_done`` (or SIGTERM, Ctrl-C) stops the pool: queued jobs are not started.
    """
    if ray_address is not None:
        _execute_ray(task, jobs, on_done, ray_address or None, ray_cpus)
    elif workers <= 0:
        for job in jobs:
            try:
                result = task(*job)
            except Exception as exc:
                on_done(job, None, exc)
                continue
            on_done(job, result, None)
    else:
        _execute_pool(task, jobs, on_done, workers)


def _execute_pool(task: Callable[..., Any], jobs: Sequence[Job], on_done: OnDone, workers: int) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                             initializer=pool_init) as ex:
        futs = {ex.submit(task, *job): job for job in jobs}
        try:
            for fut in as_completed(futs):
                exc = fut.exception()
                on_done(futs[fut], None if exc else fut.result(), exc)
        except BaseException:  # an error raised by on_done, SIGTERM, Ctrl-C: queued jobs are not started
            ex.shutdown(wait=True, cancel_futures=True)
            raise


def _execute_ray(task: Callable[..., Any], jobs: Sequence[Job], on_done: OnDone, address: str | None,
                 num_cpus: int | None) -> None:
    with ray_session(address, num_cpus) as ray:
        remote = ray.remote(task)
        refs = {remote.remote(*job): job for job in jobs}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    on_done(refs[ref], None, exc)
                    continue
                on_done(refs[ref], result, None)
