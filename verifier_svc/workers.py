"""The model-parallel verifier's processes. Rank 0 is the serving process: it starts the other
ranks (`torch.multiprocessing`, spawn), sends each of them every command (a step's batch, a
release) over a pipe, and runs its own part of the step; all ranks then meet in the
torch.distributed collectives of the forward pass (see specinfer/parallel.py).

A rank that dies is never waited for: rank 0 checks the others are alive before each command, and
a collective with a dead peer fails (its connection closes) or times out (`--dist-timeout`). Either
way the step raises `RankFailed`, and so does every later one: the group is not repaired in place,
the service reports UNAVAILABLE and exits so that it is restarted whole. A worker whose rank 0 goes
away sees its pipe close and exits.
"""

from __future__ import annotations

import multiprocessing.connection
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specinfer.errors import CacheFull
from specinfer.model import ModelConfig
from specinfer.parallel import RankLayout, PipelineVerifier, apply_tensor_parallel, init_rank, load_stage
from specinfer.verifier import FEATURE_BYTES, VerifyRequest, check_feature_layers
from specinfer.acceptance import Verdict


class RankFailed(RuntimeError):
    """A rank of the model-parallel verifier died or stopped answering."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def _build(layout: RankLayout, init_method: str, timeout_s: float, model_dir: str, dtype: torch.dtype,
           device: torch.device, kv_tokens: int, threads: int, feature_layers: tuple[int, ...] = (),
           feature_bytes: int = FEATURE_BYTES, prefix_cache: bool = True) -> PipelineVerifier:
    if threads:
        torch.set_num_threads(threads)
    device = rank_device(device, layout.rank)
    group = init_rank(layout, init_method, timeout_s, device)
    model = load_stage(model_dir, layout, dtype, device)
    apply_tensor_parallel(model, layout, group)
    return PipelineVerifier(model, kv_tokens, layout, ModelConfig.from_dir(model_dir).num_layers, feature_layers,
                            feature_bytes, prefix_cache)


def _worker(layout: RankLayout, conn: multiprocessing.connection.Connection, *build_args) -> None:
    verifier = _build(layout, *build_args)
    conn.send("ready")
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return  # rank 0 is gone
        if kind == "step":
            try:
                verifier.step(payload)
            except (ValueError, CacheFull):
                pass  # rank 0 met the same error before any collective and answered its caller
        elif kind == "release":
            for rid in payload:
                verifier.release(rid)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParallelVerifier:
    """Rank 0: the same interface as `Verifier` (resolve, step, release, caches, pool, model)."""

    def __init__(self, model_dir: str, tp: int, pp: int, dtype: torch.dtype, device: torch.device,
                 kv_tokens: int, threads: int = 0, timeout_s: float = 30.0, feature_layers: tuple[int, ...] = (),
                 feature_bytes: int = FEATURE_BYTES, prefix_cache: bool = True):
        gpus = torch.cuda.device_count()
        if device.type == "cuda" and device.index is None and gpus < tp * pp:
            raise ValueError(f"--tp {tp} --pp {pp}: {tp * pp} ranks need as many GPUs (NCCL runs one rank per "
                             f"GPU), this host has {gpus}; run them on the CPU with --device cpu (gloo)")
        ctx = mp.get_context("spawn")
        check_feature_layers(feature_layers, ModelConfig.from_dir(model_dir).num_layers)  # before any rank starts
        build_args = (f"tcp://127.0.0.1:{_free_port()}", timeout_s, str(model_dir), dtype, device, kv_tokens, threads,
                      tuple(feature_layers), feature_bytes, prefix_cache)
        self.procs, self.conns = [], []
        for rank in range(1, tp * pp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(RankLayout(tp, pp, rank), child, *build_args), daemon=True,
                               name=f"verifier-rank-{rank}")
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
        self.failed = ""
        self.local = _build(RankLayout(tp, pp, 0), *build_args)
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout_s) or conn.recv() != "ready":
                self._fail(f"rank {rank} did not start")

    @property
    def model(self):
        return self.local.model

    @property
    def feature_layers(self):
        return self.local.feature_layers

    @property
    def pool(self):
        return self.local.pool

    @property
    def caches(self):
        return self.local.caches

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _fail(self, why: str):
        self.failed = self.failed or why
        raise RankFailed(f"model-parallel verifier: {self.failed}")

    def _send(self, message) -> None:
        if self.failed:
            self._fail(self.failed)
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not proc.is_alive():
                self._fail(f"rank {rank} exited with code {proc.exitcode}")
            try:
                conn.send(message)
            except OSError as e:
                self._fail(f"rank {rank}: {e}")

    def resolve(self, batch: list[VerifyRequest]) -> None:
        """Here, before the step goes to the other ranks: they take the trees rank 0 chose."""
        self.local.resolve(batch)

    def step(self, batch: list[VerifyRequest]) -> list[Verdict]:
        self._send(("step", batch))
        try:
            return self.local.step(batch)
        except (ValueError, CacheFull):
            raise
        except RuntimeError as e:  # torch.distributed: a peer closed its connection, or a timeout
            self._fail(f"a collective failed: {e}")

    def release(self, request_id: str) -> None:
        self._send(("release", [request_id]))
        self.local.release(request_id)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
