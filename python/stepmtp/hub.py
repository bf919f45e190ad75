"""Models by name: the GGUF files of a Hugging Face repository, chosen as llama-server's
``-hf user/repo[:quant]`` chooses them, fetched by ``huggingface_hub`` into its cache.

llama-server's rules (``common/download.cpp``), followed here:

- ``:quant`` is a tag searched, case-insensitively, in the files' names followed by ``.``
  or ``-`` (``:q4_k_m`` finds ``model-Q4_K_M.gguf`` and
  ``Q4_K_M/model-Q4_K_M-00001-of-00003.gguf``); without one, Q4_K_M, then Q8_0, then
  the first model file. Files of projectors, importance matrices and MTP heads
  (``mmproj``, ``imatrix``, ``mtp-`` in the name) are never the model.
- A split GGUF (``name-00001-of-00003.gguf``) is its whole set: every shard is fetched,
  the first one is the path to load.
- An exact file name (``-hff``) overrides the tag.
- With MTP drafting, a file of MTP heads beside the model (``mtp-`` in its name, in the
  model's folder or one above it, the closest quantization) is the draft model, unless
  one is named.

Differs: the ``mmproj``/``imatrix``/``mtp-`` tests ignore case (a repository naming its
heads ``...-MTP-Q8_0.gguf`` is read as llama-server reads ``...-mtp-Q8_0.gguf``), and
``filename`` may also be a glob (llama-cpp-python's ``from_pretrained``).

Files go to the hub's cache (``HF_HOME``, ``HF_HUB_CACHE``); once there, a start with
``HF_HUB_OFFLINE=1`` (or the server's ``--offline``), or with the hub out of reach,
finds them without the network. ``HF_ENDPOINT`` points at another hub, ``HF_TOKEN`` (or
a ``token``) reads private and gated repositories. Every failure is a ``HubError``
whose message says what to do next.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger("stepmtp.hub")

__all__ = ["HubError", "Resolved", "resolve", "resolve_heads", "fetch_url", "parse_repo", "split_info", "pick_model", "pick_mtp"]


class HubError(RuntimeError):
    """A model could not be had from the hub; the message says what to do next."""


@dataclass(frozen=True)
class SplitInfo:
    """What a GGUF's name says: ``prefix`` (with its tag, without the shard suffix),
    ``tag`` (upper case: Q4_K_M, F16, ...), shard ``index`` of ``count``."""

    prefix: str
    tag: str
    index: int
    count: int


_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
#: llama-server's choices when the repository is named without a quant
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
#: files that are never the model (llama.cpp's gguf_filename_is_model)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-")


def split_info(path: str) -> SplitInfo | None:
    """The name of a GGUF file read as llama.cpp reads it (None: not a .gguf)."""
    if not path.endswith(".gguf"):
        return None
    prefix, index, count = path[: -len(".gguf")], 1, 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    t = _TAG.search(prefix)
    return SplitInfo(prefix, t.group(1).upper() if t else "", index, count)


def _bits(path: str) -> int:
    """Q4_0 -> 4, F16 -> 16, Q8_K_M -> 8: the first number of the tag (0: none)."""
    info = split_info(path)
    m = re.search(r"[0-9]+", info.tag) if info else None
    return int(m.group(0)) if m else 0


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(k in name for k in _NOT_MODELS)


def parse_repo(spec: str) -> tuple[str, str]:
    """``user/repo[:quant]`` -> (repo, quant or "")."""
    repo, _, tag = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")) or ":" in tag:
        raise HubError(f"invalid repository {spec!r}: expected <user>/<model>[:quant], "
                       "e.g. ggml-org/gemma-3-1b-it-GGUF:Q4_K_M")
    return repo, tag


def _quants(files: Sequence[str]) -> list[str]:
    seen: list[str] = []
    for f in files:
        info = split_info(f)
        if info and is_model_file(f) and info.tag and info.tag not in seen:
            seen.append(info.tag)
    return seen


def _listing(files: Sequence[str], n: int = 12) -> str:
    ggufs = [f for f in files if f.endswith(".gguf")] or list(files)
    more = f", ... ({len(ggufs) - n} more)" if len(ggufs) > n else ""
    return ", ".join(ggufs[:n]) + more if ggufs else "nothing"


def _first_shard(f: str) -> bool:
    info = split_info(f)
    return info is not None and (info.count <= 1 or info.index == 1)


def pick_model(files: Sequence[str], repo: str, tag: str = "", filename: str | None = None, *,
               heads: bool = False) -> list[str]:
    """The model's files in ``files`` (a repository's listing): one file, or every
    shard of a split set in order, the first to load. ``filename``: an exact name,
    a glob, or a quant (then as ``tag``). ``heads``: a draft repository's, whose files
    of MTP heads are the model (when it has any)."""
    is_model = is_model_file
    if heads and any(_is_heads(f) for f in files):
        is_model = _is_heads
    if not any(f.endswith(".gguf") for f in files):
        raise HubError(f"{repo} holds no GGUF file ({_listing(files)}): name a repository of GGUF models "
                       "(their names end in -GGUF, most often)")
    if filename and filename not in files and not _is_glob(filename) and not filename.endswith(".gguf") \
            and "/" not in filename:
        tag, filename = filename, None  # from_pretrained(repo, "Q8_0"): a quant
    if filename:
        if filename in files:
            return split_set(files, filename, repo)
        if _is_glob(filename):
            found = [f for f in files if is_model(f)
                     and (fnmatch.fnmatch(f, filename) or fnmatch.fnmatch(f.rsplit("/", 1)[-1], filename))]
            sets = {split_info(f).prefix for f in found}  # type: ignore[union-attr]
            if len(sets) == 1:
                return split_set(files, sorted(found)[0], repo)
            if found:
                raise HubError(f"{filename!r} matches several models in {repo}: {_listing(found)}; "
                               "name one (a quant, or its file)")
        raise HubError(f"no file {filename!r} in {repo}; its GGUF files: {_listing(files)}")
    for t in [tag] if tag else list(DEFAULT_QUANTS):
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in files:
            if is_model(f) and pattern.search(f) and _first_shard(f):
                return split_set(files, f, repo)
    if not tag:
        for f in files:
            if is_model(f) and _first_shard(f):
                return split_set(files, f, repo)
        raise HubError(f"{repo} holds GGUF files but no model among them ({_listing(files)})")
    raise HubError(f"no {tag} model in {repo}; its quants: {', '.join(_quants(files)) or 'none'} "
                   f"(write {repo}:QUANT)")


def _is_heads(path: str) -> bool:
    return path.endswith(".gguf") and "mtp-" in path.rsplit("/", 1)[-1].lower()


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def split_set(files: Sequence[str], primary: str, repo: str) -> list[str]:
    """``primary`` and the other shards of its split set, in order (all of them, or an error)."""
    info = split_info(primary)
    if info is None or info.count <= 1:
        return [primary]
    shards = {i.index: f for f in files if (i := split_info(f)) and i.count == info.count and i.prefix == info.prefix}
    missing = [i for i in range(1, info.count + 1) if i not in shards]
    if missing:
        raise HubError(f"{repo}: shard {missing[0]} of {info.count} of {info.prefix} is missing "
                       f"(found {_listing(sorted(shards.values()))})")
    return [shards[i] for i in range(1, info.count + 1)]


def pick_mtp(files: Sequence[str], model: str) -> str | None:
    """llama-server's MTP sibling: a GGUF with ``mtp-`` in its name, in the model's
    folder or one above it (the deepest first), the closest quantization first."""
    model_dir = model.split("/")[:-1]
    best, best_key = None, None
    for f in files:
        if not _is_heads(f):
            continue
        sib_dir = f.split("/")[:-1]
        if model_dir[: len(sib_dir)] != sib_dir:
            continue
        key = (-len(sib_dir), abs(_bits(f) - _bits(model)))
        if best_key is None or key < best_key:
            best, best_key = f, key
    return best


# -- the hub -------------------------------------------------------------------------


def _hub_error(e: BaseException, repo: str, token: str | None, what: str = "") -> HubError:
    """A huggingface_hub failure as what to do about it."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError)

    where = f" ({what})" if what else ""
    token = token or get_token()
    if isinstance(e, GatedRepoError):
        return HubError(f"{repo} is gated: accept its conditions on its page on the hub with your account, "
                        "then pass that account's token (-hft/--hf-token, HF_TOKEN, or token=)")
    status = getattr(getattr(e, "response", None), "status_code", None)
    # the hub says 401 for a private repository asked without a token (a RepositoryNotFoundError
    # here), and 401 "invalid credentials" for a bad token
    if isinstance(e, HfHubHTTPError) and status in (401, 403) and not isinstance(e, RepositoryNotFoundError):
        return HubError(f"the hub refused the token for {repo}: pass a valid token (-hft/--hf-token, HF_TOKEN, "
                        "or token=) that can read it, or none for a public repository")
    if isinstance(e, RepositoryNotFoundError):
        hint = ("check the name (user/repo) and that the token can read it" if token else
                "check the name (user/repo); a private repository needs a token (-hft/--hf-token, HF_TOKEN, "
                "or token=)")
        return HubError(f"no repository {repo} on the hub at {constants.ENDPOINT}: {hint}")
    if isinstance(e, RemoteEntryNotFoundError):
        return HubError(f"{repo} has no file {what!r} (any more): run again to list its files anew")
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return HubError(f"{repo}{where} is not in the hub's cache ({constants.HF_HUB_CACHE}) and the hub cannot "
                        "be asked (offline): run once with the network (without HF_HUB_OFFLINE / --offline)")
    if isinstance(e, HfHubHTTPError):
        return HubError(f"the hub at {constants.ENDPOINT} answered {status} for {repo}{where}: "
                        f"{str(e).splitlines()[0]}; try again later")
    return HubError(f"cannot reach the hub at {constants.ENDPOINT} for {repo}{where} ({type(e).__name__}: {e}): "
                    "check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the files already cached")


