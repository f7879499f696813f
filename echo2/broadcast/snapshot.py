"""Snapshot bytes: the policy's state dict as safetensors (no code runs on load, unlike pickle), and the memory
they live in on a worker (``MemoryFile``: the relay receives into it, the engine maps it; ``views`` reads tensors
out of it without a copy). A LoRA policy's snapshot holds only its adapter, in PEFT's tensor names, with the
adapter's configuration in the safetensors metadata (``metadata``; echo2/broadcast/adapter.py).

Their authentication (a manifest of chunk digests signed by the learner) is the relay's: manifest.py.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Iterator
from typing import Any


def _unique(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with each tensor once: a tied weight (Qwen3's LM head is its embedding matrix) appears under
    its first name only (``model.embed_tokens.weight``), as in the model's own checkpoint; the engines tie the other
    name to it."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else name
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def encode(state_dict: dict[str, Any]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({k: t.detach().cpu().contiguous() for k, t in _unique(state_dict).items()})


def save(state_dict: dict[str, Any], path: str) -> None:
    """The state dict in safetensors format, streamed into ``path`` one tensor at a time: no copy of the whole
    snapshot in memory (a GPU learner moves one tensor at a time to the CPU), and ``path`` may be a memory file's
    ``/proc/self/fd/<n>`` (safetensors' own ``save_file`` writes a temporary file beside its target and renames it,
    which a memory file cannot have). ``decode`` (safetensors) reads the result."""
    unique = _unique(state_dict)
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in unique.items()}
    save_stream(specs, (unique[name] for name in order(specs)), path)


def order(specs: dict[str, tuple[Any, tuple[int, ...]]]) -> list[str]:
    """The order tensors are written in: by element size, largest first, then by name, as safetensors does, so each
    stays aligned for ``views``. A sharded learner gathers its parameters in this order (every rank the same)."""
    return sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))


def save_stream(specs: dict[str, tuple[Any, tuple[int, ...]]], tensors: Iterator[Any], path: str,
                metadata: dict[str, str] | None = None) -> None:
    """Write a snapshot from its tensors' (dtype, shape) and the tensors themselves, produced one at a time in
    ``order(specs)``: the writer never needs them all at once (a sharded learner gathers each just before it is
    written). Each tensor must have the dtype and shape its spec says. ``metadata``: safetensors' string map
    (``__metadata__``), signed with the rest of the bytes."""
    import torch

    codes = {v: k for k, v in _dtypes().items()}
    names = order(specs)
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in names:
        dtype, shape = specs[name]
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": codes[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, t in zip(names, tensors, strict=True):
            t = t.detach().to("cpu").contiguous()
            if (t.dtype, tuple(t.shape)) != (specs[name][0], tuple(specs[name][1])):
                raise ValueError(f"snapshot tensor {name}: got {t.dtype} {tuple(t.shape)}, spec says {specs[name]}")
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def metadata(buf) -> dict[str, str]:
    """The safetensors ``__metadata__`` of snapshot bytes (empty if none), read from the header alone."""
    (header_len,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(bytes(memoryview(buf)[8:8 + header_len]))
    return dict(header.get("__metadata__") or {})


def decode(blob) -> dict[str, Any]:
    """The tensors of snapshot bytes: views into ``blob`` where it is writable memory (a MemoryFile: no copy),
    else a copy made by safetensors."""
    if isinstance(blob, (bytes, memoryview)):
        import safetensors.torch

        return safetensors.torch.load(bytes(blob))
    return dict(views(blob))


def _dtypes() -> dict[str, Any]:
    """safetensors dtype codes -> torch dtypes (the ones a model checkpoint holds)."""
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}


def views(buf) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of a safetensors buffer, each a view into ``buf`` (no copy).

    ``buf`` must be writable (torch.frombuffer warns on read-only memory): a MemoryFile, or a map made
    copy-on-write."""
    import torch

    dtypes = _dtypes()
    (header_len,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(bytes(memoryview(buf)[8:8 + header_len]))
    base = 8 + header_len
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = dtypes[meta["dtype"]]
        lo, hi = meta["data_offsets"]
        count = (hi - lo) // dtype.itemsize
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + lo) if count else torch.empty(0, dtype=dtype)
        yield name, t.view(meta["shape"])


class MemoryFile(mmap.mmap):
    """A writable memory buffer that another local process can map too: an anonymous memory file (``memfd``).

    Why not /dev/shm: containers often mount it at 64 MB, far below one snapshot; a memory file has no such limit
    (it is memory like any other, counted as shared). Why not an anonymous map: no other process could reach it.
    Pages are the kernel's zero pages until written, so a buffer that fills as bytes arrive costs no up-front
    zeroing. ``path`` (``/proc/<pid>/fd/<n>``) opens it from another process of the same user while this object
    lives: the vLLM engine maps the snapshot from there instead of reading a copy of it.
    """

    def __new__(cls, size: int, name: str = "echo2-snapshot"):
        fd, path = new_memory_fd(name)
        try:
            os.ftruncate(fd, size)
            self = super().__new__(cls, fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.path = fd, path
        weakref.finalize(self, os.close, fd)
        return self


def new_memory_fd(name: str = "echo2-snapshot") -> tuple[int, str]:
    """An empty memory file (see MemoryFile for why one): its descriptor, and the path another local process of
    the same user opens it by while the descriptor is open."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


def written_bytes(write: Any) -> bytes:
    """What ``write(path)`` (a PolicyWeights.write) streams into a fresh memory file, read back as bytes: the snapshot
    as the coordinator's broadcaster gets it (tests, benchmarks)."""
    fd, path = new_memory_fd()
    try:
        write(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def memory_file(data: bytes | memoryview) -> MemoryFile:
    """``data`` copied into a new MemoryFile (for callers that hold plain bytes)."""
    buf = MemoryFile(len(data))
    buf[:] = data
    return buf
