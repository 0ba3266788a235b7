"""Token files: text in, one memory-mapped array of token ids out.

``python -m dtlib.train.data prepare FILES... --tokenizer bytes|DIR --out DIR``
(:func:`prepare`) tokenizes text files in order and writes two files to ``--out``:

- ``tokens.bin``: every token id, one after the other, as little-endian ``uint16``
  when the vocabulary has at most 65,536 ids, else ``uint32`` (half the bytes of
  ``uint32`` for every GPT-2- or Llama-2-sized vocabulary);
- ``meta.json``: the dtype, the vocabulary size, the token count and where they came
  from, written last, so a directory with ``meta.json`` is a finished one.

Training reads ``tokens.bin`` through ``numpy.memmap`` (:func:`open_tokens`): the
operating system pages in the windows a step reads, so a corpus larger than memory
costs only its page cache. The tokenizer is ``bytes`` (the 256 byte values of the
UTF-8 text: nothing to download, every text encodes) or a local Hugging Face
tokenizer directory (``AutoTokenizer.from_pretrained(DIR, local_files_only=True)``;
documents are separated by its end-of-sequence token when it has one).

Taught in: Chapter 10, "Real token files".
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["Tokenizer", "load_tokenizer", "token_dtype", "prepare", "BOOK_TEXT",
           "prepare_book_text", "read_meta",
           "open_tokens", "TOKENS", "META"]

TOKENS, META = "tokens.bin", "meta.json"
FORMAT = "dtlib-tokens-1"


@dataclass(frozen=True)
class Tokenizer:
    """What :func:`prepare` needs of a tokenizer.

    name: ``"bytes"`` or the tokenizer directory (recorded in ``meta.json``).
    vocab_size: ids are in ``[0, vocab_size)``.
    encode: text -> token ids.
    eos: the id between two documents, or None (the byte tokenizer has none).
    """

    name: str
    vocab_size: int
    encode: Callable[[str], Sequence[int]]
    eos: int | None = None


def _bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` or a local Hugging Face tokenizer directory -> :class:`Tokenizer`.

    Raises:
        ValueError: ``spec`` is neither ``bytes`` nor a directory.

    Taught in: Chapter 10, "Real token files".
    """
    if spec == "bytes":
        return Tokenizer("bytes", 256, _bytes)
    if not os.path.isdir(spec):
        raise ValueError(f"tokenizer={spec!r} is not a directory; allowed: 'bytes' "
                         "or a local Hugging Face tokenizer directory")
    from transformers import AutoTokenizer  # the .[hf] extra, only when asked for

    tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    return Tokenizer(spec, len(tok),
                     lambda text: tok(text, add_special_tokens=False)["input_ids"],
                     tok.eos_token_id)


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32`` (little-endian)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not 1 <= vocab_size <= 2 ** 32:
        raise ValueError(f"vocab_size={vocab_size!r} must be an integer in "
                         "[1, 2**32]")
    return np.dtype("<u2" if vocab_size <= 2 ** 16 else "<u4")


def _expand(patterns: Sequence[str]) -> list[str]:
    """Files, in order; a pattern with ``*``, ``?`` or ``[`` (``**`` recursing)
    becomes its sorted matches, so a quoted pattern reads the same on any shell."""
    files: list[str] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            found = sorted(p for p in glob.glob(pattern, recursive=True)
                           if os.path.isfile(p))
            if not found:
                raise ValueError(f"text file pattern {pattern!r} matches no file")
            files += found
        elif not os.path.isfile(pattern):
            raise ValueError(f"text file {pattern!r} does not exist; allowed: "
                             "existing files or glob patterns")
        else:
            files.append(pattern)
    return files


