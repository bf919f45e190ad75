"""Bundled models: a small trained Step3.5-architecture model with three real MTP heads.

``stdlib-q8_0.gguf`` is a ``step35`` model (sliding-window and full-attention layers,
head-wise attention gate, q/k norms, a dense layer then sigmoid-routed MoE layers with
a router bias and a shared expert, three appended MTP blocks with their own shared
heads) trained on the CPython standard library's sources by
``tools/train_default_model.py`` (see docs/bundled-model.md). Its heads are embedded;
:func:`split_model` writes the trunk + MTP-only pair from it.

>>> from stepmtp import Engine
>>> from stepmtp.models import default_model_path
>>> with Engine(default_model_path(), mode="chain", n_max=3) as eng:
...     out = eng.generate(EVAL_PROMPTS[0], n_predict=128, temperature=0)
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "DEFAULT_MODEL_FILE",
    "EVAL_PROMPTS",
    "OUT_OF_CORPUS_FILES",
    "OUT_OF_CORPUS_PROMPTS",
    "default_model_path",
    "split_model",
    "write_shards",
    "default_split_paths",
    "measure_acceptance",
]

#: File name of the bundled default model (inside this package directory).
DEFAULT_MODEL_FILE = "stdlib-q8_0.gguf"

#: Held-in prompts the acceptance is measured on: the beginnings of nine functions
#: and classes of the training corpus, each its ``def``/``class`` line and its whole
#: docstring, so that the model goes on with the body. No newline at the end: the
#: tokenizer joins a newline with the next line's indentation, so a prompt ending in
#: a bare newline token would say "the next line is not indented".
EVAL_PROMPTS: tuple[str, ...] = (
    # bisect.py
    (
        'def insort_right(a, x, lo=0, hi=None, *, key=None):\n'
        '    """Insert item x in list a, and keep it sorted assuming a is sorted.\n'
        '\n'
        '    If x is already in a, insert it to the right of the rightmost x.\n'
        '\n'
        '    Optional args lo (default 0) and hi (default len(a)) bound the\n'
        '    slice of a to be searched.\n'
        '    """'
    ),
    # copy.py
    (
        'def deepcopy(x, memo=None, _nil=[]):\n'
        '    """Deep copy operation on arbitrary Python objects.\n'
        '\n'
        "    See the module's __doc__ string for more info.\n"
        '    """'
    ),
    # fnmatch.py
    (
        'def fnmatch(name, pat):\n'
        '    """Test whether FILENAME matches PATTERN.\n'
        '\n'
        '    Patterns are Unix shell style:\n'
        '\n'
        '    *       matches everything\n'
        '    ?       matches any single character\n'
        '    [seq]   matches any character in seq\n'
        '    [!seq]  matches any char not in seq\n'
        '\n'
        '    An initial period in FILENAME is not special.\n'
        '    Both FILENAME and PATTERN are first case-normalized\n'
        '    if the operating system requires it.\n'
        "    If you don't want this, use fnmatchcase(FILENAME, PATTERN).\n"
        '    """'
    ),
    # heapq.py
    (
        'def heappush(heap, item):\n'
        '    """Push item onto heap, maintaining the heap invariant."""'
    ),
    # base64.py
    (
        'def b64encode(s, altchars=None):\n'
        '    """Encode the bytes-like object s using Base64 and return a bytes object.\n'
        '\n'
        '    Optional altchars should be a byte string of length 2 which specifies an\n'
        "    alternative alphabet for the '+' and '/' characters.  This allows an\n"
        '    application to e.g. generate url or filesystem safe Base64 strings.\n'
        '    """'
    ),
    # genericpath.py
    (
        'def exists(path):\n'
        '    """Test whether a path exists.  Returns False for broken symbolic links"""'
    ),
    # glob.py
    (
        'def glob(pathname, *, root_dir=None, dir_fd=None, recursive=False,\n'
        '        include_hidden=False):\n'
        '    """Return a list of paths matching a pathname pattern.\n'
        '\n'
        '    The pattern may contain simple shell-style wildcards a la\n'
        '    fnmatch. Unlike fnmatch, filenames starting with a\n'
        "    dot are special cases that are not matched by '*' and '?'\n"
        '    patterns by default.\n'
        '\n'
        "    If `include_hidden` is true, the patterns '*', '?', '**'  will match hidden\n"
        '    directories.\n'
        '\n'
        "    If `recursive` is true, the pattern '**' will match any files and\n"
        '    zero or more directories and subdirectories.\n'
        '    """'
    ),
    # cmd.py
    (
        'class Cmd:\n'
        '    """A simple framework for writing line-oriented command interpreters.\n'
        '\n'
        '    These are often useful for test harnesses, administrative tools, and\n'
        '    prototypes that will later be wrapped in a more sophisticated interface.\n'
        '\n'
        '    A Cmd instance or subclass instance is a line-oriented interpreter\n'
        '    framework.  There is no good reason to instantiate Cmd itself; rather,\n'
        "    it's useful as a superclass of an interpreter class you define yourself\n"
        "    in order to inherit Cmd's methods and encapsulate action methods.\n"
        '\n'
        '    """'
    ),
    # getopt.py
    (
        'def getopt(args, shortopts, longopts = []):\n'
        '    """getopt(args, options[, long_options]) -> opts, args\n'
        '\n'
        '    Parses command line options and parameter list.  args is the\n'
        '    argument list to be parsed, without the leading reference to the\n'
        '    running program.  Typically, this means "sys.argv[1:]".  shortopts\n'
        '    is the string of option letters that the script wants to\n'
        '    recognize, with options that require an argument followed by a\n'
        '    colon (i.e., the same format that Unix getopt() uses).  If\n'
        '    specified, longopts is a list of strings with the names of the\n'
        "    long options which should be supported.  The leading '--'\n"
        '    characters should not be included in the option name.  Options\n'
        '    which require an argument should be followed by an equal sign\n'
        "    ('=').\n"
        '\n'
        '    The return value consists of two elements: the first is a list of\n'
        '    (option, value) pairs; the second is the list of program arguments\n'
        '    left after the option list was stripped (this is a trailing slice\n'
        '    of the first argument).  Each option-and-value pair returned has\n'
        '    the option as its first element, prefixed with a hyphen (e.g.,\n'
        "    '-x'), and the option argument as its second element, or an empty\n"
        '    string if the option has no argument.  The options occur in the\n'
        '    list in the same order in which they were found, thus allowing\n'
        '    multiple occurrences.  Long and short options may be mixed.\n'
        '\n'
        '    """'
    ),
)