def _offline(offline: bool | None) -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode() if offline is None else offline


def list_files(repo: str, *, token: str | None = None, cache_dir: str | Path | None = None,
               offline: bool | None = None) -> tuple[list[str], bool]:
    """The repository's files (and True when they come from the cache: offline, or the
    hub out of reach or refusing, as llama-server falls back on its cache)."""
    from huggingface_hub import HfApi

    error: BaseException | None = None
    if not _offline(offline):
        try:
            return HfApi().list_repo_files(repo, token=token), False
        except Exception as e:  # noqa: BLE001 - each kind is told apart in _hub_error
            error = e
    cached = cached_files(repo, cache_dir)
    if cached:
        if error is not None:
            log.warning("the hub did not answer for %s (%s): using the files already cached", repo, type(error).__name__)
        return cached, True
    if error is None:
        from huggingface_hub.errors import OfflineModeIsEnabled

        error = OfflineModeIsEnabled("offline")
    raise _hub_error(error, repo, token) from None


def cached_files(repo: str, cache_dir: str | Path | None = None) -> list[str]:
    """The files of ``repo``'s cached snapshot of its main branch (none: nothing cached)."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir or constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    for r in info.repos:
        if r.repo_id != repo or r.repo_type != "model":
            continue
        revs = sorted(r.revisions, key=lambda v: ("main" not in v.refs, -v.last_modified))
        if revs:
            rev = revs[0]
            return sorted(f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files)
    return []


def cached_models(cache_dir: str | Path | None = None) -> list[str]:
    """The hub cache's model files, ``repo:file`` (llama-server's ``--cache-list``)."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir or constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    return sorted({f"{r.repo_id}:{f}" for r in info.repos if r.repo_type == "model"
                   for f in cached_files(r.repo_id, cache_dir)
                   if is_model_file(f) and (split_info(f) is None or _first_shard(f))})


