"""Where a process runs: device, compute dtype, threads, and its place among the ranks.

    rt = setup_runtime(common)      # common: llm.config.CommonConfig
    rt.device, rt.dtype, rt.rank, rt.world_size, rt.is_main, rt.autocast()
    model = wrap_model(raw, rt, "ddp" | "fsdp")   # DDP / FSDP2 when WORLD_SIZE > 1, else `raw`
    results = sharded_map(work, n, rt)  # [work(0), ..., work(n-1)] on every rank, rank r doing r, r+N, ...
    rt.close()                      # the process group, if any

Under torchrun (WORLD_SIZE > 1) `setup_runtime` initialises the process group: gloo on the CPU,
NCCL on CUDA. `common.device: auto` takes cuda:<LOCAL_RANK> when CUDA is available, else the
CPU; `common.dtype: auto` is fp32 on the CPU and bf16 (fp16 where the card has no bf16) on
CUDA. `common.cpu_kernels` switches llm/kernels.py on or off for the process, and
`common.cpu_capability` fixes which vectorized kernels PyTorch runs on an x86 CPU
(`apply_cpu_capability`).
"""
from __future__ import annotations

import contextlib
import os
import platform
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from llm import kernels
from llm.config import CommonConfig, ConfigError
from llm.threads import apply_num_threads


@dataclass
class Runtime:
    """Where this process trains: device, compute dtype, and its place among the ranks."""
    device: torch.device
    dtype: torch.dtype = torch.float32  # autocast dtype; float32 = no autocast
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    auto_threads: bool = False  # common.num_threads: auto, so the loop revisits the count (llm/threads.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def close(self) -> None:
        """Tear down the process group, if this process is in one."""
        teardown_runtime()


def resolve_device(common: CommonConfig, local_rank: int = 0) -> torch.device:
    """common.device: "auto" -> cuda:<local_rank> when available, else cpu. A device this machine
    lacks is a ConfigError naming the key (as is a dtype it cannot run, in `resolve_dtype`)."""
    if common.device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if common.device == "cuda":
        raise ConfigError(["common.device: cuda, but torch.cuda.is_available() is False (no GPU, or a"
                           " CPU-only torch build); set common.device: auto or cpu"])
    return torch.device("cpu")


def resolve_dtype(common: CommonConfig, device: torch.device) -> torch.dtype:
    """Compute dtype: fp32 on CPU; on CUDA "auto" = bf16 where supported, else fp16."""
    want = common.dtype
    if device.type != "cuda":
        if want in ("bf16", "fp16"):
            raise ConfigError([f"common.dtype: {want} needs a CUDA device (CPU training is fp32);"
                               f" set common.dtype: auto or fp32"])
        return torch.float32
    if want == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if want == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError([f"common.dtype: bf16, but {torch.cuda.get_device_name(device)} has no bf16;"
                           f" use fp16 (with GradScaler) or auto"])
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[want]


# What each `common.cpu_capability` level needs from the processor (Linux /proc/cpuinfo flags).
CAPABILITY_FLAGS = {"default": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}
CPUINFO = Path("/proc/cpuinfo")
# the same level for MKL, which runs the matrix products and picks its own code path by processor
MKL_INSTRUCTIONS = {"avx2": "AVX2", "avx512": "AVX512"}