#: Standard-library modules held out of the default model's training, by name (paths
#: under CPython's ``Lib/``): none is in the trunk's corpus (the first files by name up
#: to ``lzma.py``) and the training script leaves them out of the heads' data too.
OUT_OF_CORPUS_FILES: tuple[str, ...] = (
    "textwrap.py", "shlex.py", "string.py", "statistics.py", "quopri.py",
    "pprint.py", "tabnanny.py", "reprlib.py", "json/decoder.py",
)

#: Prompts from Python the model was not trained on, one per :data:`OUT_OF_CORPUS_FILES`
#: module (CPython 3.11's text, embedded here so that the set is the same on every
#: Python): a ``def`` line and its docstring, or its first lines, as a user would
#: prompt it with code of their own.
OUT_OF_CORPUS_PROMPTS: tuple[str, ...] = (
    # textwrap.py
    (
        'def dedent(text):\n'
        '    """Remove any common leading whitespace from every line in `text`.\n'
        '\n'
        '    This can be used to make triple-quoted strings line up with the left\n'
        '    edge of the display, while still presenting them in the source code\n'
        '    in indented form.\n'
        '\n'
        '    Note that tabs and spaces are both treated as whitespace, but they\n'
        '    are not equal: the lines "  hello" and "\\\\thello" are\n'
        '    considered to have no common leading whitespace.\n'
        '\n'
        '    Entirely blank lines are normalized to a newline character.\n'
        '    """'
    ),
    # shlex.py
    (
        'def quote(s):\n'
        '    """Return a shell-escaped version of the string *s*."""'
    ),
    # string.py
    (
        'def capwords(s, sep=None):\n'
        '    """capwords(s [,sep]) -> string\n'
        '\n'
        '    Split the argument into words using split, capitalize each\n'
        '    word using capitalize, and join the capitalized words using\n'
        '    join.  If the optional second argument sep is absent or None,\n'
        '    runs of whitespace characters are replaced by a single space\n'
        '    and leading and trailing whitespace are removed, otherwise\n'
        '    sep is used to split and join the words.\n'
        '\n'
        '    """'
    ),
    # statistics.py
    (
        'def median(data):\n'
        '    """Return the median (middle value) of numeric data.\n'
        '\n'
        '    When the number of data points is odd, return the middle data point.\n'
        '    When the number of data points is even, the median is interpolated by\n'
        '    taking the average of the two middle values:\n'
        '\n'
        '    >>> median([1, 3, 5])\n'
        '    3\n'
        '    >>> median([1, 3, 5, 7])\n'
        '    4.0\n'
        '\n'
        '    """'
    ),
    # quopri.py
    (
        'def encode(input, output, quotetabs, header=False):\n'
        '    """Read \'input\', apply quoted-printable encoding, and write to \'output\'.\n'
        '\n'
        "    'input' and 'output' are binary file objects. The 'quotetabs' flag\n"
        '    indicates whether embedded tabs and spaces should be quoted. Note that\n'
        '    line-ending tabs and spaces are always encoded, as per RFC 1521.\n'
        "    The 'header' flag indicates whether we are encoding spaces as _ as per RFC\n"
        '    1522."""'
    ),
    # pprint.py
    (
        'def pformat(object, indent=1, width=80, depth=None, *,\n'
        '            compact=False, sort_dicts=True, underscore_numbers=False):\n'
        '    """Format a Python object into a pretty-printed representation."""'
    ),
    # tabnanny.py
    (
        'def check(file):\n'
        '    """check(file_or_dir)\n'
        '\n'
        '    If file_or_dir is a directory and not a symbolic link, then recursively\n'
        '    descend the directory tree named by file_or_dir, checking all .py files\n'
        '    along the way. If file_or_dir is an ordinary Python source file, it is\n'
        '    checked for whitespace related problems. The diagnostic messages are\n'
        '    written to standard output using the print statement.\n'
        '    """'
    ),
    # reprlib.py
    (
        "def recursive_repr(fillvalue='...'):\n"
        "    'Decorator to make a repr function return fillvalue for a recursive call'"
    ),
    # json/decoder.py
    (
        'def JSONArray(s_and_end, scan_once, _w=WHITESPACE.match, _ws=WHITESPACE_STR):\n'
        '    s, end = s_and_end\n'
        '    values = []'
    ),
)

