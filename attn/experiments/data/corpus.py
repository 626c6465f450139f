"""Local text corpora for the `text` task: files read once into a uint8 array, cached on disk.

A corpus is one file, or the files under a directory whose relative paths match
a glob (`**/*.py`: `**/` is zero or more directories, `*` stays inside one name;
hidden files and directories are skipped, as `glob.glob` does; "" means every
file, `**/*`, under a directory you name, and `**/*.py` for the default). The
default (path "") is the running Python's standard-library sources: the `*.py` files
under sysconfig.get_paths()["stdlib"], without any directory named
site-packages or dist-packages (third-party code, different on every machine),
test, tests or idle_test (the stdlib's test suite, which holds files in other
encodings and broken ones on purpose) or pydoc_data (one generated 0.75 MB
string of English help text, which the split would otherwise hold out).

Files are taken in sorted order of their relative paths and joined, each
non-empty file followed by one NUL byte (0) that marks where it ends; accepted
text never holds a NUL byte, so it is a separator no file can fake. A file is
refused when it holds a NUL byte or is not valid UTF-8 (a binary file), naming
its path.

Train and held-out are split by file: the sha256 of a file's relative path,
read as a fraction of 2^64, sends the file to held-out when it is below
HELD_OUT (about 5% of the files, the same on every machine and Python). At
least one file goes each way; a corpus of one file holds out its last 5% of
bytes instead.

The joined bytes are cached as CACHE/KEY.npy with an index CACHE/KEY.json (the
files, their sizes, offsets and split), where CACHE is $ATTN_TEXT_CACHE or
~/.cache/attn/text and KEY hashes the root, the glob and every file's relative
path, size and mtime: a changed, added or removed file gives a new key.
Checking the key stats every file and reads none. Both files are written to a
temporary name and renamed; writing a new entry removes older ones of the same
root and glob. Corpora under CACHE_MIN_BYTES (1 MiB) are not cached on disk:
reading them costs less. Within a process the split arrays are also kept in
memory, so the trials of a sweep share one copy.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import sysconfig
from typing import Any

import numpy as np

from attn.config import invalid

HELD_OUT = 0.05
SEPARATOR = 0
DEFAULT_GLOB = "**/*.py"
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data")  # default only
CACHE_VERSION = 1
CACHE_MIN_BYTES = 1 << 20
_MEMO: dict[str, "Corpus"] = {}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A corpus split by file: the joined bytes of the train and held-out files, and which files they are."""

  root: str
  files: tuple[str, ...]
  sizes: tuple[int, ...]
  held_out: tuple[bool, ...]
  train: np.ndarray
  heldout: np.ndarray

  @property
  def num_bytes(self) -> int:
    return int(self.train.size + self.heldout.size)


def default_root() -> str:
  """The running Python's standard-library directory, the default corpus."""
  return sysconfig.get_paths()["stdlib"]


def cache_dir() -> str:
  """Where corpora are cached: $ATTN_TEXT_CACHE or ~/.cache/attn/text."""
  return os.environ.get("ATTN_TEXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "attn", "text")


def _glob_name(name: str) -> str:
  """The parameter that holds the glob beside the one holding the path (task.path -> task.glob)."""
  return "task.glob" if name.startswith("task.") else "--glob"


def _match(parts: list[str], pattern: list[str]) -> bool:
  if not pattern:
    return not parts
  if pattern[0] == "**":
    return any(_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
  return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _match(parts[1:], pattern[1:])


def matches(relpath: str, pattern: str) -> bool:
  """Whether a relative path (with /) matches a glob, `**` spanning any number of directories."""
  return _match(relpath.split("/"), [p for p in pattern.split("/") if p])


def list_files(path: str, pattern: str = "",
               name: str = "task.path") -> tuple[str, list[tuple[str, int, int]]]:
  """(root, [(relative path, size, mtime_ns)]) sorted by path; refuses a missing path or no match, naming it."""
  default = path == ""
  pattern = pattern or (DEFAULT_GLOB if default else "**/*")
  root = default_root() if default else os.path.abspath(os.path.expanduser(path))
  if os.path.isfile(root):
    st = os.stat(root)
    return root, [(os.path.basename(root), st.st_size, st.st_mtime_ns)]
  if not os.path.isdir(root):
    raise invalid(name, path, "an existing text file or directory ('' for the Python standard library)")
  relative = isinstance(pattern, str) and pattern.strip("/") and not pattern.startswith("/")
  if not relative or ".." in pattern.split("/"):
    raise invalid(_glob_name(name), pattern, "a glob such as '**/*.py' or '**/*.txt'")
  found, seen_any = [], False
  for d, dirs, names in os.walk(root):
    dirs[:] = [x for x in dirs if not x.startswith(".") and not (default and x in EXCLUDED_DIRS)]
    rel_dir = os.path.relpath(d, root).replace(os.sep, "/")
    for n in names:
      full = os.path.join(d, n)
      if n.startswith(".") or not os.path.isfile(full):
        continue
      seen_any = True
      rel = n if rel_dir == "." else f"{rel_dir}/{n}"
      if matches(rel, pattern):
        st = os.stat(full)
        found.append((rel, st.st_size, st.st_mtime_ns))
  if not seen_any:
    raise invalid(name, path or root, "a directory holding at least one (non-hidden) file; it is empty")
  if not found:
    raise invalid(_glob_name(name), pattern,
                  f"a glob matching at least one file under {root} (none matches; e.g. '**/*' for every file)")
  return root, sorted(found)


def held_out_fraction(relpath: str) -> float:
  """sha256 of the relative path as a number in [0, 1): below HELD_OUT means held out."""
  return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:16], 16) / 2.0**64


