"""On-disk store of captured target states: sharded safetensors plus a manifest written last.

A capture directory holds

    shard-00000.safetensors   (shard-r<rank>-00000.safetensors when captured over several ranks)
    ...
    manifest.json             identity of the capture + the list of complete shards

Each shard concatenates its samples along the token axis:

    offsets      int64  [n + 1]        sample j is rows offsets[j]:offsets[j+1]
    input_ids    int32  [N]
    aux_hidden   dtype  [N, 3H]        the three EAGLE-3 taps, canonical id order
    last_hidden  dtype  [N, H]         final decoder-layer output before the norm; with the
                                       target's norm + lm_head it gives the target distribution
    loss_mask    uint8  [N]

and names its samples in the safetensors metadata (`sample_ids`, a JSON list), so a shard
describes itself even without the manifest. Full logits are never stored: they cost V/H times
the hidden state (~30x for a Llama-3 8B) and are recomputed from `last_hidden` in one matmul.

Crash safety: a shard's sample lengths are known before it is written, so its header is written
first and tensors are streamed into place batch by batch (nothing bigger than a batch is held in
memory), into a temporary name that is fsynced and renamed. Only then is the shard added to
`manifest.json` (itself written atomically, under a lock shared by all ranks). A shard file that
the manifest does not list is the leftover of a kill and is deleted on the next run.

Reading (`CaptureStore`) memory-maps shards with `safetensors.safe_open` and slices one sample at
a time, so a trainer touches only the rows it uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..atomic import atomic_path, write_json
from ..errors import SpecdecError
from ..precision import dtype_name, parse_dtype  # noqa: F401  (part of this module's API)

MANIFEST = "manifest.json"
FORMAT = "specdec-capture"
VERSION = 1
LOCK = ".manifest.lock"

# Fields that must agree for two runs to write into the same capture directory.
IDENTITY = (
    "target_fingerprint", "aux_layer_ids", "layer_convention", "last_state", "hidden_size",
    "tokenizer_fingerprint", "dtype", "max_length",
)  # fmt: skip

_ST_DTYPE = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
}  # fmt: skip
_SHARD_RE = re.compile(r"^shard-(?:r(\d+)-)?(\d+)\.safetensors$")


def bytes_per_token(hidden_size: int, dtype: torch.dtype | str, num_aux: int = 3) -> int:
    """Disk bytes one token costs: input_ids (4) + loss_mask (1) + (num_aux + 1) * H states."""
    es = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    return 4 + 1 + (num_aux + 1) * hidden_size * es


def tokenizer_fingerprint(tokenizer, eos_token_ids: Sequence[int] = ()) -> str:
    """sha256 of what decides the token layout: chat template, vocabulary size and eos ids."""
    import hashlib

    from ..data.chat import FALLBACK_TEMPLATE

    template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    if isinstance(template, dict):  # some tokenizers keep several named templates
        template = json.dumps(template, sort_keys=True)
    h = hashlib.sha256()
    h.update(str(template).encode())
    h.update(f"|vocab={len(tokenizer)}|eos={sorted(set(int(e) for e in eos_token_ids))}".encode())
    return h.hexdigest()[:16]


def shard_name(rank: int, world_size: int, index: int) -> str:
    if world_size > 1:
        return f"shard-r{rank}-{index:05d}.safetensors"
    return f"shard-{index:05d}.safetensors"


def shard_owner(name: str, world_size: int) -> int | None:
    """The rank whose cleanup owns a shard file name (None: not a shard name)."""
    m = _SHARD_RE.match(name)
    if not m:
        return None
    if world_size <= 1:
        return 0
    rank = int(m.group(1) or 0)
    return rank if rank < world_size else 0


# -- manifest ------------------------------------------------------------------------------


@contextlib.contextmanager
def manifest_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock on the capture directory, shared by every rank that writes into it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read_manifest(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{path} is not valid JSON ({e}); move the directory aside and capture again") from e
    if manifest.get("format") != FORMAT:
        raise SpecdecError(f"{path} is not a specdec capture manifest (format {manifest.get('format')!r})")
    if manifest.get("version", 0) > VERSION:
        raise SpecdecError(
            f"{path} has capture format version {manifest.get('version')}; this specdec reads up to "
            f"{VERSION}: upgrade specdec"
        )
    return manifest


def new_manifest(identity: dict) -> dict:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "format": FORMAT,
        "version": VERSION,
        **identity,
        "num_samples": 0,
        "num_tokens": 0,
        "num_loss_tokens": 0,
        "bytes": 0,
        "created": now,
        "updated": now,
        "shards": [],
    }


def identity_mismatch(manifest: dict, identity: dict) -> list[str]:
    """Human-readable differences between an existing capture and this run, identity fields only."""
    out = []
    for k in IDENTITY:
        if k in identity and manifest.get(k) != identity[k]:
            out.append(f"{k} {manifest.get(k)!r} (on disk) vs {identity[k]!r} (this run)")
    return out


def open_or_create_manifest(directory: str | os.PathLike, identity: dict) -> dict:
    """Create the manifest of a new capture, or check that an existing one matches this run."""
    directory = Path(directory)
    with manifest_lock(directory):
        manifest = read_manifest(directory)
        if manifest is None:
            manifest = new_manifest(identity)
            write_json(directory / MANIFEST, manifest)
            return manifest
    diff = identity_mismatch(manifest, identity)
    if diff:
        raise SpecdecError(
            f"{directory} holds a capture made differently ({'; '.join(diff)}): refusing to mix "
            f"them in one directory; capture into a new -o directory, or rerun with the original "
            f"target, layer ids, tokenizer, --dtype and --max-length"
        )
    return manifest


def add_shard(directory: str | os.PathLike, entry: dict) -> dict:
    """Record a complete shard in the manifest (read-modify-write under the directory lock)."""
    directory = Path(directory)
    with manifest_lock(directory):
        manifest = read_manifest(directory)
        if manifest is None:
            raise SpecdecError(f"{directory / MANIFEST} disappeared while capturing")
        manifest["shards"] = [s for s in manifest["shards"] if s["file"] != entry["file"]] + [entry]
        manifest["num_samples"] = sum(s["num_samples"] for s in manifest["shards"])
        manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
        manifest["num_loss_tokens"] = sum(s.get("num_loss_tokens", 0) for s in manifest["shards"])
        manifest["bytes"] = sum(s.get("bytes", 0) for s in manifest["shards"])
        manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_json(directory / MANIFEST, manifest)
        return manifest


def done_sample_ids(manifest: dict | None) -> set[str]:
    return {sid for s in (manifest or {}).get("shards", []) for sid in s["sample_ids"]}


def clean_orphans(directory: str | os.PathLike, manifest: dict, rank: int = 0, world_size: int = 1) -> list[str]:
    """Delete this rank's shard files (and temp files) that the manifest does not list."""
    directory = Path(directory)
    listed = {s["file"] for s in manifest.get("shards", [])}
    removed = []
    for p in directory.iterdir():
        name = p.name
        if name.startswith(".shard-") and name.endswith(".tmp"):
            name = name[1:].split(".safetensors.")[0] + ".safetensors"
            if shard_owner(name, world_size) == rank:
                p.unlink(missing_ok=True)
                removed.append(p.name)
        elif shard_owner(name, world_size) == rank and name not in listed:
            p.unlink(missing_ok=True)
            removed.append(name)
    return removed


