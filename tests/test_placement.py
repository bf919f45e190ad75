"""llama-server's placement flags, quantized KV caches and split GGUF shards.

Each flag is checked where llama.cpp says what it did: its log (which buffer a tensor
went to, each buffer's size, each KV cache's type), its memory accounting, its errors.
On this CPU build the GPU flags are seen through RPC servers, whose devices llama.cpp
treats as GPUs."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stepmtp import Engine, Model, rpc
from stepmtp.llama import ModelLoadError, shard_paths
from stepmtp.models import EVAL_PROMPTS, default_model_path, split_model, write_shards
from stepmtp.placement import FFN_EXPS, Placement, PlacementError, buffer_type_names
from stepmtp.server.cli import parse_args
from test_server import ServerProcess
from test_swa import _same_up_to_rounding

N_UBATCH = 64  # the bundled model's window is 128: a 256-cell sliding-window cache
N_GEN = 420    # past the window plus the ubatch: the ring's cells are overwritten
DONE_WHEN = "-ctk q8_0 -ctv q8_0 --cpu-moe --n-cpu-moe 2 -ot exps=CPU --no-mmap"


@pytest.fixture(scope="module")
def path() -> Path:
    return default_model_path()


@pytest.fixture
def llama_log():
    """llama.cpp's log lines (debug ones too) while the test runs."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    lg = logging.getLogger("stepmtp.llama")
    handler, level = Keep(), lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    yield lines
    lg.removeHandler(handler)
    lg.setLevel(level)


def overridden(lines: list[str]) -> dict[str, str]:
    """tensor -> buffer type, from llama.cpp's 'buffer type overridden' lines."""
    out = {}
    for line in lines:
        m = re.match(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)", line)
        if m:
            out[m[1]] = m[2]
    return out


