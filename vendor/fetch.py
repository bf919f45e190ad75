#!/usr/bin/env python3
"""Materialise the patched llama.cpp tree in vendor/llama.cpp.

The tree is never committed: it is the llama.cpp shipped inside one pinned sdist
(see manifest.json), fetched with pip by package name, checked against its sha256,
extracted, and patched with ../patches/*.patch in order.

    python vendor/fetch.py            # idempotent: a no-op on an up-to-date tree
    python vendor/fetch.py --force    # throw the tree away and start again
    python vendor/fetch.py --check    # report the tree's state, change nothing

Offline builds:
    STEPMTP_LLAMA_SDIST=/path/to/llama_cpp_python-0.3.31.tar.gz   an already-downloaded sdist
    STEPMTP_LLAMA_TREE=/path/to/llama.cpp                         an unpatched extracted tree
Downloads are cached in $STEPMTP_CACHE_DIR (default ~/.cache/stepmtp).

Standard library only: this runs inside CMake's configure step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent
ROOT = VENDOR.parent
TREE = VENDOR / "llama.cpp"
PATCHES = ROOT / "patches"
# Copies of the patches as applied, so a changed series can be unapplied exactly.
APPLIED = TREE / ".stepmtp-applied"
STAMP = APPLIED / "stamp.json"


class VendorError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"stepmtp-vendor: {msg}", file=sys.stderr, flush=True)


def manifest() -> dict:
    return json.loads((VENDOR / "manifest.json").read_text())


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def patch_series() -> list[Path]:
    return sorted(PATCHES.glob("*.patch"))


def _git_apply(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # The tree sits inside the project's own git work tree; the ceiling keeps git from
    # treating it as part of that repository (paths would then resolve from its root).
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *flags, str(patch)],
        cwd=tree, env=env, capture_output=True, text=True,
    )


def applies(tree: Path, patch: Path) -> bool:
    return _git_apply(tree, patch, "--check").returncode == 0


def applied(tree: Path, patch: Path) -> bool:
    return _git_apply(tree, patch, "--check", "--reverse").returncode == 0


def _touched(patch: Path) -> set[str]:
    """The paths a patch reads or writes (its a/ and b/ sides)."""
    out = set()
    for line in patch.read_text().splitlines():
        if line.startswith(("--- a/", "+++ b/")):
            out.add(line[6:].split("\t", 1)[0])
    return out


def _scratch_copy(tree: Path, patches: list[Path]) -> Path:
    """The files these patches touch, copied from the tree into a scratch folder."""
    scratch = Path(tempfile.mkdtemp(prefix=".stepmtp-check-", dir=tree.parent))
    for rel in set().union(*(_touched(p) for p in patches)):
        src = tree / rel
        if src.is_file():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, scratch / rel)
    return scratch


def series_applies(tree: Path, patches: list[Path]) -> bool:
    """Whether the patches apply to the tree in order (a later one may need an
    earlier one's lines), tried on a scratch copy of the files they touch."""
    scratch = _scratch_copy(tree, patches)
    try:
        return all(_git_apply(scratch, p).returncode == 0 for p in patches)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def series_applied(tree: Path, patches: list[Path]) -> bool:
    """Whether the tree holds exactly these patches, applied in order, on the files
    they touch: unapplied newest first in a scratch copy of those files (a later patch
    may edit lines an earlier one added, so each cannot be checked alone)."""
    scratch = _scratch_copy(tree, patches)
    try:
        return all(_git_apply(scratch, p, "--reverse").returncode == 0 for p in reversed(patches))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def apply(tree: Path, patch: Path, reverse: bool = False) -> None:
    r = _git_apply(tree, patch, *(["--reverse"] if reverse else []))
    if r.returncode != 0:
        verb = "unapply" if reverse else "apply"
        raise VendorError(f"cannot {verb} {patch.name}: {r.stderr.strip()}")


def want_stamp() -> dict:
    m = manifest()
    return {
        "sha256": m["sha256"],
        "patches": [[p.name, sha256_of(p)] for p in patch_series()],
    }


def read_stamp() -> dict | None:
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return None


def obtain_sdist(m: dict) -> Path:
    given = os.environ.get("STEPMTP_LLAMA_SDIST")
    if given:
        path = Path(given)
        if not path.is_file():
            raise VendorError(f"STEPMTP_LLAMA_SDIST={given} is not a file")
        candidates = [path]
    else:
        cache = Path(os.environ.get("STEPMTP_CACHE_DIR", Path.home() / ".cache" / "stepmtp"))
        cache.mkdir(parents=True, exist_ok=True)
        path = cache / m["sdist"]
        if not path.is_file():
            log(f"downloading {m['package']}=={m['version']} (sdist) with pip")
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                "--no-binary", m["package"], "--dest", str(cache),
                f"{m['package']}=={m['version']}",
            ]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0 or not path.is_file():
                tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
                raise VendorError(
                    f"could not download {m['package']}=={m['version']} with pip "
                    f"(offline? set STEPMTP_LLAMA_SDIST or STEPMTP_LLAMA_TREE):\n{tail}"
                )
        candidates = [path]
    for path in candidates:
        digest = sha256_of(path)
        if digest != m["sha256"]:
            raise VendorError(
                f"{path}: sha256 {digest} does not match the pinned {m['sha256']}; "
                "refusing to build from an unknown llama.cpp"
            )
    return path