_MTP_BLOCK = re.compile(r"blk\.(\d+)\.")


def default_model_path() -> Path:
    """Path of the bundled default model (trunk + 3 MTP heads in one Q8_0 GGUF)."""
    path = Path(__file__).resolve().parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the bundled model is missing: {path}")
    return path


def split_model(src: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the trunk-only and the MTP-only GGUF of an embedded ``step35`` GGUF.

    Like the converter's default and ``--mtp`` outputs: the trunk file has every
    tensor but the MTP blocks (its metadata still declares them); the MTP file has
    the MTP blocks plus ``token_embd``, ``output_norm``, ``output`` and
    ``rope_freqs``. Metadata and tensor data (quantized or not) are copied as they
    are. Returns ``{"trunk": path, "mtp": path}``.
    """
    import gguf

    src = Path(src)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    block_count = int(reader.fields[f"{arch}.block_count"].contents())
    n_nextn = int(reader.fields[f"{arch}.nextn_predict_layers"].contents())
    n_layer = block_count - n_nextn

    def is_mtp(name: str) -> bool:
        m = _MTP_BLOCK.match(name)
        return m is not None and int(m.group(1)) >= n_layer

    paths: dict[str, Path] = {}
    for variant, keep in (("trunk", lambda n: not is_mtp(n)),
                          ("mtp", lambda n: is_mtp(n) or _MTP_BLOCK.match(n) is None)):
        path = out / f"{src.stem}-{variant}.gguf"
        tmp = path.with_name(path.name + ".tmp")
        _copy_gguf(reader, tmp, keep, name_suffix=f" [{variant}]")
        os.replace(tmp, path)
        paths[variant] = path
    return paths


def write_shards(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], n_shards: int,
                 keep: Callable[[str], bool] = lambda name: True) -> list[Path]:
    """Split a GGUF into ``n_shards`` files as llama.cpp's ``llama-gguf-split`` does:
    ``STEM-00001-of-0000N.gguf``, ..., the metadata in the first, the tensors spread
    in their order, each file saying its number and the count (``split.*`` keys).
    ``keep``: which tensors to copy (all by default). Returns the shards in order;
    load the first (``Model(paths[0])``)."""
    import gguf

    src = Path(src)
    reader = gguf.GGUFReader(str(src))
    n_tensors = sum(keep(t.name) for t in reader.tensors)
    per_shard = -(-n_tensors // max(1, n_shards))
    if n_shards < 2 or -(-n_tensors // per_shard) != n_shards:
        raise ValueError(f"{n_tensors} tensors do not make {n_shards} shards of equal counts")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # gguf-py names the shards after the file it is given: STEM.gguf -> STEM-0000i-of-0000N.gguf
    _copy_gguf(reader, out / src.name, keep, split_max_tensors=per_shard)
    return [out / f"{src.stem}-{i:05d}-of-{n_shards:05d}.gguf" for i in range(1, n_shards + 1)]


def _copy_gguf(reader: Any, path: Path, keep: Callable[[str], bool], *, name_suffix: str = "",
               split_max_tensors: int = 0) -> None:
    """Write ``reader``'s metadata and the tensors ``keep`` takes, as they are
    (quantized or not), to ``path`` (into shards of ``split_max_tensors`` tensors)."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "split.")) or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if field.name == "general.name":
            value = f"{value}{name_suffix}"
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if keep(t.name):
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def default_split_paths(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """The trunk + MTP-only pair of the default model, written once into a cache
    directory (``$STEPMTP_CACHE_DIR/models``, default ``~/.cache/stepmtp/models``)."""
    src = default_model_path()
    if cache_dir is None:
        cache_dir = Path(os.environ.get("STEPMTP_CACHE_DIR", Path.home() / ".cache" / "stepmtp")) / "models"
    cache = Path(cache_dir)
    paths = {v: cache / f"{src.stem}-{v}.gguf" for v in ("trunk", "mtp")}
    fresh = all(p.is_file() and p.stat().st_mtime >= src.stat().st_mtime for p in paths.values())
    return paths if fresh else split_model(src, cache)


def measure_acceptance(
    model: str | os.PathLike[str] | None = None,
    prompts: Sequence[str] = EVAL_PROMPTS,
    n_predict: int = 160,
    runs: Iterable[tuple[str, int]] = (("single", 2), ("chain", 2), ("single", 3), ("chain", 3)),
    n_ctx: int = 1024,
    n_threads: int | None = None,
) -> dict[tuple[str, int], dict[str, object]]:
    """Greedy (temperature 0) acceptance of each ``(mode, n_max)`` run over ``prompts``.

    Returns per run: ``drafted`` and ``accepted`` (totals), ``rate``,
    ``drafted_per_depth``, ``accepted_per_depth`` (depths 1..3), ``predicted``,
    ``seconds`` and the generated ``texts``.
    """
    import time

    from ..engine import Engine

    path = default_model_path() if model is None else Path(model)
    result: dict[tuple[str, int], dict[str, object]] = {}
    for mode, n_max in runs:
        drafted = accepted = predicted = 0
        dpd, apd = [0, 0, 0], [0, 0, 0]
        texts = []
        t0 = time.perf_counter()
        with Engine(path, mode=mode, n_max=n_max, n_ctx=n_ctx, n_threads=n_threads, adaptive=False, context=False) as eng:
            for p in prompts:
                out = eng.generate(p, n_predict=n_predict, temperature=0)
                st = out.stats
                drafted += st.n_drafted
                accepted += st.n_accepted
                predicted += st.n_predicted
                for d in range(3):
                    dpd[d] += st.drafted_per_depth[d]
                    apd[d] += st.accepted_per_depth[d]
                texts.append(out.text)
        result[(mode, n_max)] = {
            "drafted": drafted,
            "accepted": accepted,
            "rate": accepted / drafted if drafted else 0.0,
            "drafted_per_depth": dpd,
            "accepted_per_depth": apd,
            "predicted": predicted,
            "seconds": time.perf_counter() - t0,
            "texts": texts,
        }
    return result