def model_buffers(lines: list[str]) -> dict[str, float]:
    """buffer type -> MiB, from llama.cpp's 'model buffer size' lines."""
    return {m[1]: float(m[2]) for line in lines
            if (m := re.match(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", line))}


# -- tensor buffer overrides ------------------------------------------------------------


def test_overrides_place_the_tensors_llama_cpp_says(path, llama_log):
    exps = {f"blk.{i}.ffn_{p}_exps.weight" for i in range(1, 6) for p in ("gate", "up", "down")}
    with Model(path, placement=Placement.of(cpu_moe=True)):
        assert overridden(llama_log) == dict.fromkeys(exps, "CPU")
    llama_log.clear()
    # the first two layers: blk.0 is dense, so blk.1's experts alone
    with Model(path, placement=Placement.of(n_cpu_moe=2)):
        assert set(overridden(llama_log)) == {t for t in exps if t.startswith("blk.1.")}
    llama_log.clear()
    with Model(path, placement=Placement.of(override_tensor=r"blk\.3\.attn_(q|k)\.=CPU,output_norm=CPU")):
        assert set(overridden(llama_log)) == {"blk.3.attn_q.weight", "blk.3.attn_k.weight", "output_norm.weight"}


def test_done_when_flags_through_the_server_reach_llama_cpp(path, llama_log):
    cfg = parse_args(["-m", str(path), *DONE_WHEN.split()])
    kw = cfg._placement_kw()
    # -cmoe, -ncmoe 2 and -ot in the order given, llama-server's patterns
    assert kw["override_tensor"] == [(FFN_EXPS, "CPU"), (rf"blk\.0{FFN_EXPS}", "CPU"), (rf"blk\.1{FFN_EXPS}", "CPU"),
                                     ("exps", "CPU")]
    with Engine(path, mode="none", n_ctx=256, n_threads=1, use_mmap=cfg.use_mmap, **kw) as eng:
        assert len(overridden(llama_log)) == 15
        # --no-mmap: a plain CPU buffer, not the mapped file
        assert set(model_buffers(llama_log)) == {"CPU"}
        assert eng.kv_types["target"] == ("f16", "f16")


def test_mmap_and_mlock_reach_llama_cpp(path, llama_log):
    with Model(path):
        assert set(model_buffers(llama_log)) == {"CPU_Mapped"}
    llama_log.clear()

    def locked() -> int:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmLck:\s+(\d+) kB", status)[1]) << 10

    before = locked()
    with Model(path, use_mmap=False, use_mlock=True) as m:
        # the model's buffer is locked in RAM, unless the system refused (llama.cpp says so)
        assert locked() - before >= m.size or any("mlock" in line for line in llama_log)
    assert set(model_buffers(llama_log)) == {"CPU"}


# -- KV cache types ----------------------------------------------------------------------------


def _engine(path: Path, **kw) -> Engine:
    return Engine(path, n_ctx=2048, n_ubatch=N_UBATCH, n_batch=256, n_threads=1, **kw)


Q8 = dict(type_k="q8_0", type_v="q8_0", type_k_draft="q8_0", type_v_draft="q8_0")


@pytest.fixture(scope="module")
def plain_q8(path):
    with _engine(path, mode="none", **Q8) as eng:
        out = eng.generate(EVAL_PROMPTS[0], n_predict=N_GEN, temperature=0).tokens
        assert eng.target.seq_pos_min(0) > 0  # the ring dropped the earliest positions
    return out


@pytest.mark.parametrize("mode", ["chain", "single"])
def test_q8_0_kv_speculation_is_plain_decoding(path, plain_q8, mode):
    """Rejected rows rolled back in q8_0 caches (the target's trimmed ring and the heads'),
    past the window: the text is plain decoding's with the same cache types."""
    with _engine(path, mode=mode, n_max=3, **Q8) as eng:
        c = eng.generate(EVAL_PROMPTS[0], n_predict=N_GEN, temperature=0)
        assert eng.target.seq_pos_min(0) > 0
    assert c.stats.n_accepted > 0 and c.stats.n_drafted > c.stats.n_accepted
    assert c.tokens == plain_q8


def test_q8_0_kv_context_checkpoint(path):
    """A next prompt that leaves the cache 2 tokens before the last prompt's end goes on
    from the q8_0 context checkpoint there, and answers as a fresh run does."""
    with _engine(path, mode="chain", **Q8) as eng:
        _, near = eng.driver.split_offsets
        p1 = eng.tokenize(EVAL_PROMPTS[2])
        prompt = p1[:-2] + eng.tokenize("\n\n\ndef other(x):\n", add_special=False)
        fresh = eng.generate(prompt, n_predict=64, temperature=0, cache_prompt=False, n_probs=2)
        eng.generate(p1, n_predict=N_GEN, temperature=0, cache_prompt=False)
        got = eng.generate(prompt, n_predict=64, temperature=0, n_probs=2)
    assert got.stats.n_prompt_cached == len(p1) - near
    _same_up_to_rounding(got, fresh, "q8_0 checkpoint")


def test_kv_bytes_q8_0_against_f16(path, llama_log):
    """q8_0 stores 32 values in 34 bytes, f16 in 64: every KV cache shrinks by 17/32,
    as llama.cpp accounts it; the heads' contexts take their own types."""
    mem = {}
    for name, kw in (("f16", {}), ("q8_0", dict(type_k="q8_0", type_v="q8_0")), ("q8_0+heads", Q8)):
        with _engine(path, mode="chain", **kw) as eng:
            mem[name] = eng.memory()
    f16, q8, q8h = mem["f16"], mem["q8_0"], mem["q8_0+heads"]
    assert q8["target"]["kv"] * 32 == f16["target"]["kv"] * 17
    assert q8["draft"]["kv"] == f16["draft"]["kv"]  # -ctk alone leaves the heads at f16, as llama-server
    assert q8h["draft"]["kv"] * 32 == f16["draft"]["kv"] * 17
    kv_lines = [line for line in llama_log if line.startswith("llama_kv_cache: size")]
    assert any("K (q8_0)" in line and "V (q8_0)" in line for line in kv_lines)


def test_quantized_v_needs_flash_attention(path):
    with pytest.raises(PlacementError, match=r"type_v_draft \(-ctvd/--cache-type-v-draft\).*flash attention"):
        Engine(path, type_v_draft="q4_0", flash_attn=False)
    # a quantized K alone is fine without it
    with Engine(path, mode="none", n_ctx=256, n_threads=1, type_k="q4_0", flash_attn=False) as eng:
        assert eng.generate("def f(x):", n_predict=4, temperature=0).stats.n_predicted == 4


# -- bad values --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    (dict(type_k="q9"), "type_k (-ctk/--cache-type-k): unknown KV cache type 'q9'"),
    (dict(type_v_draft="int8"), "type_v_draft (-ctvd/--cache-type-v-draft): unknown KV cache type"),
    (dict(override_tensor="exps"), "override_tensor (-ot/--override-tensor): 'exps' is not <tensor name pattern>="),
    (dict(override_tensor="exps=GPU0"), "unknown buffer type 'GPU0' (available: CPU"),
    (dict(override_tensor="(exps=CPU"), "'(exps' is not a regular expression"),
    (dict(override_tensor_draft="x=Y", mtp_model="/nonexistent.gguf"), "override_tensor_draft (-otd/"),
    (dict(n_cpu_moe=-1), "n_cpu_moe (-ncmoe/--n-cpu-moe): a number of layers >= 0"),
    (dict(devices="CUDA0"), "devices (-dev/--device): invalid device 'CUDA0'"),
    (dict(split_mode="rows"), "split_mode (-sm/--split-mode): 'rows'"),
    (dict(tensor_split="3,x"), "tensor_split (-ts/--tensor-split): 'x' is not a number"),
    (dict(numa="everywhere"), "numa (--numa): 'everywhere'"),
])
def test_bad_values_name_the_option(path, kw, needle):
    with pytest.raises(PlacementError) as e:
        Engine(path, n_ctx=256, **kw)
    assert needle in str(e.value)


@pytest.mark.parametrize("args,needle", [
    (["-ot", "exps"], "argument -ot/--override-tensor: 'exps' is not"),
    (["-ot", "exps=GPU0"], "-ot/--override-tensor: unknown buffer type 'GPU0' (available: CPU"),
    (["-ot", "blk.(1=CPU"], "argument -ot/--override-tensor: the tensor name pattern 'blk.(1'"),
    (["-otd", "x=NPU"], "-otd/--override-tensor-draft: unknown buffer type 'NPU'"),
    (["-ncmoe", "two"], "argument -ncmoe/--n-cpu-moe: expected an integer"),
    (["-ctk", "q9"], "argument -ctk/--cache-type-k: unsupported cache type 'q9'"),
    (["-ctvd", "Q8"], "argument --spec-draft-type-v/-ctvd/--cache-type-v-draft: unsupported cache type"),
    (["-dev", "CUDA0"], "-dev/--device: invalid device 'CUDA0'"),
    (["-devd", "Metal"], "-devd/--device-draft: invalid device 'Metal'"),
    (["-sm", "rows"], "argument -sm/--split-mode"),
    (["-ts", "1,a"], "-ts/--tensor-split: 'a' is not a number"),
    (["--numa", "x"], "argument --numa"),
    (["-fa", "off", "-ctv", "q8_0"], "-ctv/--cache-type-v: a q8_0 V cache needs flash attention"),
])
def test_bad_flags_are_an_error_at_start(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_flags_and_their_environment_variables(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_OVERRIDE_TENSOR", "a=CPU")
    monkeypatch.setenv("LLAMA_ARG_CPU_MOE", "1")
    monkeypatch.setenv("LLAMA_ARG_MMAP", "off")
    monkeypatch.setenv("LLAMA_ARG_CACHE_TYPE_K", "q8_0")
    monkeypatch.setenv("LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", "1")
    cfg = parse_args(["-ot", "b=CPU", "-ctv", "q4_0", "--mlock", "-sm", "row", "-ts", "3/1", "-mg", "1", "--numa",
                      "distribute", "-dev", "none", "-ctkd", "q5_1", "-ctvd", "iq4_nl", "-cmoed"])
    # the environment's overrides first, then the command line's, in its order
    assert [p for p, _ in cfg.placement.override_tensor] == ["a", FFN_EXPS, "b"]
    assert [p for p, _ in cfg.placement_draft.override_tensor] == [rf"blk\.0{FFN_EXPS}", FFN_EXPS]
    assert (cfg.cache_type_k, cfg.cache_type_v, cfg.cache_type_k_draft, cfg.cache_type_v_draft) == \
        ("q8_0", "q4_0", "q5_1", "iq4_nl")
    assert (cfg.use_mmap, cfg.use_mlock, cfg.numa) == (False, True, "distribute")
    kw = cfg._placement_kw()
    assert (kw["split_mode"], kw["tensor_split"], kw["main_gpu"], kw["devices"]) == ("row", [3.0, 1.0], 1, ())
    assert parse_args(["--mmap"]).use_mmap is True  # the command line wins


def test_numa_reaches_ggml(path):
    """ggml takes one NUMA strategy per process: after the engine's, a second call is
    refused by ggml itself."""
    code = f"""
from stepmtp import Engine
from stepmtp.binding import lib
from stepmtp.placement import PlacementError
e = Engine({str(path)!r}, mode="none", n_ctx=256, n_threads=1, numa="isolate")
lib.llama_numa_init(lib.GGML_NUMA_STRATEGY_DISTRIBUTE)
try:
    Engine({str(path)!r}, mode="none", n_ctx=256, numa="distribute")
except PlacementError as x:
    print(x)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "NUMA already initialized" in r.stderr
    assert "already runs with NUMA strategy 'isolate'" in r.stdout


# -- GPU flags, through RPC servers (llama.cpp's GPU devices on a CPU build) -------------------


@pytest.fixture(scope="module")
def rpc_pair():
    if not rpc.rpc_available():
        pytest.skip("built with -DSTEPMTP_RPC=off")
    from test_rpc import RPCServer

    pair = [RPCServer(), RPCServer()]
    servers = rpc.Servers([s.endpoint for s in pair])
    yield [s.endpoint for s in pair], servers
    for s in pair:
        s.stop()


def test_device_flags_reach_llama_cpp_over_rpc(path, rpc_pair, llama_log):
    eps, servers = rpc_pair
    names = servers.device_names  # RPCn, as ggml numbers them in this process
    bufts = [b for b in buffer_type_names(servers.remote_devices) if b.startswith("RPC")]
    assert len(names) == 2 and len(bufts) == 2

    def load(ngl="all", **kw) -> dict[str, float]:
        llama_log.clear()
        with Model(path, rpc=eps, n_gpu_layers=ngl, placement=Placement.of(**kw)):
            pass
        return model_buffers(llama_log)

    both = load()
    assert len(both) == 3 and both["CPU_Mapped"] < 0.5  # the two servers, the token embeddings
    first, second = (b for b in bufts if b.endswith(f"[{eps[0]}]")), (b for b in bufts if b.endswith(f"[{eps[1]}]"))
    first, second = next(first), next(second)
    # -ts: all on one
    assert set(load(tensor_split="1,0")) == {"CPU_Mapped", first}
    assert set(load(tensor_split="0,1")) == {"CPU_Mapped", second}
    # -dev: the second alone; none
    assert set(load(devices=names[1])) == {"CPU_Mapped", second}
    assert set(load(devices="none")) == {"CPU_Mapped"}
    # -sm none -mg: the main device alone, and an index llama.cpp has no device for
    assert set(load(split_mode="none", main_gpu=1)) == {"CPU_Mapped", second}
    with pytest.raises(ModelLoadError, match="invalid value for main_gpu: 2"):
        load(split_mode="none", main_gpu=2)
    # -cmoe keeps the experts home
    assert load(cpu_moe=True)["CPU_Mapped"] > both["CPU_Mapped"] + 1
    # -ot to a server's buffer with no layer offloaded
    assert first in load(ngl=0, override_tensor=f"exps={first}")
    # the first pattern a tensor's name matches wins, in the command line's order
    cfg = parse_args(["--rpc", ",".join(eps), "-ot", f"exps={first}", "--cpu-moe"])
    llama_log.clear()
    with Model(path, rpc=eps, n_gpu_layers="all", placement=cfg.placement):
        assert set(overridden(llama_log).values()) == {first}
    cfg = parse_args(["--rpc", ",".join(eps), "--cpu-moe", "-ot", f"exps={first}"])
    llama_log.clear()
    with Model(path, rpc=eps, n_gpu_layers="all", placement=cfg.placement):
        assert set(overridden(llama_log).values()) == {"CPU"}


# -- split shards ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(path, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    embedded = write_shards(path, out / "embedded", 3)
    pair = split_model(path, out / "pair")
    return {"embedded": embedded, "trunk": write_shards(pair["trunk"], out / "trunk", 2),
            "mtp": write_shards(pair["mtp"], out / "mtp", 2)}


def test_shards_load_and_answer_the_same(path, shards):
    assert shard_paths(shards["embedded"][0]) == shards["embedded"]
    with Engine(path, mode="chain", n_ctx=512, n_threads=1, adaptive=False) as eng:
        want = eng.generate(EVAL_PROMPTS[1], n_predict=64, temperature=0)
    with Engine(shards["embedded"][0], mode="chain", n_ctx=512, n_threads=1, use_mmap=False,
                adaptive=False) as eng:
        assert eng.model.has_mtp
        got = eng.generate(EVAL_PROMPTS[1], n_predict=64, temperature=0)
    assert got.tokens == want.tokens and got.stats.n_accepted == want.stats.n_accepted
    with Engine(shards["trunk"][0], mtp_model=shards["mtp"][0], mode="chain", n_ctx=512, n_threads=1,
                adaptive=False) as eng:
        assert eng.generate(EVAL_PROMPTS[1], n_predict=64, temperature=0).tokens == want.tokens


def test_a_missing_shard_is_a_clear_error(shards, tmp_path):
    files = [Path(p) for p in shards["embedded"]]
    moved = tmp_path / files[1].name
    files[1].rename(moved)
    try:
        with pytest.raises(ModelLoadError, match=r"shard 2 of 3: .*-00002-of-00003\.gguf: no such file"):
            Model(files[0])
        r = subprocess.run([sys.executable, "-m", "stepmtp.server", "-m", str(files[0])], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and "-00002-of-00003.gguf" in r.stderr
    finally:
        moved.rename(files[1])
    with pytest.raises(ModelLoadError, match="a shard other than the first: load .*-00001-of-00003.gguf"):
        Model(files[2])


def test_missing_mtp_block_across_shards_is_named(path, tmp_path):
    """Shards of a file that lost MTP block 1 (blk.7): the loader names what is missing."""
    parts = write_shards(path, tmp_path, 2, keep=lambda name: not name.startswith("blk.7."))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.7\.[a-z_.]+' not found"):
        Model(parts[0])


# -- the server: the done-when, and /props ---------------------------------------------------


def _serve(args: list[str], log_dir: Path, prompts: list[str]) -> tuple[dict, list[str]]:
    srv = ServerProcess(args, log_dir)
    try:
        srv.wait_ready()
        props = httpx.get(srv.url + "/props", timeout=30).json()
        texts = [httpx.post(srv.url + "/completion", json={"prompt": p, "n_predict": 48, "temperature": 0},
                            timeout=120).json()["content"] for p in prompts]
    finally:
        srv.stop()
    return props, texts


def test_server_with_the_done_when_flags(path, shards, tmp_path):
    """MTP on (n-max 3) with the issue's flags at -c 35000 -np 1, from the file and from
    its shards: the texts are plain decoding's, and /props has llama.cpp's KV bytes."""
    prompts = list(EVAL_PROMPTS[:2])
    base = [*DONE_WHEN.split(), "-c", "35000", "-np", "1", "-t", "1"]
    spec = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    _, plain = _serve(["-m", str(path), *base], tmp_path, prompts)
    props, texts = _serve(["-m", str(path), *base, *spec], tmp_path, prompts)
    props_sh, texts_sh = _serve(["-m", str(shards["embedded"][0]), *base, *spec], tmp_path, prompts)
    assert texts == plain and texts_sh == plain
    mem = props["stepmtp"]["memory"]
    assert props_sh["stepmtp"]["memory"] == mem
    assert props["stepmtp"]["n_draft"] == 3
    with Engine(path, mode="chain", n_ctx=35000, n_threads=1, type_k="q8_0", type_v="q8_0") as eng:
        want = eng.memory()
    assert (mem["target"]["kv"], mem["draft"]["kv"]) == (want["target"]["kv"], want["draft"]["kv"])


def test_bench_kv_bytes_take_the_types(path, tmp_path):
    import json

    from stepmtp.bench.__main__ import main as bench_main
    from stepmtp.bench.runners import kv_types_of, llama_server_kv

    assert kv_types_of(["-cmoe", "-ctk", "q8_0", "--cache-type-v-draft", "q4_0"]) == \
        {"target": ("q8_0", "f16"), "draft": ("f16", "q4_0")}
    out = tmp_path / "bench.json"
    assert bench_main(["-m", str(path), "--configs", "chain-3", "--limit", "1", "-n", "8", "-t", "1", "-c", "1024",
                       "-ctk", "q8_0", "-ctv", "q8_0", "-ncmoe", "2", "--json", str(out), "-q"]) == 0
    mem = json.loads(out.read_text())["configs"][0]["info"]["memory"]
    kv = llama_server_kv(path, 1024, 1, True, kv_types={"target": ("q8_0", "q8_0")})
    assert mem["kv"] == kv  # the engine's heads hold what llama-server's one MTP context does
    assert mem["kv"] < llama_server_kv(path, 1024, 1, True)