def download(repo: str, files: Sequence[str], *, token: str | None = None, cache_dir: str | Path | None = None,
             offline: bool | None = None) -> list[Path]:
    """Each file of ``repo`` in the hub's cache (fetched when missing), in parallel as
    llama-server fetches shards."""
    from huggingface_hub import hf_hub_download

    def one(f: str) -> Path:
        try:
            return Path(hf_hub_download(repo, f, token=token, cache_dir=cache_dir,
                                        local_files_only=_offline(offline)))
        except Exception as e:  # noqa: BLE001 - told apart in _hub_error
            raise _hub_error(e, repo, token, f) from None

    for f in files:
        log.info("model file %s of %s", f, repo)
    with ThreadPoolExecutor(max_workers=min(4, len(files)) or 1) as pool:
        return list(pool.map(one, files))


@dataclass
class Resolved:
    """Local paths: the model (its first shard) and the MTP heads' file, if any."""

    model: Path
    mtp: Path | None = None
    #: every file fetched for the model (all shards)
    files: tuple[Path, ...] = ()


def _pick(files: list[str], cached: bool, repo: str, tag: str, filename: str | None, heads: bool = False) -> list[str]:
    try:
        return pick_model(files, repo, tag, filename, heads=heads)
    except HubError as e:
        if not cached:
            raise
        raise HubError(f"{e}; only the hub's cache was searched (offline, or the hub out of reach): run once "
                       "with the network to fetch it") from None


