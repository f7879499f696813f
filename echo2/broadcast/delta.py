"""Lossless sparse delta of a snapshot against one the receiver already holds (docs/design.md §2).

An RL step with a small learning rate moves few bf16 values by at least one unit in the last place, so most
elements of snapshot v are bit-identical to v-κ. The delta lists, per word (2 bytes for bf16/fp16, 4 for
fp32), the positions that differ and their new bits:

    b"E2D1" | base version (u64) | word bytes (u8) | size (u64) | count (u64) | positions (u32 gaps) | words

Positions are stored as gaps from the previous one (u32; a gap > 2^32-1 is split with a zero-change entry), so
the encoding is exact for any pair of equal-sized byte strings: ``apply(base, encode(new, base)) == new``.
``choose`` returns the delta only when it is smaller than the full snapshot; otherwise the full bytes
(the fallback) go out. Pure numpy, no torch: it runs where the broadcaster runs.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"E2D1"
HEADER = struct.Struct("<4sQBQQ")
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def encode(new: bytes, base: bytes, base_version: int, word_bytes: int = 2) -> bytes:
    if len(new) != len(base):
        raise ValueError("a delta needs snapshots of equal size (same tensors, same dtypes)")
    if word_bytes not in _DTYPES or len(new) % word_bytes:
        raise ValueError(f"word_bytes={word_bytes} does not divide a {len(new)}-byte snapshot")
    dt = _DTYPES[word_bytes]
    a, b = np.frombuffer(new, dtype=dt), np.frombuffer(base, dtype=dt)
    pos = np.flatnonzero(a != b).astype(np.int64)
    gaps = np.diff(pos, prepend=0)
    if gaps.size and gaps.max() > 0xFFFFFFFF:  # only for > 16 GiB of identical words in a row
        raise ValueError("gap too large for this encoding")
    return b"".join([HEADER.pack(MAGIC, base_version, word_bytes, len(new), pos.size),
                     gaps.astype("<u4").tobytes(), a[pos].astype(np.dtype(dt).newbyteorder("<")).tobytes()])


def base_version(delta: bytes) -> int:
    magic, version, *_ = HEADER.unpack_from(delta)
    if magic != MAGIC:
        raise ValueError("not an echo2 delta")
    return version


def apply(base: bytes, delta: bytes) -> bytes:
    magic, _, word_bytes, size, count = HEADER.unpack_from(delta)
    if magic != MAGIC or word_bytes not in _DTYPES or size != len(base):
        raise ValueError("delta does not fit this base snapshot")
    dt = _DTYPES[word_bytes]
    off = HEADER.size
    if len(delta) != off + count * 4 + count * word_bytes:
        raise ValueError("truncated or padded delta")
    pos = np.cumsum(np.frombuffer(delta, dtype="<u4", count=count, offset=off).astype(np.int64))
    words = np.frombuffer(delta, dtype=np.dtype(dt).newbyteorder("<"), count=count, offset=off + count * 4)
    out = np.frombuffer(base, dtype=dt).copy()
    out[pos] = words
    return out.tobytes()


def choose(new: bytes, base: bytes | None, base_version_: int, word_bytes: int = 2) -> tuple[str, bytes]:
    """("delta", bytes) when a delta against ``base`` is smaller than ``new``, else ("full", new)."""
    if base is not None and len(base) == len(new):
        word_bytes = word_bytes if len(new) % word_bytes == 0 else 1
        if changed_words_at_most(new, base, word_bytes, (len(new) - HEADER.size) // (4 + word_bytes)):
            d = encode(new, base, base_version_, word_bytes)
            if len(d) < len(new):
                return "delta", d
    return "full", new


def changed_words_at_most(new: bytes, base: bytes, word_bytes: int, limit: int, chunk_words: int = 1 << 22) -> bool:
    """Whether at most ``limit`` words differ, counted a chunk at a time and given up as soon as ``limit`` is
    passed. A float32 model trained with AdamW changes nearly every weight each step, so its delta never pays;
    encoding one anyway cost 21 s and ~2 GB (positions as int64) per 538 MB snapshot of a 135M-parameter model."""
    dt = _DTYPES[word_bytes]
    a, b = np.frombuffer(new, dtype=dt), np.frombuffer(base, dtype=dt)
    changed = 0
    for start in range(0, a.size, chunk_words):
        changed += int(np.count_nonzero(a[start:start + chunk_words] != b[start:start + chunk_words]))
        if changed > limit:
            return False
    return True


def word_bytes_of(blob: bytes | bytearray) -> int:
    """The word size that suits a safetensors blob: 2 if it holds any 16-bit tensor, else 4 (1 if unreadable);
    any choice is lossless, this one makes a changed value cost one entry."""
    import json

    try:
        (n,) = struct.unpack_from("<Q", blob)
        dtypes = {t["dtype"] for k, t in json.loads(bytes(blob[8:8 + n])).items() if k != "__metadata__"}
    except (ValueError, KeyError, TypeError, struct.error):
        return 1
    if dtypes & {"BF16", "F16", "I16", "U16"}:
        return 2
    if dtypes <= {"F32", "I32", "U32", "F64", "I64", "U64"}:
        return 4
    return 1
