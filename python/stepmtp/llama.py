"""Typed wrappers over llama.cpp: Model, Context and Batch.

Ownership is explicit: a Model owns its Contexts (closing the model closes them
first), a Context owns its output buffers. Arrays returned by ``Context.logits``,
``Context.logits_rows`` and ``Context.nextn`` are numpy *views* into llama.cpp's
buffers, without copies: they are valid until the next ``decode`` on that context
(or its close). Copy them (``.copy()``) to keep them longer.
"""
from __future__ import annotations

import os
import re
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .binding import ErrorCapture, LlamaError, ensure_backend, ffi, lib
from .placement import Placement, kv_type
from .rpc import Servers, _local_devices, parse_servers

__all__ = ["Model", "Context", "Batch", "LlamaError", "ModelLoadError", "KVFullError", "default_threads",
           "shard_paths", "QUANT_TYPES", "quantize"]


class ModelLoadError(LlamaError):
    """A model file could not be loaded; the message names the file and the reason."""


class KVFullError(LlamaError):
    """A decode found no room in the KV cache for its batch (nothing was decoded)."""


def default_threads() -> int:
    """STEPMTP_N_THREADS if set, else the CPUs this process may run on (llama.cpp's
    own default is a fixed 4)."""
    env = os.environ.get("STEPMTP_N_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def cpu_only() -> bool:
    """Whether llama.cpp has no GPU here to run anything on (RPC servers are a model's
    own: ``Model.rpc``)."""
    ensure_backend()
    return not _local_devices()


def _gpu_layers(n: int | str) -> int:
    if isinstance(n, str):
        if n in ("all", "auto"):
            return -1
        n = int(n)
    return int(n)


#: llama.h's LLAMA_STATE_SEQ_FLAGS_SWA_ONLY: a sequence's sliding-window cells alone
_SWA_ONLY = 1

#: llama.cpp's split file names (llama_split_path): PREFIX-00001-of-00003.gguf
_SHARD = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_paths(path: str | os.PathLike[str]) -> list[Path]:
    """Every file of a model split into shards, as llama.cpp finds them from the first
    one's name (``...-00001-of-0000N.gguf``); ``[path]`` for a name that is not a shard's."""
    path = Path(path)
    m = _SHARD.match(path.name)
    if m is None:
        return [path]
    n = int(m["count"])
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _check_gguf(path: Path) -> None:
    # llama.cpp reports these too, but only in its log; a direct reason reads better
    shards = shard_paths(path)
    if len(shards) > 1 and shards[0] != path:
        raise ModelLoadError(f"{path}: a shard other than the first: load {shards[0].name} (llama.cpp finds "
                             "the others from its name)")
    for i, shard in enumerate(shards):
        what = f"shard {i + 1} of {len(shards)}: {shard}" if len(shards) > 1 else str(shard)
        if not shard.exists():
            raise ModelLoadError(f"{path}: {what}: no such file" if i else f"{shard}: no such file")
        if not shard.is_file():
            raise ModelLoadError(f"{what}: not a regular file")
        with open(shard, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{what}: not a GGUF file (magic {magic!r})")


#: the weight types ``quantize`` writes, by llama-quantize's names
QUANT_TYPES = {"F16": "LLAMA_FTYPE_MOSTLY_F16", "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
               "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
               "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
               "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str, *,
             n_threads: int = 0) -> Path:
    """Write ``src`` with its weights quantized to ``qtype`` (a name of ``QUANT_TYPES``:
    llama-quantize's), through llama.cpp's own ``llama_model_quantize``, with its
    per-tensor choices (a Q4_K_M file keeps some tensors Q6_K; a row too short for a
    K-quant's 256-wide blocks falls back as llama-quantize does). Returns ``dst``."""
    ensure_backend()
    src, dst = Path(src), Path(dst)
    _check_gguf(src)
    name = qtype.upper()
    if name not in QUANT_TYPES:
        raise ValueError(f"quantize: unknown type {qtype!r} (one of {', '.join(QUANT_TYPES)})")
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, QUANT_TYPES[name])
    params.nthread = n_threads
    params.allow_requantize = True  # an F16 or Q8_0 source, as llama-quantize --allow-requantize
    dst.parent.mkdir(parents=True, exist_ok=True)
    with ErrorCapture() as cap:
        rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ffi.new("llama_model_quantize_params *", params))
    if rc != 0:
        dst.unlink(missing_ok=True)
        raise ModelLoadError(cap.message(f"{src}: quantizing to {name} failed"))
    return dst