def extract(sdist: Path, m: dict, dest: Path) -> None:
    prefix = f"{m['sdist'].removesuffix('.tar.gz')}/{m['inner_path']}/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(prefix):
                continue
            member.name = member.name[len(prefix):]
            # the sdist keeps llama.cpp's submodule pointer (a .git file naming a
            # gitdir that does not exist here); git would take the tree for a repo
            if member.name and member.name.split("/", 1)[0] != ".git":
                members.append(member)
        if not members:
            raise VendorError(f"{sdist} has no {m['inner_path']}/")
        tar.extractall(dest, members=members, filter="data")


def fresh_tree(m: dict) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=VENDOR))
    try:
        tree_src = os.environ.get("STEPMTP_LLAMA_TREE")
        if tree_src:
            log(f"copying the llama.cpp tree from {tree_src}")
            shutil.copytree(tree_src, staging, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".git", ".stepmtp-applied"))
        else:
            sdist = obtain_sdist(m)
            log(f"extracting {m['inner_path']} from {sdist.name}")
            extract(sdist, m, staging)
        series = patch_series()
        if series and not applies(staging, series[0]):
            raise VendorError(
                "the source tree is not the pristine pinned llama.cpp: "
                f"{series[0].name} does not apply to it"
            )
        # only a complete tree ever appears under the final name
        staging.rename(TREE)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def patch_tree(stamp: dict | None) -> None:
    # unapply what an earlier (different) series applied, newest first
    if stamp is not None:
        for name, _ in reversed(stamp["patches"]):
            apply(TREE, APPLIED / name, reverse=True)
        shutil.rmtree(APPLIED)
    APPLIED.mkdir()
    for p in patch_series():
        log(f"applying {p.name}")
        apply(TREE, p)
        shutil.copy2(p, APPLIED / p.name)
    STAMP.write_text(json.dumps(want_stamp(), indent=1) + "\n")


def diagnose() -> str:
    """Say which patches are applied, pending or conflicting in an unstamped tree."""
    states = []
    for p in patch_series():
        if applied(TREE, p):
            states.append(f"{p.name}: applied")
        elif applies(TREE, p):
            states.append(f"{p.name}: not applied")
        else:
            states.append(f"{p.name}: neither applies nor unapplies (files modified)")
    return "; ".join(states)


def ensure(force: bool = False) -> str:
    """Bring vendor/llama.cpp to the pinned, patched state. Returns what was done."""
    m = manifest()
    if force and TREE.exists():
        log("--force: removing the existing tree")
        shutil.rmtree(TREE)
    if not TREE.exists():
        fresh_tree(m)
        patch_tree(None)
        return "created"

    stamp = read_stamp()
    want = want_stamp()
    if stamp == want:
        # cheap proof that nobody edited the patched files since
        if series_applied(TREE, [APPLIED / name for name, _ in want["patches"]]):
            return "up to date"
        raise VendorError(
            f"{TREE} was modified after patching ({diagnose()}); "
            "rerun with --force to start from a fresh extraction"
        )
    if stamp is None:
        series = patch_series()
        if series and series_applies(TREE, series):
            patch_tree(None)  # a pristine tree, e.g. from STEPMTP_LLAMA_TREE copied by hand
            return "patched"
        raise VendorError(
            f"{TREE} is half-patched or modified ({diagnose()}); "
            "rerun with --force to start from a fresh extraction"
        )
    if stamp.get("sha256") != want["sha256"]:
        raise VendorError(f"{TREE} comes from another sdist; rerun with --force")
    patch_tree(stamp)  # the series changed: unapply the old one, apply the new one
    return "repatched"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="re-extract from scratch")
    ap.add_argument("--check", action="store_true", help="report the state, change nothing")
    args = ap.parse_args(argv)
    try:
        if args.check:
            if not TREE.exists():
                print("missing")
            elif read_stamp() == want_stamp():
                print("up to date")
            else:
                print(f"stale: {diagnose()}")
            return 0
        log(ensure(force=args.force))
        return 0
    except VendorError as e:
        log(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