def prepare(patterns: Sequence[str], tokenizer: Tokenizer, out: str,
            force: bool = False) -> dict:
    """Tokenize ``patterns``' files in order into ``out/tokens.bin`` and
    ``out/meta.json``.

    Args:
        patterns: text files or glob patterns (``'dtlib/**/*.py'``).
        tokenizer: from :func:`load_tokenizer`.
        out: the directory to write (created).
        force: replace the token file ``out`` already holds (without it, an
            existing ``tokens.bin`` or ``meta.json`` is refused: a run may be
            training on it, and its checkpoints record what it was).
    Returns:
        The metadata written to ``meta.json``.
    Raises:
        ValueError: no text file; ``out`` holds a token file and not ``force``.

    Taught in: Chapter 10, "Real token files".
    """
    files = _expand(patterns)
    if not files:
        raise ValueError("no text files given; allowed: one or more files or patterns")
    held = [n for n in (TOKENS, META) if os.path.exists(os.path.join(out, n))]
    if held and not force:
        raise ValueError(f"out={out!r} already holds {' and '.join(held)} (a token "
                         "file runs and checkpoints may depend on); nothing was "
                         "written: choose another --out, or pass --force to replace it")
    dtype = token_dtype(tokenizer.vocab_size)
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, META)
    if os.path.exists(meta_path):
        os.remove(meta_path)  # unfinished until the new meta.json exists
    n = 0
    with open(os.path.join(out, TOKENS), "wb") as f:
        for i, path in enumerate(files):
            with open(path, encoding="utf-8", errors="replace") as src:
                ids = np.asarray(tokenizer.encode(src.read()), dtype=np.int64)
            if tokenizer.eos is not None and i:
                ids = np.concatenate([[tokenizer.eos], ids])
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise ValueError(f"{path}: a token id outside [0, "
                                 f"{tokenizer.vocab_size}) from {tokenizer.name}")
            ids.astype(dtype).tofile(f)
            n += int(ids.size)
    if n < 2:
        raise ValueError(f"{len(files)} file(s) gave {n} token(s); need at least 2")
    meta = {"format": FORMAT, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
            "n_tokens": n, "tokenizer": tokenizer.name, "documents": len(files),
            "eos": tokenizer.eos}
    tmp = meta_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, meta_path)
    return meta


#: The book's own prose and dtlib's code, relative to the repository: real text to
#: train on with nothing to download (the README's example, Chapter 15's runs).
BOOK_TEXT = ("book/*.md", "dtlib/**/*.py")


def prepare_book_text(out: str) -> dict:
    """Tokenize :data:`BOOK_TEXT` with the byte tokenizer into ``out`` (refused, as
    :func:`prepare` refuses, where ``out`` holds a token file), from wherever the
    caller runs. Returns the metadata.

    Taught in: Chapter 15, "Loss against tokens, on this book's text".
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return prepare([os.path.join(root, p) for p in BOOK_TEXT], load_tokenizer("bytes"),
                   out)


def read_meta(directory: str) -> dict:
    """``directory/meta.json``, checked; a clear ValueError for anything else.

    Taught in: Chapter 10, "Real token files".
    """
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        raise ValueError(f"data={directory!r} has no {META}; allowed: a directory "
                         "written by `python -m dtlib.train.data prepare`")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"data={directory!r}: {META} is not {FORMAT!r}")
    return meta


def open_tokens(directory: str) -> tuple[np.memmap, dict]:
    """The token file of ``directory``, memory-mapped read-only, and its metadata.

    Taught in: Chapter 10, "Real token files".
    """
    meta = read_meta(directory)
    path = os.path.join(directory, TOKENS)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    expected = meta["n_tokens"] * dtype.itemsize
    if not os.path.isfile(path):
        raise ValueError(f"data={directory!r} has no {TOKENS} (its {META} says "
                         f"{meta['n_tokens']} tokens); allowed: a directory written by "
                         "`python -m dtlib.train.data prepare`")
    if os.path.getsize(path) != expected:
        raise ValueError(f"data={directory!r}: {TOKENS} holds "
                         f"{os.path.getsize(path)} bytes, its {META} says {expected} "
                         f"({meta['n_tokens']} tokens of {dtype.itemsize} bytes): "
                         "truncated or replaced; prepare it again")
    return np.memmap(path, dtype=dtype, mode="r", shape=(meta["n_tokens"],)), meta