def split_files(relpaths: list[str]) -> list[bool]:
  """Which files are held out: those hashing below HELD_OUT, at least one and at most all but one."""
  u = [held_out_fraction(r) for r in relpaths]
  out = [x < HELD_OUT for x in u]
  if len(u) >= 2 and not any(out):
    out[int(np.argmin(u))] = True
  if len(u) >= 2 and all(out):
    out[int(np.argmax(u))] = False
  return out


def _read_checked(full: str, name: str) -> bytes:
  """A file's bytes; a binary file (a NUL byte, or not UTF-8) is refused naming its path."""
  with open(full, "rb") as f:
    data = f.read()
  nul = data.find(b"\0")
  if nul >= 0:
    raise invalid(name, full, f"text files only: this one has a NUL byte at offset {nul} (binary?); "
                  f"narrow {_glob_name(name)} or remove it")
  try:
    data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise invalid(name, full, f"UTF-8 text files only: this one is not UTF-8 at byte {e.start} (binary?); "
                  f"narrow {_glob_name(name)} or remove it") from None
  return data


def _atomic_save(path: str, write) -> None:
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "wb") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _build(root: str, listing: list[tuple[str, int, int]], name: str) -> tuple[np.ndarray, list[int]]:
  """The joined bytes (each non-empty file followed by NUL) and each file's offset into them."""
  single = os.path.isfile(root)
  chunks, offsets, at = [], [], 0
  for rel, _, _ in listing:
    data = _read_checked(root if single else os.path.join(root, *rel.split("/")), name)
    offsets.append(at)
    if data:
      chunks += [data, bytes([SEPARATOR])]
      at += len(data) + 1
  return np.frombuffer(b"".join(chunks), np.uint8), offsets


def _load_cached(key: str, n_files: int) -> tuple[np.ndarray, list[int]] | None:
  base = os.path.join(cache_dir(), key)
  try:
    with open(base + ".json", encoding="utf-8") as f:
      index = json.load(f)
    data = np.load(base + ".npy")
  except (OSError, ValueError):
    return None
  if data.dtype != np.uint8 or data.size != index.get("bytes") or len(index.get("files", [])) != n_files:
    return None
  return data, [f["offset"] for f in index["files"]]


def _save_cached(key: str, root: str, pattern: str, listing, data: np.ndarray, offsets: list[int],
                 held: list[bool]) -> None:
  base = os.path.join(cache_dir(), key)
  index = {"version": CACHE_VERSION, "root": root, "glob": pattern, "bytes": int(data.size),
           "files": [{"path": r, "size": s, "mtime_ns": m, "offset": o, "held_out": h}
                     for (r, s, m), o, h in zip(listing, offsets, held)]}
  try:
    os.makedirs(os.path.dirname(base), exist_ok=True)
    _atomic_save(base + ".npy", lambda f: np.save(f, data))
    _atomic_save(base + ".json", lambda f: f.write(json.dumps(index, indent=0).encode()))
  except OSError:
    return  # an unwritable cache costs a re-read next time, nothing else
  for name in os.listdir(cache_dir()):  # the same corpus before its files changed
    other = os.path.join(cache_dir(), name)
    if not name.endswith(".json") or name == key + ".json":
      continue
    try:
      with open(other, encoding="utf-8") as f:
        old = json.load(f)
      if old.get("root") == root and old.get("glob") == pattern:
        for stale in (other, other[:-len(".json")] + ".npy"):
          os.remove(stale)
    except (OSError, ValueError):
      pass


def load(path: str = "", pattern: str = "", name: str = "task.path") -> Corpus:
  """The corpus at `path` (a file, a directory filtered by `pattern`, or '' for the stdlib), split by file."""
  root, listing = list_files(path, pattern, name)
  default = path == ""
  pattern = pattern or (DEFAULT_GLOB if default else "**/*")
  key = hashlib.sha256(json.dumps([CACHE_VERSION, root, pattern, default, listing]).encode()).hexdigest()[:24]
  if key in _MEMO:
    return _MEMO[key]
  on_disk = sum(s for _, s, _ in listing) >= CACHE_MIN_BYTES
  cached = _load_cached(key, len(listing)) if on_disk else None
  relpaths = [r for r, _, _ in listing]
  held = split_files(relpaths)
  if cached is None:
    data, offsets = _build(root, listing, name)
    if on_disk:
      _save_cached(key, root, pattern, listing, data, offsets, held)
  else:
    data, offsets = cached
  ends = offsets[1:] + [data.size]
  if len(listing) == 1:  # one file: its last HELD_OUT of bytes
    cut = data.size - int(np.ceil(data.size * HELD_OUT))
    train, heldout = data[:cut], data[cut:]
  else:
    pick = lambda h: np.concatenate([data[o:e] for o, e, x in zip(offsets, ends, held) if x == h] or
                                    [np.zeros(0, np.uint8)])
    train, heldout = pick(False), pick(True)
  corpus = Corpus(root, tuple(relpaths), tuple(s for _, s, _ in listing), tuple(held), train, heldout)
  _MEMO[key] = corpus
  return corpus


def describe(corpus: Corpus) -> dict[str, Any]:
  """Files, bytes (joined, with the NUL after each file; file_bytes without) and the held-out share."""
  n_held = sum(corpus.held_out) if len(corpus.files) > 1 else 0
  return {"root": corpus.root, "files": len(corpus.files), "bytes": corpus.num_bytes,
          "file_bytes": sum(corpus.sizes),
          "held_out_files": n_held, "held_out_bytes": int(corpus.heldout.size),
          "held_out_share_bytes": corpus.heldout.size / max(corpus.num_bytes, 1)}