class _Progress:
    """Loading progress on a terminal: a one-line bar on stderr (``verb`` names what
    is done: the bench-size model's writing draws the same bar)."""

    def __init__(self, label: str, callback: Callable[[float], None] | None, verb: str = "loading") -> None:
        self.label = label
        self.callback = callback
        self.verb = verb
        self.last = -1

    def __call__(self, frac: float) -> None:
        if self.callback is not None:
            self.callback(frac)
            return
        pct = int(frac * 100)
        if pct == self.last:
            return
        self.last = pct
        bar = "#" * (pct // 4)
        end = "\n" if pct >= 100 else ""
        sys.stderr.write(f"\r{self.verb} {self.label} [{bar:<25}] {pct:3d}%{end}")
        sys.stderr.flush()


@ffi.def_extern()
def stepmtp_progress_cb(progress: float, user_data: object) -> bool:
    try:
        ffi.from_handle(user_data)(progress)
    except Exception:
        pass
    return True  # never cancel the load


class _Closing:
    """``with`` support and freeing at garbage collection for objects with close()."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):  # noqa: ANN204 - returns the subclass
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Model(_Closing):
    """A GGUF model loaded by llama.cpp.

    Args:
        path: the .gguf file; for a model split into shards the first one
            (``...-00001-of-0000N.gguf``), llama.cpp loads the others from its name.
        n_gpu_layers: layers to offload to the GPU (``"all"`` or -1 for all; 0 on CPU).
        rpc: RPC servers, ``"host:port,host:port"`` or a list (llama-server's ``--rpc``):
            their devices come first among the GPUs that ``n_gpu_layers`` fills.
        placement: tensor buffer overrides, devices, split mode (``placement.Placement``:
            llama-server's ``-ot``, ``-cmoe``, ``-dev``, ``-sm``, ``-ts``, ``-mg``); buffer
            types and devices may name this model's RPC servers'.
        use_mmap, use_mlock: as llama.cpp's options of the same names (``--no-mmap``,
            ``--mlock``).
        progress: True to draw a progress bar on stderr, or a callable taking a
            fraction in [0, 1].
        vocab_only: load only the vocabulary (tokenizing without weights).

    Raises:
        ModelLoadError: the file (or a shard) is missing, not a GGUF, or llama.cpp
            refused it (the message carries llama.cpp's reason, e.g. the missing tensor).
        PlacementError: a buffer type or device ``placement`` names does not exist.
        RPCError: an RPC server could not be reached or was lost during the load.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int | str = 0,
        use_mmap: bool = True,
        use_mlock: bool = False,
        progress: bool | Callable[[float], None] = False,
        vocab_only: bool = False,
        rpc: str | Sequence[str] | None = None,
        placement: Placement | None = None,
        llama_params: Mapping[str, Any] | None = None,
    ) -> None:
        ensure_backend()
        self.path = Path(path)
        self._ptr = ffi.NULL
        #: the RPC servers holding layers of this model (None: local only)
        self.rpc: Servers | None = None
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        _check_gguf(self.path)

        params = lib.llama_model_default_params()
        params.n_gpu_layers = _gpu_layers(n_gpu_layers)
        # llama.cpp takes one load mode where it took two flags
        params.load_mode = (lib.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mlock else lib.LLAMA_LOAD_MODE_MMAP) if use_mmap \
            else (lib.LLAMA_LOAD_MODE_MLOCK if use_mlock else lib.LLAMA_LOAD_MODE_NONE)
        params.vocab_only = vocab_only
        # llama.cpp leaves a model's MTP blocks unloaded unless asked; the heads draft
        # from the same model object as the trunk
        params.load_mtp = True
        from .llama_params import apply  # the server's model parameters by name (--override-kv, ...)

        self._kv_keep = apply(params, llama_params)
        servers = parse_servers(rpc)
        if servers:
            self.rpc = Servers(servers, n_gpu_layers=params.n_gpu_layers)
            params.devices = self.rpc.devices
        self.placement = placement or Placement()
        # what the parameters point into (override patterns, device lists): llama.cpp
        # keeps the model's parameters, so this lives as long as the model
        self._params_keep = self.placement.apply(params, self.rpc.remote_devices if self.rpc is not None else ())
        handle = None
        if progress:
            handle = ffi.new_handle(_Progress(self.path.name, progress if callable(progress) else None))
            params.progress_callback = lib.stepmtp_progress_cb
            params.progress_callback_user_data = handle

        with ErrorCapture() as cap:
            ptr = lib.llama_model_load_from_file(os.fsencode(self.path), params)
        if self.rpc is not None and self.rpc.lost():
            if ptr != ffi.NULL:
                lib.llama_model_free(ptr)
            self.rpc.check(cap.message(f"{self.path}: loading"))
        if ptr == ffi.NULL:
            raise ModelLoadError(cap.message(f"{self.path}: llama.cpp could not load the model"))
        self._ptr = ptr
        if self.rpc is not None:
            self.rpc.attach(self)
        self._vocab_ptr = lib.llama_model_get_vocab(ptr)

        self.n_vocab: int = lib.llama_vocab_n_tokens(self._vocab)
        self.n_embd: int = lib.llama_model_n_embd(ptr)
        #: the sliding window of its sliding-window layers (0: none)
        self.n_swa: int = lib.llama_model_n_swa(ptr)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(ptr)
        #: MTP blocks the file declares, and how many of them it carries weights for
        #: (0 for a trunk-only file of a split pair).
        self.n_mtp_blocks: int = lib.llama_mtp_model_n_blocks(ptr)
        self.n_mtp_blocks_loaded: int = lib.llama_mtp_model_n_blocks_loaded(ptr)
        self.n_layer_trunk: int = lib.llama_mtp_model_n_layer_trunk(ptr)
        self.bos: int = lib.llama_vocab_bos(self._vocab)
        self.eos: int = lib.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(self._vocab))
        self.add_eos: bool = bool(lib.llama_vocab_get_add_eos(self._vocab))
        self._eog = np.array(
            [bool(lib.llama_vocab_is_eog(self._vocab, t)) for t in range(self.n_vocab)], dtype=bool
        )

    # -- lifetime -------------------------------------------------------------

    @property
    def ptr(self):  # noqa: ANN201 - a cffi pointer
        if self._ptr == ffi.NULL:
            raise LlamaError("the model is closed")
        return self._ptr

    @property
    def _vocab(self):  # noqa: ANN202 - the vocabulary lives in the model: freed with it
        if self._ptr == ffi.NULL:
            raise LlamaError("the model is closed")
        return self._vocab_ptr

    def close(self) -> None:
        """Free the model, after every context made from it."""
        for ctx in list(self._contexts):
            ctx.close()
        if self._ptr != ffi.NULL:
            lib.llama_model_free(self._ptr)
            self._ptr = ffi.NULL

    # -- metadata -------------------------------------------------------------

    def check_mtp(self) -> None:
        """LlamaError naming what is missing unless the model carries its MTP heads."""
        if self.has_mtp:
            return
        if self.n_mtp_blocks == 0:
            raise LlamaError(f"{self.path}: the model has no MTP blocks")
        raise LlamaError(
            f"{self.path}: declares {self.n_mtp_blocks} MTP blocks but carries weights for "
            f"{self.n_mtp_blocks_loaded} (a trunk-only file? load the MTP file as the draft model)"
        )

    @property
    def has_mtp(self) -> bool:
        """True when the file carries the weights of every MTP block it declares."""
        return self.n_mtp_blocks > 0 and self.n_mtp_blocks_loaded == self.n_mtp_blocks

    def meta(self, key: str) -> str | None:
        """One GGUF metadata value as a string (arrays are summarised by llama.cpp)."""
        buf = ffi.new("char[]", 4096)
        n = lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ffi.new("char[]", n + 1)
            lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return ffi.string(buf).decode("utf-8", "replace")

    def metadata(self) -> dict[str, str]:
        out = {}
        key = ffi.new("char[]", 512)
        for i in range(lib.llama_model_meta_count(self.ptr)):
            lib.llama_model_meta_key_by_index(self.ptr, i, key, len(key))
            name = ffi.string(key).decode("utf-8", "replace")
            out[name] = self.meta(name) or ""
        return out

    @property
    def description(self) -> str:
        buf = ffi.new("char[]", 256)
        lib.llama_model_desc(self.ptr, buf, len(buf))
        return ffi.string(buf).decode("utf-8", "replace")

    @property
    def size(self) -> int:
        return int(lib.llama_model_size(self.ptr))

    @property
    def n_params(self) -> int:
        return int(lib.llama_model_n_params(self.ptr))

    @property
    def chat_template(self) -> str | None:
        p = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")

    def apply_builtin_template(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
                               template: str | None = None) -> str:
        """llama.cpp's own (non-jinja) chat formatting: ``template`` is a built-in
        name (``chatml``, ``llama3``, ...) or a template source it recognises; by
        default the model's. ValueError when llama.cpp knows no such template."""
        return apply_builtin_template(template or self.chat_template or "chatml", messages, add_generation_prompt)

    # -- vocabulary -----------------------------------------------------------

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT and the like)."""
        return bool(self._eog[token]) if 0 <= token < self.n_vocab else False

    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids. ``add_special`` adds BOS/EOS as the model asks;
        ``parse_special`` turns written special tokens (``<|im_start|>``) into their ids."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n_max = len(data) + 8
        buf = ffi.new("llama_token[]", n_max)
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = ffi.new("llama_token[]", n_max)
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
            if n < 0:
                raise LlamaError("tokenization failed")
        return list(ffi.unpack(buf, n))

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be a partial UTF-8 sequence)."""
        self._check_token(token)
        buf = ffi.new("char[]", 64)
        n = lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return ffi.unpack(buf, n)

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        """Token ids to text (invalid UTF-8 is replaced)."""
        toks = list(tokens)
        for t in toks:
            self._check_token(t)
        arr = ffi.new("llama_token[]", toks)
        cap = max(16, 8 * len(toks))
        buf = ffi.new("char[]", cap)
        n = lib.llama_detokenize(self._vocab, arr, len(toks), buf, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n
            buf = ffi.new("char[]", cap)
            n = lib.llama_detokenize(self._vocab, arr, len(toks), buf, cap, remove_special, unparse_special)
        return ffi.unpack(buf, n).decode("utf-8", "replace")

    def _check_token(self, token: int) -> None:
        if not 0 <= int(token) < self.n_vocab:
            raise ValueError(f"token id {token} out of range [0, {self.n_vocab})")

    def __repr__(self) -> str:
        state = "closed" if self._ptr == ffi.NULL else self.description
        return f"<Model {self.path.name}: {state}, mtp {self.n_mtp_blocks_loaded}/{self.n_mtp_blocks}>"


class Batch:
    """A reusable llama_batch over preallocated numpy arrays.

    One sequence id per row. With ``n_embd`` > 0 the batch also carries a hidden
    row per token (MTP contexts take both a token and a hidden row).
    """

    def __init__(self, capacity: int, *, n_embd: int = 0) -> None:
        if capacity <= 0:
            raise ValueError("batch capacity must be positive")
        self.capacity = capacity
        self.n_embd = n_embd
        self.n = 0
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self.embd = np.zeros((capacity, n_embd), dtype=np.float32) if n_embd else None
        self._steps = np.arange(capacity, dtype=np.int32)  # pos0 + these: consecutive positions
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        self._seq_base = ffi.from_buffer("llama_seq_id[]", self.seq)
        self._seq_ptrs = ffi.new("llama_seq_id *[]", capacity)
        for i in range(capacity):
            self._seq_ptrs[i] = self._seq_base + i
        self._c = ffi.new("llama_batch *")
        self._c.token = ffi.from_buffer("llama_token[]", self.token)
        self._c.pos = ffi.from_buffer("llama_pos[]", self.pos)
        self._c.n_seq_id = ffi.from_buffer("int32_t[]", self._n_seq_id)
        self._c.seq_id = self._seq_ptrs
        self._c.logits = ffi.from_buffer("int8_t[]", self.logits)
        self._c.embd = ffi.from_buffer("float[]", self.embd) if n_embd else ffi.NULL

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int = 0, output: bool = False) -> int:
        """Append one row; returns its index. Set ``embd[i]`` for hidden-carrying batches."""
        i = self.n
        if i >= self.capacity:
            raise ValueError(f"batch full ({self.capacity} rows)")
        self.token[i] = token
        self.pos[i] = pos
        self.seq[i] = seq
        self.logits[i] = output
        self.n = i + 1
        return i

    def fill(self, tokens: Sequence[int] | np.ndarray, pos0: int, seq: int = 0, *,
             outputs: str | np.ndarray = "last", embd: np.ndarray | None = None) -> None:
        """Replace the content with consecutive tokens at ``pos0, pos0+1, ..``.

        ``outputs``: "last", "all", "none", or a boolean mask.
        """
        self.n = 0
        self.append(tokens, pos0, seq, outputs=outputs, embd=embd)

    def append(self, tokens: Sequence[int] | np.ndarray, pos0: int, seq: int = 0, *,
               outputs: str | np.ndarray = "none", embd: np.ndarray | None = None) -> int:
        """Append consecutive tokens of one sequence at ``pos0, pos0+1, ..``; returns
        the index of the first. ``outputs`` as for ``fill``."""
        i, n = self.n, len(tokens)
        if i + n > self.capacity:
            raise ValueError(f"{i + n} tokens exceed the batch capacity {self.capacity}")
        j = i + n
        self.token[i:j] = tokens
        np.add(self._steps[:n], pos0, out=self.pos[i:j])
        self.seq[i:j] = seq
        if isinstance(outputs, str):
            self.logits[i:j] = 1 if outputs == "all" else 0
            if outputs == "last" and n:
                self.logits[j - 1] = 1
        else:
            self.logits[i:j] = outputs
        if embd is not None:
            if self.embd is None:
                raise ValueError("this batch carries no hidden rows")
            self.embd[i:j] = embd
        self.n = j
        return i

    @property
    def n_outputs(self) -> int:
        return int(self.logits[: self.n].sum())

    @property
    def c(self):  # noqa: ANN201 - cffi struct
        self._c.n_tokens = self.n
        return self._c[0]