# what platform.machine() says on an x86 processor (lower case), where the kernel levels apply
X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def _cpu_flags() -> set[str] | None:
    """The processor's feature flags, or None where /proc/cpuinfo cannot tell (not Linux)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def apply_cpu_capability(setting: str) -> str:
    """Make PyTorch and MKL run the CPU kernels of `common.cpu_capability`; return PyTorch's level in use.

    PyTorch picks its elementwise and reduction kernels for the processor it finds: AVX-512
    where the CPU has it, else AVX2; MKL, which runs the matrix products, picks its own code
    path the same way. The paths round differently in the last bits, so two x86 machines "of
    one kind" whose processors differ in generation train different weights from the same
    params, and the difference grows with every step (docs/experiments.md). "avx2" gives every
    x86-64 processor of the last decade the same kernels in both (PyTorch's alone is not
    enough: MKL's own choice still differs between processors; docs/log.md, 2026-12-03).
    "avx512" holds both to AVX-512; "default" is PyTorch's plain kernels and leaves MKL's
    choice; "" leaves PyTorch's and MKL's choice (the fastest kernels).

    PyTorch reads the level once, from the environment variable ATEN_CPU_CAPABILITY, at a
    process's first vectorized operation, and MKL reads MKL_ENABLE_INSTRUCTIONS at its first
    call; this sets both before that and checks that PyTorch's level took (MKL cannot be asked).
    On a processor that is not x86 (an Arm laptop) the setting does not apply, and is said so.
    """
    if not setting:
        return torch.backends.cpu.get_cpu_capability()
    if setting not in CAPABILITY_FLAGS:
        raise ConfigError([f"common.cpu_capability: {setting!r}; expected '', "
                           + ", ".join(repr(k) for k in CAPABILITY_FLAGS)])
    machine = platform.machine().lower()
    if machine not in X86_MACHINES:
        got = torch.backends.cpu.get_cpu_capability()
        print(f"cpu kernels: common.cpu_capability: {setting} applies to x86 processors only; this {machine}"
              f" processor runs PyTorch's {got} kernels, whose rounding differs from an x86 machine's", flush=True)
        return got
    flags = _cpu_flags()
    missing = [f for f in CAPABILITY_FLAGS[setting] if flags is not None and f not in flags]
    if missing:
        raise ConfigError([f"common.cpu_capability: {setting}, but this processor lacks {', '.join(missing)}"
                           f" ({CPUINFO}); set common.cpu_capability: avx2 (or '' for PyTorch's choice)"])
    preset = os.environ.get("ATEN_CPU_CAPABILITY")
    if preset is not None and preset.lower() != setting:
        raise ConfigError([f"common.cpu_capability: {setting}, but the environment sets ATEN_CPU_CAPABILITY={preset};"
                           f" unset one of the two, or make them agree"])
    mkl = MKL_INSTRUCTIONS.get(setting)
    if mkl:
        preset = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
        if preset is not None and preset.upper() != mkl:
            raise ConfigError([f"common.cpu_capability: {setting}, but the environment sets"
                               f" MKL_ENABLE_INSTRUCTIONS={preset}; unset it, or set it to {mkl}"])
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = mkl
    os.environ["ATEN_CPU_CAPABILITY"] = setting  # child processes (torchrun's workers) inherit both
    got = torch.backends.cpu.get_cpu_capability()
    if got.lower() != setting:
        raise ConfigError([f"common.cpu_capability: {setting}, but PyTorch already runs its {got} kernels in this"
                           f" process (an operation ran before the stage could set the level); start the process"
                           f" with ATEN_CPU_CAPABILITY={setting} in its environment"])
    return got


def setup_runtime(common: CommonConfig) -> Runtime:
    """Kernels, threads, device, dtype; under torchrun (WORLD_SIZE > 1) also the process group."""
    apply_cpu_capability(common.cpu_capability)  # first: PyTorch fixes the level at its first operation
    apply_num_threads(common.num_threads)
    kernels.set_enabled(common.cpu_kernels)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(common, local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rt = Runtime(device=device, dtype=resolve_dtype(common, device), rank=rank, local_rank=local_rank,
                 world_size=world, auto_threads=common.num_threads == "auto")
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):  # several machines
        try:
            check_shared_directory(rt)
        except ConfigError:
            teardown_runtime()  # the caller gets no Runtime to close
            raise
    return rt


def check_shared_directory(rt: Runtime, directory: Path | None = None) -> None:
    """Several machines read the stage's inputs and checkpoints and rank 0 writes its outputs,
    all in the repository: every rank must see the same directory. Rank 0 writes a file there
    (the current directory by default) and every rank looks for it; if some cannot see it, every
    rank raises ConfigError naming them (all ranks agree, so none waits for the others)."""
    directory = Path.cwd() if directory is None else directory
    name = all_gather_object(f".llm-shared-check-{uuid.uuid4().hex}" if rt.is_main else None, rt)[0]
    probe = directory / name
    if rt.is_main:
        probe.write_text(name, encoding="utf-8")
    barrier(rt)
    seen = all_gather_object((socket.gethostname(), probe.is_file()), rt)
    barrier(rt)
    if rt.is_main:
        probe.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (host, ok) in enumerate(seen) if not ok]
    if blind:
        raise ConfigError([f"{directory}: {', '.join(blind)} cannot see the file rank 0 wrote there: the machines of"
                           f" a run (common.nnodes > 1) must share the repository's directory (a network filesystem),"
                           f" since every rank reads the inputs and checkpoints and rank 0 writes the outputs there"])


def teardown_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(t: torch.Tensor, rt: Runtime, op=None) -> torch.Tensor:
    """Sum (or `op`) `t` over the ranks in place; a no-op in one process. Returns `t`."""
    if rt.distributed:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def all_gather_object(obj: Any, rt: Runtime | None) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] in one process."""
    if rt is None or not rt.distributed:
        return [obj]
    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


T = TypeVar("T")


def sharded_map(work: Callable[[int], T], n: int, rt: Runtime | None) -> list[T]:
    """[work(0), ..., work(n - 1)] on every rank, each item computed on one rank only.

    Rank r of N computes the items r, r + N, r + 2N, ... and the results are gathered (pickled:
    return CPU tensors and plain values) in item order. When each item (a batch of prompts,
    say) is computed the same way whichever rank runs it, with its own seeded generator, the
    result does not depend on N: the eval and pairs stages write the same bytes on 1 process
    as on 8. Every rank must call it, with the same n. In one process (rt None or world 1)
    it is a plain loop.
    """
    if rt is None or not rt.distributed:
        return [work(i) for i in range(n)]
    mine = {i: work(i) for i in range(rt.rank, n, rt.world_size)}
    out: list[Any] = [None] * n
    for part in all_gather_object(mine, rt):
        for i, v in part.items():
            out[i] = v
    return out


# ---------------------------------------------------------------------------
# Model wrapping

def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under torch.compile and DDP wrappers (FSDP2 modules are their own)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the longest ModuleList whose members share one type."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(b) for b in m}) == 1:
            best = list(m)
    return best


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in backward instead of storing them; returns #blocks.

    Patches `forward` (non-reentrant torch.utils.checkpoint, RNG preserved) instead of
    wrapping, so state-dict keys do not change.
    """
    from torch.utils.checkpoint import checkpoint
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(f"activation_checkpointing: found no nn.ModuleList of blocks in {type(model).__name__}")
    for b in blocks:
        inner = b.forward
        b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(inner)
    return len(blocks)


def wrap_model(model: nn.Module, rt: Runtime, strategy: str = "ddp",
               find_unused_parameters: bool = False) -> nn.Module:
    """DDP or FSDP2 when distributed, else the model itself."""
    if not rt.distributed:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        if rt.dtype == torch.float16:
            raise RuntimeError("fp16 with FSDP is not supported by this trainer; use bf16")
        for b in blocks_of(model):
            fully_shard(b)
        fully_shard(model)
        return model
    if strategy != "ddp":
        raise ValueError(f"distributed strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                               find_unused_parameters=find_unused_parameters)


def full_model_state(model: nn.Module, rt: Runtime) -> dict[str, torch.Tensor] | None:
    """The whole (unsharded) state dict on CPU on rank 0, None on other ranks.

    Every rank must call it: under FSDP it gathers the shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=rt.distributed)
    state = get_model_state_dict(unwrap(model), options=opts)
    return {k: v.detach().to("cpu") for k, v in state.items()} if rt.is_main else None
