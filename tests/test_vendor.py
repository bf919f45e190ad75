"""vendor/fetch.py: the pinned sdist, its hash, and the patch series."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fetch():
    spec = importlib.util.spec_from_file_location("stepmtp_fetch", ROOT / "vendor" / "fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fresh_tree(fetch, tmp_path_factory):
    """A fresh extraction of the pinned sdist (downloaded once into the cache)."""
    m = fetch.manifest()
    sdist = fetch.obtain_sdist(m)
    tree = tmp_path_factory.mktemp("vendor") / "llama.cpp"
    fetch.extract(sdist, m, tree)
    return tree


def _point_at(fetch, monkeypatch, tree: Path):
    monkeypatch.setattr(fetch, "TREE", tree)
    monkeypatch.setattr(fetch, "APPLIED", tree / ".stepmtp-applied")
    monkeypatch.setattr(fetch, "STAMP", tree / ".stepmtp-applied" / "stamp.json")


def test_series_applies_cleanly_to_the_pinned_sdist(fetch, fresh_tree):
    series = fetch.patch_series()
    # 0001 and 0003 are upstream's since 0.3.36 (patches/README.md)
    assert [p.name[:4] for p in series] == ["0002", "0004", "0005", "0006", "0007", "0008", "0009", "0010", "0011",
                                             "0012", "0013", "0014", "0015", "0016", "0017", "0018", "0019", "0020",
                                             "0021", "0022", "0023", "0024"]
    assert (fresh_tree / "src" / "models" / "step35.cpp").exists()
    for p in series:
        head = p.read_text().split("diff --git", 1)[0]
        assert "What:" in head and "Why:" in head, f"{p.name} lacks its header"
    # each patch applies in order, without fuzz
    for p in series:
        assert fetch.applies(fresh_tree, p), p.name
        fetch.apply(fresh_tree, p)
    for p in reversed(series):
        fetch.apply(fresh_tree, p, reverse=True)


def test_states_half_patched_idempotent_modified(fetch, fresh_tree, monkeypatch):
    _point_at(fetch, monkeypatch, fresh_tree)
    first = fetch.patch_series()[0]
    fetch.apply(fresh_tree, first)
    with pytest.raises(fetch.VendorError, match="half-patched"):
        fetch.ensure()
    fetch.apply(fresh_tree, first, reverse=True)
    assert fetch.ensure() == "patched"
    assert fetch.ensure() == "up to date"
    assert "llama_mtp_set_layer_offset" in (fresh_tree / "include" / "llama-mtp.h").read_text()
    target = fresh_tree / "src" / "models" / "step35.cpp"
    target.write_text(target.read_text().replace("h_all_rows", "h_all_rows_edited"))  # patch 0002's lines
    with pytest.raises(fetch.VendorError, match="modified"):
        fetch.ensure()


def test_hash_mismatch_is_refused(fetch, tmp_path, monkeypatch):
    fake = tmp_path / "llama_cpp_python-0.3.31.tar.gz"
    fake.write_bytes(b"not the sdist")
    monkeypatch.setenv("STEPMTP_LLAMA_SDIST", str(fake))
    with pytest.raises(fetch.VendorError, match="does not match the pinned"):
        fetch.obtain_sdist(fetch.manifest())


def test_offline_download_fails_clearly(fetch, tmp_path, monkeypatch):
    monkeypatch.delenv("STEPMTP_LLAMA_SDIST", raising=False)
    monkeypatch.setenv("STEPMTP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(fetch.VendorError, match="could not download.*STEPMTP_LLAMA_SDIST"):
        fetch.obtain_sdist(fetch.manifest())


def test_the_real_tree_is_up_to_date(fetch):
    if not fetch.TREE.exists():
        pytest.skip("vendor/llama.cpp not materialised in this checkout")
    assert fetch.ensure() == "up to date"