def resolve(spec: str, filename: str | None = None, *, token: str | None = None, mtp: bool = False,
            cache_dir: str | Path | None = None, offline: bool | None = None) -> Resolved:
    """The model ``spec`` (``user/repo[:quant]``) names, in the hub's cache: ``filename``
    an exact name, glob or quant (llama-server's ``-hff``); ``mtp``: also the file of MTP
    heads beside the model, when the repository has one (llama-server's sibling)."""
    repo, tag = parse_repo(spec)
    files, cached = list_files(repo, token=token, cache_dir=cache_dir, offline=offline)
    chosen = _pick(files, cached, repo, tag, filename)
    heads = pick_mtp(files, chosen[0]) if mtp else None
    paths = download(repo, chosen + ([heads] if heads else []), token=token, cache_dir=cache_dir, offline=offline)
    return Resolved(paths[0], paths[-1] if heads else None, tuple(paths[: len(chosen)]))


def resolve_heads(spec: str, filename: str | None = None, *, token: str | None = None,
                  cache_dir: str | Path | None = None, offline: bool | None = None) -> Path:
    """A draft model named on the hub (llama-server's ``-hfd`` / ``-hffd``): as
    ``resolve``, but the repository's MTP heads' files, when it has any, are the models."""
    repo, tag = parse_repo(spec)
    files, cached = list_files(repo, token=token, cache_dir=cache_dir, offline=offline)
    chosen = _pick(files, cached, repo, tag, filename, heads=True)
    return download(repo, chosen, token=token, cache_dir=cache_dir, offline=offline)[0]


def fetch_url(url: str, dest: str | Path | None = None, *, token: str | None = None) -> Path:
    """llama-server's ``-mu``: a model at a URL (every shard of a split one), saved as
    ``dest`` or under the cache folder (``LLAMA_CACHE``, else ``~/.cache/llama.cpp``,
    as llama-server saves it); a file already there is not fetched again. A hub URL
    (``<endpoint>/<user>/<repo>/resolve/<revision>/<file>``) goes to the hub's cache."""
    from huggingface_hub import constants

    bare = url.split("#", 1)[0].split("?", 1)[0]
    m = re.match(re.escape(constants.ENDPOINT) + r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", bare)
    if m and dest is None:
        repo, path = m.group(1), m.group(2)
        files, _ = list_files(repo, token=token)
        return download(repo, split_set(files, path, repo), token=token)[0]
    name = bare.rsplit("/", 1)[-1]
    if not name:
        raise HubError(f"-mu {url}: the URL names no file")
    base = Path(dest) if dest is not None else _llama_cache() / name
    info = split_info(name)
    if info is None or info.count <= 1:
        return _fetch_one(url, base, token)
    stem = base.name[: -len(f"-{info.index:05d}-of-{info.count:05d}.gguf")]
    url_stem = bare[: -len(f"-{info.index:05d}-of-{info.count:05d}.gguf")]
    paths = [_fetch_one(f"{url_stem}-{i:05d}-of-{info.count:05d}.gguf",
                        base.with_name(f"{stem}-{i:05d}-of-{info.count:05d}.gguf"), token)
             for i in range(1, info.count + 1)]
    return paths[0]


def _llama_cache() -> Path:
    env = os.environ.get("LLAMA_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama.cpp"


def _fetch_one(url: str, dest: Path, token: str | None) -> Path:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".downloadInProgress")
    log.info("fetching %s to %s", url, dest)
    try:
        with open(part, "wb") as out:
            http_get(url, out, headers=build_hf_headers(token=token), displayed_filename=dest.name)
    except Exception as e:  # noqa: BLE001 - reported as what to do
        part.unlink(missing_ok=True)
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = f"HTTP {status}" if status else f"{type(e).__name__}: {e}"
        raise HubError(f"cannot fetch {url} ({why}): check the URL and the network") from None
    os.replace(part, dest)
    return dest


def quiet_progress() -> None:
    """No progress bars (a log line per file instead): for output that is not a terminal."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
