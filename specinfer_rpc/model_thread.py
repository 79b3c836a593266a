"""The one thread that does all of a model service's torch work: thread settings, loading, warm-up
and every step. The event loop never touches a tensor.

On the CPU, PyTorch's and MKL's OpenMP keep a team of threads per calling thread, and MKL's thread
count is set per calling thread. A model loaded on the main thread and stepped on a worker thread
has two teams: once their threads outnumber the cores, libgomp stops spin-waiting between parallel
regions and every region pays a sleep and a wake-up, and `torch.set_num_threads` called on the main
thread leaves the worker's MKL at every core. On a 2-core CPU that made small forwards up to twice
as slow.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def _settle(threads: int, device: torch.device) -> None:
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda" and device.index is not None:  # bare "cuda" is the current device already (and
        torch.cuda.set_device(device)                        # set_device refuses a device without an index)


class ModelThread:
    def __init__(self, name: str, threads: int = 0, device: torch.device = torch.device("cpu")):
        """threads: torch CPU threads (0: torch's default); device: the models' device (made
        current on CUDA); both set on the model thread itself."""
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_settle, initargs=(threads, device))

    def call(self, fn: Callable[..., T], *args) -> T:
        """Run fn on the model thread and wait for it (startup: loading, warm-up)."""
        return self.executor.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args) -> asyncio.Future:
        """Queue fn on the model thread now (calls run in the order they were submitted); its future."""
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run fn on the model thread without blocking the event loop."""
        return await self.submit(fn, *args)