class Context(_Closing):
    """A llama.cpp context (KV cache, compute buffers, outputs) over a Model.

    Args:
        model: the Model; it must stay open while the context lives.
        n_ctx: context size in tokens (0: the model's training context).
        n_batch, n_ubatch: logical and physical batch sizes, as llama.cpp's -b / -ub.
        n_seq_max: number of sequences (parallel slots).
        n_outputs_max: most outputs (logits rows) one ubatch asks for, which sizes the
            compute buffer the context reserves (0: n_batch). A draft context asks
            for one row per sequence: with a 128k vocabulary the difference is a
            quarter of a GiB per context.
        n_threads, n_threads_batch: CPU threads for single-token and batch decodes
            (default: every CPU this process may use).
        mtp: an MTP (draft) context, running one of the model's MTP blocks per decode.
        mtp_block: an MTP context bound to this block: it runs that block only and its
            KV holds that block's layer alone (None: every block's layer, the block
            chosen per decode through ``mtp_offset``).
        swa_full: keep a full-size sliding-window cache (llama-server's ``--swa-full``).
            Off by default, as in llama-server: sliding-window layers keep a window
            and a ubatch of cells a sequence (patch 0024; llama-server's one ubatch for
            all), each position in the cell its position gives
            (patch 0008), so rolled-back speculative rows are rewritten where plain
            decoding puts them (``swa_rows`` bounds a decode's rows per sequence).
        flash_attn: True, False, or None (llama.cpp decides).
        type_k, type_v: KV cache types, as llama.cpp's -ctk / -ctv (``placement.KV_TYPES``:
            "f16", "q8_0", ...; a quantized V needs flash attention).
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 0,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_seq_max: int = 1,
        n_outputs_max: int = 0,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        mtp: bool = False,
        mtp_block: int | None = None,
        swa_full: bool = False,
        kv_unified: bool = True,
        flash_attn: bool | None = None,
        type_k: str = "f16",
        type_v: str = "f16",
        llama_params: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self._ptr = ffi.NULL
        if mtp:
            model.check_mtp()
        if n_ubatch > n_batch:
            n_ubatch = n_batch
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.n_seq_max = n_seq_max
        params.n_outputs_max = n_outputs_max
        threads = n_threads or default_threads()
        params.n_threads = threads
        params.n_threads_batch = n_threads_batch or threads
        params.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP if mtp else lib.LLAMA_CONTEXT_TYPE_DEFAULT
        params.swa_full = swa_full
        if mtp_block is not None:
            if not mtp or not 0 <= mtp_block < model.n_mtp_blocks:
                raise ValueError(f"mtp_block {mtp_block}: needs an MTP context and a block in "
                                 f"[0, {model.n_mtp_blocks})")
            params.mtp_kv_block = mtp_block
        params.kv_unified = kv_unified
        params.no_perf = True
        params.flash_attn_type = {
            None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
            True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        params.type_k = kv_type(type_k, "type_k", mtp)
        params.type_v = kv_type(type_v, "type_v", mtp)
        from .llama_params import apply  # the server's context parameters by name (rope, YaRN, ...)

        apply(params, llama_params)
        with ErrorCapture() as cap:
            ptr = lib.llama_init_from_model(model.ptr, params)
        if model.rpc is not None and model.rpc.lost():
            if ptr != ffi.NULL:
                lib.llama_free(ptr)
            model.rpc.check(cap.message(f"{model.path}: creating a context"))
        if ptr == ffi.NULL:
            raise LlamaError(cap.message(f"{model.path}: could not create a llama.cpp context"))
        self._ptr = ptr
        self._mem_ptr = lib.llama_get_memory(ptr)
        self.is_mtp = mtp
        self.mtp_block = mtp_block
        self.swa_full = swa_full
        self.n_ctx: int = lib.llama_n_ctx(ptr)
        self.n_batch: int = lib.llama_n_batch(ptr)
        self.n_ubatch: int = lib.llama_n_ubatch(ptr)
        self.n_seq_max: int = lib.llama_n_seq_max(ptr)
        #: positions one sequence can hold: n_ctx, or n_ctx / n_seq_max with per-sequence KV
        self.n_ctx_seq: int = lib.llama_n_ctx_seq(ptr)
        self.kv_unified = kv_unified
        #: rows of one sequence a decode may carry for a trimmed sliding-window cache to
        #: place each by its position (patch 0008: regions of R cells, one per sequence
        #: of a unified cache; R - n_swa rows fit beyond the window): the cache's size
        #: as llama_kv_cache_iswa computes it (patch 0024: a window and a ubatch a
        #: region, so that one sequence's prompt goes in whole ubatches)
        self.swa_rows: int = 1 << 30
        #: the sliding-window layers keep fewer cells than the context (not swa_full,
        #: and a context longer than the regions): positions get overwritten
        self.swa_trimmed = False
        if model.n_swa > 0 and not swa_full:
            n_reg = self.n_seq_max if kv_unified else 1
            pad = lambda n: -(-n // 256) * 256  # noqa: E731  (GGML_PAD(n, 256))
            cells = pad(min(self.n_ctx_seq, pad(model.n_swa + self.n_ubatch) * n_reg))
            if cells < self.n_ctx_seq:
                # a sequence's region of R cells: position p overwrites p - R only
                self.swa_trimmed = True
                self.swa_rows = max(1, cells // n_reg - model.n_swa)
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd
        self._nextn = (False, False)
        self._batch_invariant = 0
        model._contexts.add(self)

    @property
    def ptr(self):  # noqa: ANN201
        if self._ptr == ffi.NULL:
            raise LlamaError("the context is closed")
        return self._ptr

    @property
    def _mem(self):  # noqa: ANN202 - the KV cache lives in the context: freed with it
        if self._ptr == ffi.NULL:
            raise LlamaError("the context is closed")
        return self._mem_ptr

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            lib.llama_free(self._ptr)
            self._ptr = ffi.NULL

    # -- decoding -------------------------------------------------------------

    def decode(self, batch: Batch) -> None:
        """Run one batch. Raises LlamaError (the context stays usable) on failure."""
        if batch.n == 0:
            raise ValueError("empty batch")
        if self.is_mtp and batch.embd is None:
            raise ValueError("an MTP context needs a batch with hidden rows (Batch(n, n_embd=...))")
        if batch.embd is not None and batch.n_embd != self.n_embd:
            raise ValueError(f"batch hidden rows have {batch.n_embd} columns, the model {self.n_embd}")
        n = batch.n
        if n <= 64:
            # a round's batches are a few rows: two numpy reductions would cost more
            # than the Python over a list
            toks = batch.token[:n].tolist()
            lo, hi = min(toks), max(toks)
        else:
            toks = batch.token[:n]
            lo, hi = toks.min(), toks.max()
        if lo < 0 or hi >= self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        with ErrorCapture() as cap:
            rc = lib.llama_decode(self.ptr, batch.c)
        if self.model.rpc is not None:
            # a result that came through a lost connection is void even when rc is 0
            self.model.rpc.check("llama_decode")
        if rc == 1:
            raise KVFullError(cap.message("llama_decode failed: no KV cache slot for the batch (context full)"))
        if rc != 0:
            reason = {2: "aborted"}.get(rc, f"error {rc}")
            raise LlamaError(cap.message(f"llama_decode failed: {reason}"))

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output row ``i`` of the last decode (a batch index, -1 = last);
        a view valid until the next decode."""
        p = lib.llama_get_logits_ith(self.ptr, i)
        if p == ffi.NULL:
            raise IndexError(f"no logits for batch row {i}")
        return np.frombuffer(ffi.buffer(p, 4 * self.n_vocab), dtype=np.float32)

    def logits_rows(self, n_outputs: int) -> np.ndarray:
        """All ``n_outputs`` output rows of the last decode, [n_outputs, n_vocab], in
        batch order; a view valid until the next decode."""
        p = lib.llama_get_logits(self.ptr)
        if p == ffi.NULL:
            raise LlamaError("no logits")
        return np.frombuffer(ffi.buffer(p, 4 * self.n_vocab * n_outputs), dtype=np.float32).reshape(
            n_outputs, self.n_vocab
        )

    def set_nextn(self, enabled: bool, masked: bool = True) -> None:
        """Also output the hidden rows before the output norm (the MTP heads' input).

        masked: only for output rows; otherwise for every row of the batch."""
        if (enabled, masked) != self._nextn:
            lib.llama_mtp_set_embeddings_nextn(self.ptr, enabled, masked)
            self._nextn = (enabled, masked)

    def nextn(self, n_rows: int) -> np.ndarray:
        """The hidden rows of the last decode, [n_rows, n_embd]; a view valid until the
        next decode. ``n_rows``: outputs when masked, batch rows when not."""
        if not self._nextn[0]:
            raise LlamaError("nextn embeddings are not enabled (set_nextn(True))")
        p = lib.llama_mtp_get_embeddings_nextn(self.ptr)
        if p == ffi.NULL:
            raise LlamaError("no nextn embeddings")
        return np.frombuffer(ffi.buffer(p, 4 * self.n_embd * n_rows), dtype=np.float32).reshape(
            n_rows, self.n_embd
        )

    def nextn_ith(self, i: int) -> np.ndarray:
        p = lib.llama_mtp_get_embeddings_nextn_ith(self.ptr, i)
        if p == ffi.NULL:
            raise IndexError(f"no nextn embedding for row {i}")
        return np.frombuffer(ffi.buffer(p, 4 * self.n_embd), dtype=np.float32)

    @property
    def mtp_offset(self) -> int:
        """Which MTP block an MTP context runs (0 .. n_mtp_blocks-1)."""
        return lib.llama_mtp_get_layer_offset(self.ptr)

    @mtp_offset.setter
    def mtp_offset(self, offset: int) -> None:
        if not self.is_mtp:
            raise LlamaError("not an MTP context")
        if lib.llama_mtp_set_layer_offset(self.ptr, int(offset)) != 0:
            raise ValueError(
                f"MTP layer offset {offset} out of range [0, {self.model.n_mtp_blocks})"
            )

    @property
    def batch_invariant(self) -> int:
        """Batch-invariant mode: 0 off; n: every decode of 2..n tokens computes each
        token as a decode of that token alone would, over the whole KV cache, so a
        row's logits do not depend on the rows decoded with it (patch 0012)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, max_rows: int) -> None:
        max_rows = int(max_rows)
        if max_rows < 0:
            raise ValueError("batch_invariant: a number of rows >= 0")
        if max_rows:
            # CUDA fuses chains of ops into one kernel only where it finds them, and a
            # verify's split products do not make the chains a one-row decode does. ggml
            # reads this once per process, at the first graph it computes: the mode must
            # be set before the process's first decode on CUDA, and fusion then stays off
            # for every context of the process
            os.environ["GGML_CUDA_DISABLE_FUSION"] = "1"
        lib.llama_mtp_set_batch_invariant(self.ptr, max_rows)
        self._batch_invariant = max_rows

    def set_draft_vocab(self, n: int) -> int:
        """An MTP context's logits from its LM head's first ``n`` rows alone (patch
        0017; 0: the whole head); each row keeps n_vocab entries, those from the value
        returned (the one in use) on at 0."""
        return int(lib.llama_mtp_set_draft_vocab(self.ptr, int(n)))

    # -- KV cache -------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this context holds, as llama.cpp accounts them: ``kv`` (the KV
        cache), ``compute`` (graph buffers), ``output`` (logits and embeddings)."""
        kv, compute, output = ffi.new("size_t *"), ffi.new("size_t *"), ffi.new("size_t *")
        lib.llama_mtp_context_memory(self.ptr, kv, compute, output)
        return {"kv": int(kv[0]), "compute": int(compute[0]), "output": int(output[0])}

    @property
    def graphs_reused(self) -> int:
        """Decodes that computed on a graph built before instead of building one
        (llama.cpp's previous graph, or one kept per shape: patch 0015)."""
        return int(lib.llama_perf_context(self.ptr).n_reused)

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Forget positions [p0, p1) of a sequence (p1 = -1: to the end)."""
        if not lib.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise LlamaError(f"could not remove positions [{p0}, {p1}) of sequence {seq}")

    # -- a sequence's state (its KV), to files and back ----------------------------

    def seq_state(self, seq: int, *, swa_only: bool = False) -> bytes:
        """The sequence's KV as llama.cpp serialises it; ``swa_only``: the
        sliding-window layers' cells alone (a context checkpoint: what cannot be
        rebuilt by removing positions from the full-attention layers)."""
        flags = _SWA_ONLY if swa_only else 0
        n = lib.llama_state_seq_get_size_ext(self.ptr, seq, flags)
        buf = ffi.new("uint8_t[]", max(1, n))
        got = lib.llama_state_seq_get_data_ext(self.ptr, buf, n, seq, flags)
        return ffi.buffer(buf, got)[:]

    def set_seq_state(self, seq: int, data: bytes, *, swa_only: bool = False) -> None:
        flags = _SWA_ONLY if swa_only else 0
        if not lib.llama_state_seq_set_data_ext(self.ptr, data, len(data), seq, flags):
            raise LlamaError(f"could not load a sequence state of {len(data)} bytes into sequence {seq}")

    def save_seq_file(self, path: str | os.PathLike[str], seq: int, tokens: Sequence[int]) -> int:
        """llama.cpp's sequence file (what llama-server's slot save writes); its size."""
        toks = ffi.new("llama_token[]", list(tokens) or [0])
        with ErrorCapture() as cap:
            n = lib.llama_state_seq_save_file(self.ptr, os.fsencode(path), seq, toks, len(tokens))
        if not n:
            raise LlamaError(cap.message(f"{path}: could not save sequence {seq}"))
        return int(n)

    def load_seq_file(self, path: str | os.PathLike[str], seq: int, capacity: int) -> list[int]:
        """Load a sequence file into ``seq``; the tokens it holds."""
        toks = ffi.new("llama_token[]", max(1, capacity))
        count = ffi.new("size_t *")
        with ErrorCapture() as cap:
            n = lib.llama_state_seq_load_file(self.ptr, os.fsencode(path), seq, toks, capacity, count)
        if not n:
            raise LlamaError(cap.message(f"{path}: could not load into sequence {seq}"))
        return [int(toks[i]) for i in range(count[0])]

    def seq_pos_min(self, seq: int = 0) -> int:
        """The first position held for a sequence, -1 when empty."""
        return lib.llama_memory_seq_pos_min(self._mem, seq)

    def seq_pos_max(self, seq: int = 0) -> int:
        """The last position held for a sequence, -1 when empty."""
        return lib.llama_memory_seq_pos_max(self._mem, seq)

    def clear(self) -> None:
        """Empty the KV cache of every sequence."""
        lib.llama_memory_clear(self._mem, True)

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        lib.llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)


def builtin_templates() -> list[str]:
    """The names of llama.cpp's built-in chat templates."""
    n = lib.llama_chat_builtin_templates(ffi.NULL, 0)
    out = ffi.new("const char *[]", max(1, n))
    n = lib.llama_chat_builtin_templates(out, n)
    return [ffi.string(out[i]).decode() for i in range(n)]


def apply_builtin_template(template: str, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
    keep = []
    chat = ffi.new("llama_chat_message[]", max(1, len(messages)))
    for i, (role, content) in enumerate(messages):
        r, c = ffi.new("char[]", role.encode()), ffi.new("char[]", content.encode())
        keep += [r, c]
        chat[i].role, chat[i].content = r, c
    tmpl = ffi.new("char[]", template.encode())
    size = 2 * sum(len(c) + len(r) for r, c in messages) + 256
    for _ in range(2):
        buf = ffi.new("char[]", size)
        n = lib.llama_chat_apply_template(tmpl, chat, len(messages), add_generation_prompt, buf, size)
        if n < 0:
            raise ValueError("this chat template is not one of llama.cpp's built-in templates "
                             f"({', '.join(builtin_templates())}); use --jinja")
        if n <= size:
            return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
        size = n + 1
    raise ValueError("chat template output did not fit")  # pragma: no cover
