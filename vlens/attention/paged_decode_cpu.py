"""Paged decode attention on the CPU, in C: the static decode step's kernel there, as the Triton kernel
(vlens.attention.paged_decode) is on CUDA.

Why a kernel of our own: the portable decode path (vlens.attention.decode) copies every row's keys and
values out of the paged cache, padded to the step's page bucket, and SDPA's CPU kernel then costs about
1.5 us per (row, KV head) however few keys it has; at batch 64 on a 2-layer model that was a third of a
decode step. Here each row's keys and values are read once, where they lie, up to its own context, for
every head (the .c file says how the work splits).

The kernel (`paged_decode_cpu.c`, beside this file) is built on first use with the machine's C compiler
($CC, else `cc`), tuned for this CPU, with OpenMP (torch's own runtime, already loaded), and cached under
$XDG_CACHE_HOME/vlens (~/.cache/vlens) by the hash of the source, the compiler and the CPU; it runs on
torch's thread count. Without a compiler, decode attention gathers keys as before (DecodeBackend says why,
once). Float32 only. A torch custom op wraps it, so a compiled forward keeps it as one call; an eager
forward calls it directly (the op's dispatch cost ~20 us a call).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).with_suffix(".c")
# tried in turn: without OpenMP where the compiler has none (Apple's clang), for any CPU where it cannot tune
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-march=native", "-shared", "-fPIC"],
    ["-O3", "-shared", "-fPIC"],
)


def _cpu() -> bytes:
    """What -march=native compiles for: this CPU's model and flags (a cache shared by machines keeps one
    library per kind of CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        info = platform.processor()
    return "\n".join(line for line in info.splitlines() if line.startswith(("model name", "flags"))).encode()


@functools.cache
def _kernel():
    """The C function, built once a machine (atomically: parallel first builds each write their own file
    and rename it into place) with the first of FLAG_SETS the compiler takes (without OpenMP: one thread)."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        raise RuntimeError("no C compiler: set $CC or install cc")
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlens"
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(source + " ".join([*compiler, *flags]).encode() + _cpu()).hexdigest()[:16]
        library = cache / f"paged_decode_cpu-{key}.so"
        if not library.exists():
            cache.mkdir(parents=True, exist_ok=True)
            partial = library.with_name(f"{library.name}.{os.getpid()}.part")
            built = subprocess.run([*compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True,
                                   text=True, timeout=120)  # fmt: skip
            if built.returncode != 0:
                partial.unlink(missing_ok=True)
                errors.append(built.stderr.strip()[-300:])
                continue
            os.replace(partial, library)
        function = ctypes.CDLL(str(library)).paged_decode_f32
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float] * 2 + [ctypes.c_int]
        return function
    raise RuntimeError(f"{' '.join(compiler)} could not build {SOURCE.name}: {errors[-1]}")


def _run(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, context: torch.Tensor,
    sinks: torch.Tensor | None, kv_heads: int, block_size: int, window: int, chunk: int, scale: float, softcap: float,
) -> torch.Tensor:  # fmt: skip
    out = torch.empty_like(q)
    rows, heads, dim = q.shape
    failed = _kernel()(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), context.data_ptr(), out.data_ptr(),
        None if sinks is None else sinks.data_ptr(), rows, heads, kv_heads, dim, tables.shape[1], block_size, window,
        chunk, scale, softcap, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged decode attention: no memory for a row's scores")
    return out


_paged_decode = torch.library.custom_op("vlens::paged_decode_cpu", _run, mutates_args=())


@_paged_decode.register_fake
def _(q, k_cache, v_cache, tables, context, sinks, kv_heads, block_size, window, chunk, scale, softcap):
    return torch.empty_like(q)


def paged_decode_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, context: torch.Tensor,
    block_size: int, layer, programs: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Attention output [B, H, d] of each row's query q [B, H, d] over keys 0 .. context[b] - 1 of its block
    table tables[b] in the caches [slots, H_kv, d] (the arguments of the Triton kernel; `programs` unused)."""
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        raise TypeError(f"paged decode attention on the CPU takes float32, not {q.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and tables.is_contiguous() and context.is_contiguous()):
        raise ValueError("paged decode attention on the CPU reads contiguous caches, tables and context lengths")
    if tables.dtype != torch.long or context.dtype != torch.long:
        raise TypeError("paged decode attention on the CPU takes int64 block tables and context lengths")
    sinks = None if layer.sinks is None else layer.sinks.float().contiguous()
    run = _paged_decode if torch.compiler.is_compiling() else _run
    return run(
        q.contiguous(), k_cache, v_cache, tables, context, sinks, layer.num_kv_heads, block_size, layer.window or 0,
        layer.kind.chunk or 0, layer.scale, layer.softcap or 0.0,
    )  # fmt: skip