def next_shard_index(directory: str | os.PathLike, manifest: dict, rank: int, world_size: int) -> int:
    prefix = shard_name(rank, world_size, 0)[: -len("00000.safetensors")]
    used = [s["file"] for s in manifest.get("shards", [])] + [p.name for p in Path(directory).iterdir()]
    idx = [int(n[len(prefix) :].split(".")[0]) for n in used
           if n.startswith(prefix) and _SHARD_RE.match(n) and n[len(prefix) :].split(".")[0].isdigit()]
    return max(idx, default=-1) + 1


# -- writing -------------------------------------------------------------------------------


class ShardWriter:
    """Streams one shard whose sample lengths are known up front: header first, then each
    sample's rows written in place. `close()` fsyncs and renames; `abort()` leaves nothing."""

    def __init__(
        self,
        path: str | os.PathLike,
        sample_ids: Sequence[str],
        lengths: Sequence[int],
        *,
        hidden_size: int,
        num_aux: int,
        dtype: torch.dtype,
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.sample_ids = [str(s) for s in sample_ids]
        self.lengths = [int(n) for n in lengths]
        self.dtype = dtype
        self.H, self.A = hidden_size, num_aux * hidden_size
        n, N = len(self.lengths), sum(self.lengths)
        self.num_tokens = N
        es = torch.empty((), dtype=dtype).element_size()
        # Widest element first so every tensor starts aligned to its element size.
        layout = [
            ("offsets", torch.int64, [n + 1], 8 * (n + 1)),
            ("input_ids", torch.int32, [N], 4 * N),
            ("aux_hidden", dtype, [N, self.A], es * N * self.A),
            ("last_hidden", dtype, [N, self.H], es * N * self.H),
            ("loss_mask", torch.uint8, [N], N),
        ]
        header: dict = {"__metadata__": {"format": FORMAT, "sample_ids": json.dumps(self.sample_ids),
                                         **(metadata or {})}}
        self._start: dict[str, int] = {}
        pos = 0
        for name, dt, shape, size in layout:
            header[name] = {"dtype": _ST_DTYPE[dt], "shape": shape, "data_offsets": [pos, pos + size]}
            self._start[name] = pos
            pos += size
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        self._base = 8 + len(hjson)
        self.nbytes = self._base + pos
        self._row_bytes = {"input_ids": 4, "aux_hidden": es * self.A, "last_hidden": es * self.H, "loss_mask": 1}
        self._ctx = atomic_path(self.path)
        tmp = self._ctx.__enter__()
        self._f = open(tmp, "r+b")
        self._f.write(len(hjson).to_bytes(8, "little"))
        self._f.write(hjson)
        offsets = torch.tensor([0] + list(_cumsum(self.lengths)), dtype=torch.int64)
        self._f.write(offsets.numpy().tobytes())
        self._f.truncate(self.nbytes)
        self._next = 0  # next sample index to write
        self._row = 0  # its first row
        self.num_loss_tokens = 0
        self.closed = False

    def write(self, sample: dict[str, torch.Tensor]) -> None:
        """Write the next sample (tensors on any device; cast to the shard dtypes here)."""
        if self._next >= len(self.lengths):
            raise ValueError(f"{self.path.name}: more samples than planned ({len(self.lengths)})")
        T = self.lengths[self._next]
        parts = {
            "input_ids": sample["input_ids"].to("cpu", torch.int32),
            "aux_hidden": sample["aux_hidden"].to("cpu", self.dtype),
            "last_hidden": sample["last_hidden"].to("cpu", self.dtype),
            "loss_mask": sample["loss_mask"].to("cpu", torch.uint8),
        }
        for name, t in parts.items():
            if t.shape[0] != T:
                raise ValueError(f"{self.path.name}: sample {self._next} {name} has {t.shape[0]} rows, planned {T}")
            self._f.seek(self._base + self._start[name] + self._row * self._row_bytes[name])
            self._f.write(_as_bytes(t))
        self.num_loss_tokens += int(parts["loss_mask"].sum())
        self._next += 1
        self._row += T

    def close(self) -> dict:
        """Finish the shard (fsync + rename) and return its manifest entry."""
        if self._next != len(self.lengths):
            raise ValueError(f"{self.path.name}: {self._next} of {len(self.lengths)} samples written")
        self._f.close()
        self._ctx.__exit__(None, None, None)
        self.closed = True
        return {
            "file": self.path.name,
            "num_samples": len(self.sample_ids),
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "bytes": self.nbytes,
            "sample_ids": self.sample_ids,
        }

    def abort(self) -> None:
        """Drop the unfinished shard (its temporary file); a no-op once closed."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._f.close()
        with contextlib.suppress(BaseException):
            self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_shard(path: str | os.PathLike, samples: Sequence[dict], sample_ids: Sequence[str], *,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write a whole shard from in-memory samples (small captures, tests)."""
    first = samples[0]
    H = first["last_hidden"].shape[-1]
    w = ShardWriter(path, sample_ids, [s["input_ids"].shape[0] for s in samples], hidden_size=H,
                    num_aux=first["aux_hidden"].shape[-1] // H, dtype=dtype)
    try:
        for s in samples:
            w.write(s)
    except BaseException:
        w.abort()
        raise
    return w.close()


# -- reading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Loc:
    shard: int
    index: int


class CaptureStore:
    """Read a capture directory: `len(store)`, `store.sample(i)`, `store.iter_samples(...)`.

    Samples are dicts of CPU tensors: input_ids int32 [T], loss_mask uint8 [T],
    aux_hidden [T, 3H] and last_hidden [T, H] in the capture dtype.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise SpecdecError(
                f"no capture at {self.directory}: expected {MANIFEST} there; run "
                f"`specdec capture --target T --data REGEN.jsonl -o {self.directory}`"
            )
        self.manifest = manifest
        self.shards = manifest["shards"]
        self._locs: list[_Loc] = []
        self.sample_ids: list[str] = []
        for si, s in enumerate(self.shards):
            if not (self.directory / s["file"]).exists():
                raise SpecdecError(
                    f"{self.directory / s['file']} is listed in the manifest but missing; "
                    f"rerun the capture into this directory to redo it"
                )
            for j, sid in enumerate(s["sample_ids"]):
                self._locs.append(_Loc(si, j))
                self.sample_ids.append(sid)
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._locs)

    def __repr__(self) -> str:
        m = self.manifest
        return (f"CaptureStore({str(self.directory)!r}: {len(self)} samples, {m['num_tokens']} tokens, "
                f"target {m.get('target')!r}, aux ids {m.get('aux_layer_ids')}, {m.get('dtype')})")

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.manifest["aux_layer_ids"])

    def _open(self, si: int):
        h = self._handles.get(si)
        if h is None:
            from safetensors import safe_open

            h = safe_open(str(self.directory / self.shards[si]["file"]), framework="pt", device="cpu")
            self._handles[si] = h
            self._offsets[si] = h.get_tensor("offsets").tolist()
        return h

    def sample(self, i: int, names: tuple[str, ...] = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
               ) -> dict[str, torch.Tensor]:
        """Sample i's tensors; `names` picks a subset (ids and mask alone read ~1/1000 of the bytes)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a capture of {len(self)} samples")
        loc = self._locs[i]
        h = self._open(loc.shard)
        a, b = self._offsets[loc.shard][loc.index], self._offsets[loc.shard][loc.index + 1]
        return {name: h.get_slice(name)[a:b] for name in names}

    def lengths(self) -> list[int]:
        """Token count of every sample, in index order (reads only each shard's offsets)."""
        out: list[int] = []
        for si in range(len(self.shards)):
            self._open(si)
            off = self._offsets[si]
            out += [b - a for a, b in zip(off[:-1], off[1:])]
        return out

    def sample_id(self, i: int) -> str:
        return self.sample_ids[i]

    def indices(self, *, shuffle: bool = True, seed: int = 0, epoch: int = 0, rank: int = 0,
                world_size: int = 1, drop_uneven: bool = True) -> list[int]:
        """This rank's sample indices. With `drop_uneven`, every rank gets the same count (the
        last len % world_size samples of the order are dropped) so collective ops never hang."""
        n = len(self)
        if shuffle:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if drop_uneven and world_size > 1:
            order = order[: n - n % world_size]
        return order[rank::world_size]

    def iter_samples(self, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                     *, epoch: int = 0, drop_uneven: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        for i in self.indices(shuffle=shuffle, seed=seed, epoch=epoch, rank=rank,
                              world_size=world_size, drop_uneven=drop_uneven):
            yield self.sample(i)

    def mismatch_with(self, target) -> list[str]:
        """Why this capture does not fit `target` (empty when it does)."""
        m = self.manifest
        out = []
        if m.get("target_fingerprint") != target.fingerprint():
            out.append(f"target fingerprint {m.get('target_fingerprint')} vs {target.fingerprint()}")
        if list(m.get("aux_layer_ids", [])) != list(target.aux_layer_ids):
            out.append(f"aux layer ids {m.get('aux_layer_ids')} vs {target.aux_layer_ids}")
        if m.get("hidden_size") != target.hidden_size:
            out.append(f"hidden size {m.get('hidden_size')} vs {target.hidden_size}")
        return out


def human_bytes(n: float) -> str:
    if n <= 0:
        return "0 B"
    units = ["B", "KB", "MB", "GB", "TB", "PB"]
    k = min(len(units) - 1, int(math.log(n, 1000)))
    return f"{n / 1000 ** k:.{0 if k == 0 else 1}f} {units[k]}"
