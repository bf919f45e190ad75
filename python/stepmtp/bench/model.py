"""Which model the bench runs: the default one, named ones, and the bench-size one
(the default one with Step-3.5-Flash's cost shape, ``flash.shape_like_flash``).

``DEFAULT_MODEL`` is the one place that names the default: the bundled trained
model. ``tiny-agree`` (generated, heads that partly agree with the trunk by
construction, so its counts are known exactly) is what the CI gate runs.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

__all__ = ["DEFAULT_MODEL", "MODEL_NAMES", "cache_dir", "resolve_model", "bench_model", "file_sha256",
           "ascii_byte_tokens", "bench_scale"]

#: The model ``python -m stepmtp.bench`` runs without ``--model``.
DEFAULT_MODEL = "bundled"

#: Names ``--model`` accepts besides a path.
MODEL_NAMES = ("tiny-agree", "bundled")

#: Default size of the bench-size model: MB of weights one 1-row target decode reads
#: (Step-3.5-Flash's shape at scale 1/16 with the hidden width 4x the trained one, F16;
#: the file is ~18x that, as Step-3.5-Flash's experts are ~18x its active weights):
#: well beyond a CPU's last-level cache, so that a decode is memory-bound.
BENCH_MODEL_MB = 180

#: The bench-size model's hidden width, in trained widths (a power of 4, see
#: ``flash._widen_hidden``), and its matrices' type. At the trained width (128) a
#: decode on a CPU was neither memory-bound nor Step-3.5-Flash-shaped: 128-long dot
#: products pay their fixed cost again for every row, and attention (Step-3.5-Flash's
#: head counts over a 128-wide state) cost as much as the weights; and Q8_0 is decoded
#: at a quarter of a core's memory bandwidth, F16 near it. Measured (one thread, ms of a
#: 1-row decode; 2/3/4-row verify and a head, relative to it): trained width, Q8_0, 96
#: MB: 40.3; 1.70 / 2.43 / 3.06, 0.033-0.041. 4x wider, Q8_0, 96 MB: 19.7; 1.97 / 2.60 /
#: 3.08, 0.052-0.065. 4x wider, F16, 180 MB: 34.2; 1.58 / 2.18 / 2.66, 0.054-0.070.
#: Step-3.5-Flash, memory-bound: 1.45 / 1.88 / 2.31, 0.071.
BENCH_HIDDEN_FACTOR = 4
BENCH_F16 = True

#: The bench-size model's attention head width: Step-3.5-Flash's 128, the trained 32
#: with zero channels (fewer heads, as many bytes). At 32 wide a CPU's attention cost
#: what a decode's weights do per row: per head and cell a 32-long dot product and a
#: 32-long multiply-add, whose fixed costs (and, on AVX-512, whose whole length before
#: patch 0013) dwarfed the arithmetic, paid again for each verified row. Measured on a
#: Zen 4 core (one thread, ms of a 1-row decode; 2/3/4-row verify relative to it, the
#: spread of 2-3 runs): 32 wide, before patch 0013: 23.8; 1.86 / 2.82 / 3.72; after it:
#: 17.3-18.6; 1.83-1.93 / 2.53-2.65 / 2.99-3.42; 128 wide: 16.6-17.0; 1.68-1.97 /
#: 2.41-2.57 / 2.81-3.10 (both cores: 15.6; 1.61 / 2.06 / 2.52).
BENCH_HEAD_DIM = 128

#: Bumped when the bench-size model's recipe changes (a new cache file).
BENCH_MODEL_RECIPE = "flash3"


def cache_dir() -> Path:
    return Path(os.environ.get("STEPMTP_CACHE_DIR", Path.home() / ".cache" / "stepmtp"))


def resolve_model(spec: str | os.PathLike[str] | None = None) -> Path:
    """A model path from a name (``tiny-agree``, ``bundled``) or a path; None: the default."""
    spec = DEFAULT_MODEL if spec is None else spec
    if spec == "tiny-agree":
        return _tiny_agree()
    if spec == "bundled":
        try:
            from ..models import default_model_path
        except ImportError as e:  # pragma: no cover - depends on the package's state
            raise FileNotFoundError(f"no bundled model in this build of stepmtp ({e})") from None
        return default_model_path()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"model not found: {path} (a GGUF path, or one of {', '.join(MODEL_NAMES)})")
    return path


def _tiny_agree() -> Path:
    """The tiny agree model (seed 0) with its byte tokens spelled in ASCII (see
    :func:`ascii_byte_tokens`), written afresh each time (it takes a fraction of a
    second, and a cached copy could predate a change to its generator). The bench keeps
    its own copy, replaced atomically and only when its bytes change: a file rewritten in
    place while a run has it mapped would crash that run (SIGBUS)."""
    import filecmp
    import tempfile

    from ..tiny import AGREE_FILE, write_agree_model

    d = cache_dir() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    path = d / AGREE_FILE
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        fresh = Path(tmp) / "ascii.gguf"
        ascii_byte_tokens(write_agree_model(tmp, seed=0)[0], fresh)
        if not (path.is_file() and filecmp.cmp(fresh, path, shallow=False)):
            os.replace(fresh, path)
    return path


def ascii_byte_tokens(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy a byte-level BPE GGUF with the tokens of the bytes 0x80-0xff renamed to the
    ASCII text ``~xHH~``. The tiny agree model's greedy walk emits those tokens alone,
    which is not valid UTF-8: the C++ llama-server then refuses the whole answer (its
    output parser needs valid text). Token ids, and so every prediction, are unchanged;
    only such tokens' text is. Prompts must be ASCII (they never produce these tokens)."""
    import gguf

    from ..tiny import bytes_to_unicode

    b2u = bytes_to_unicode()
    high = {b2u[b]: "~x%02x~" % b for b in range(0x80, 0x100)}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = f.contents()
        if name == "tokenizer.ggml.tokens":
            value = [high.get(t, t) for t in value]
            if len(set(value)) != len(value):
                raise ValueError(f"{src}: renaming the byte tokens would duplicate a token")
        w.add_key_value(name, value, f.types[0],
                        sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=None if t.data.dtype != "uint8" else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def file_sha256(path: str | os.PathLike[str], *, _cache: dict[tuple[str, int, int], str] = {}) -> str:
    """sha256 of a file (memoised on path, size and mtime)."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _cache[key] = h.hexdigest()
    return _cache[key]


def bench_model(src: str | os.PathLike[str], size_mb: float = BENCH_MODEL_MB, *, quiet: bool = False) -> Path:
    """The bench-size variant of ``src``: its predictions, Step-3.5-Flash's cost shape
    (45 trunk layers, heads and output head in proportion, 36 experts per used one, the
    hidden width ``BENCH_HIDDEN_FACTOR`` x the trained one, heads ``BENCH_HEAD_DIM`` wide, F16), at the scale where a
    1-row target decode reads about ``size_mb`` MB (rounded to a multiple of 1/64); made
    on first use and cached in ``~/.cache/stepmtp/bench`` (``STEPMTP_CACHE_DIR``), with a
    progress bar on a terminal unless ``quiet``."""
    from ..llama import _Progress
    from . import flash

    src = Path(src)
    hidden = BENCH_HIDDEN_FACTOR * _n_embd(src)
    scale = bench_scale(size_mb, hidden)
    tag = file_sha256(src)[:12]
    dst = cache_dir() / "bench" / f"{src.stem}-{tag}-{BENCH_MODEL_RECIPE}-{int(size_mb)}mb.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"bench: writing the bench-size model {dst} (Step-3.5-Flash's shape at scale {scale:g}, "
              f"hidden {hidden}, ~{size_mb:.0f} MB read per decode, a ~{18 * size_mb / 1e3:.1f} GB file; once)",
              file=sys.stderr)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    try:
        # a bar where a person watches; a log gets the line above only
        bar = {"progress": _Progress(dst.name, None, verb="writing")} if not quiet and sys.stderr.isatty() else {}
        flash.shape_like_flash(src, tmp, scale, hidden=hidden, head_dim_new=BENCH_HEAD_DIM, f16=BENCH_F16, **bar)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


def bench_weights(path: str | os.PathLike[str], qtype: str, *, quiet: bool = False) -> Path:
    """``path`` (a bench-size model) with its weights quantized to ``qtype`` by
    llama.cpp's own quantizer (``stepmtp.llama.quantize``, the choices llama-quantize
    makes), beside it in the cache; ``path`` itself for F16, its own type."""
    from ..llama import quantize

    src = Path(path)
    qtype = qtype.upper()
    if qtype == "F16":
        return src
    dst = src.with_name(f"{src.stem}-{qtype}.gguf")
    if dst.is_file():
        return dst
    if not quiet:
        print(f"bench: quantizing the bench model to {qtype}: {dst} (once)", file=sys.stderr)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    try:
        quantize(src, tmp, qtype)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def bench_scale(size_mb: float, hidden: int = BENCH_HIDDEN_FACTOR * 128) -> float:
    """The shaping scale of a bench-size model of hidden width ``hidden`` reading
    ``size_mb`` MB per decode."""
    from .flash import Q8_0_BYTES, scale_for_mb

    per_param = 2.0 if BENCH_F16 else Q8_0_BYTES
    return max(1, round(scale_for_mb(size_mb, hidden, bytes_per_param=per_param) * 64)) / 64


def _n_embd(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(r.fields["general.architecture"].contents())
    return int(r.fields[f"{arch}.embedding_length"].contents())
