"""The vLLM plugin end to end (serving venv only: `make test-serve`; docs/serving.md).

Each engine runs in a process of its own (`vllm_gen.py`; a start costs ~50 s on 2 cores), once per module:
stock vLLM (plugin not loaded), the plugin without an icecache config, and the plugin at budget 256. Short
prompts must come out token-for-token as stock vLLM; the ~3.6k-token passkey prompts are compared with
icecache's HF runtime, precomputed in the main venv (`make_reference.py` -> data/hf_reference.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.serve

HERE = Path(__file__).parent
REFERENCE = json.loads((HERE / "data" / "hf_reference.json").read_text())
SHORT = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nx = np.arange(10)\n",
    "The quick brown fox",
    "List three uses of a paperclip:\n1.",
]
LONG = [p["prompt_token_ids"] for p in REFERENCE["prompts"]]
NEW = REFERENCE["new_tokens"]


def run_vllm(tmp: Path, *, plugin: bool, additional_config: dict | None, prompts: list, max_tokens: int = NEW,
             expect_fail: bool = False) -> dict:
    """Generate greedily in a fresh vLLM process; returns vllm_gen.py's output (or ``{"log": ...}`` when it
    failed as expected)."""
    from icecache.serving.model_dir import vllm_model_dir

    tmp.mkdir(parents=True, exist_ok=True)
    req = {"model": str(vllm_model_dir()), "additional_config": additional_config, "prompts": prompts, "max_tokens": max_tokens}
    (tmp / "req.json").write_text(json.dumps(req))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_PLUGINS="icecache" if plugin else "none")
    proc = subprocess.run([sys.executable, str(HERE / "vllm_gen.py"), "req.json", "out.json"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (tmp / "log.txt").write_text(log)
    if expect_fail:
        assert proc.returncode != 0, "vLLM started although the config is bad"
        return {"log": log}
    assert proc.returncode == 0, log[-4000:]
    out = json.loads((tmp / "out.json").read_text())
    out["log"] = log
    return out


ICE_256 = {"icecache": REFERENCE["configs"]["exact-256"]}


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return run_vllm(tmp_path_factory.mktemp("stock"), plugin=False, additional_config=None, prompts=SHORT + LONG)


@pytest.fixture(scope="module")
def plugin_unconfigured(tmp_path_factory):
    return run_vllm(tmp_path_factory.mktemp("plain"), plugin=True, additional_config=None, prompts=SHORT)


@pytest.fixture(scope="module")
def ice(tmp_path_factory):
    return run_vllm(tmp_path_factory.mktemp("ice"), plugin=True, additional_config=ICE_256, prompts=SHORT + LONG)


def test_unconfigured_plugin_is_stock(stock, plugin_unconfigured):
    assert plugin_unconfigured["token_ids"] == stock["token_ids"][: len(SHORT)]
    assert "icecache: sparse decode on" not in plugin_unconfigured["log"]


def test_short_contexts_are_exact(stock, ice):
    """Contexts within sink + window + budget delegate to vLLM's kernel: the same tokens as stock vLLM."""
    assert "icecache: sparse decode on" in ice["log"]
    assert ice["token_ids"][: len(SHORT)] == stock["token_ids"][: len(SHORT)]


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def ice_tight(tmp_path_factory):
    cfg = {"icecache": REFERENCE["configs"]["exact-32"]}
    return run_vllm(tmp_path_factory.mktemp("ice32"), plugin=True, additional_config=cfg, prompts=LONG)


def _compare(name: str, got: list[list[int]], stock: dict) -> list[tuple[str, int, int, int]]:
    """(prompt, tokens equal to HF's sparse run, tokens of HF's sparse run equal to its full run, stock vLLM
    tokens equal to HF's full run), each the length of the common prefix."""
    rows = []
    for rec, ids, dense in zip(REFERENCE["prompts"], got, stock["token_ids"][len(SHORT):]):
        out = rec["outputs"]
        rows.append((rec["name"], _matching_prefix(ids, out[name]), _matching_prefix(out[name], out["full"]),
                     _matching_prefix(dense, out["full"])))
    print(f"{name}: (prompt, plugin=HF sparse, HF sparse=HF full, stock vLLM=HF full) of {NEW}:", rows)
    return rows


def test_sparse_decode_matches_hf_runtime(stock, ice):
    """Budget 256 on the ~3.5k-token prompts: the tokens of icecache's HF runtime (exact pager)."""
    assert ice["log"].count("decodes sparse from context") >= len(LONG)
    rows = _compare("exact-256", ice["token_ids"][len(SHORT):], stock)
    assert all(r[1] == NEW for r in rows), rows


def test_tight_sparse_decode_matches_hf_runtime(stock, ice_tight):
    """Budget 32, window 16: the output departs from full attention, and follows icecache's HF runtime."""
    rows = _compare("exact-32", ice_tight["token_ids"], stock)
    assert any(r[2] < NEW for r in rows), "the tight config no longer changes the output; pick a tighter one"
    assert all(r[1] == NEW for r in rows), rows


@pytest.fixture(scope="module")
def ice_mdci(tmp_path_factory):
    cfg = {"icecache": REFERENCE["configs"]["mdci-256"]}
    return run_vllm(tmp_path_factory.mktemp("mdci"), plugin=True, additional_config=cfg, prompts=LONG)


def test_mdci_sparse_decode_matches_hf_runtime(ice_mdci):
    """M-DCI at budget 256 (the essay departs from full attention at token 15): the pagers are built and fed
    in the HF runtime's order, so they select the same pages."""
    rows = [(rec["name"], _matching_prefix(ids, rec["outputs"]["mdci-256"]), _matching_prefix(rec["outputs"]["mdci-256"], rec["outputs"]["full"]))
            for rec, ids in zip(REFERENCE["prompts"], ice_mdci["token_ids"])]
    print(f"mdci-256: (prompt, plugin=HF sparse, HF sparse=HF full) of {NEW}:", rows)
    assert all(r[1] == NEW for r in rows), rows


@pytest.mark.parametrize("bad, message", [
    ({"budget": -1}, "IceCacheConfig.budget must be in [0, 16777216], got -1"),
    ({"budgte": 256}, 'additional_config["icecache"] has unknown or unsupported key(s) budgte'),
])
def test_bad_config_fails_at_start(tmp_path, bad, message):
    out = run_vllm(tmp_path, plugin=True, additional_config={"icecache": bad}, prompts=SHORT[:1], expect_fail=True)
    assert "ConfigError" in out["log"] and message in out["log"], out["log"][-3000:]


# ---------------------------------------------------------------------------------------------- OpenAI server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vLLM's OpenAI server with the plugin at budget 256 on 127.0.0.1; yields its base URL and log path."""
    import socket
    import time
    import urllib.request

    from icecache.serving.model_dir import vllm_model_dir

    tmp = tmp_path_factory.mktemp("server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_PLUGINS="icecache")
    log_path = tmp / "server.log"
    # not the `vllm serve` script: vllm-cpu 0.32.0's CLI asks for the version of a distribution named "vllm" and
    # stops (PackageNotFoundError; entrypoints/cli/main.py:99); the module entry point serves the same app
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model_dir()),
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "8192", "--enforce-eager", "--seed", "0",
           "--additional-config", json.dumps(ICE_256)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not become healthy in 600 s"
            time.sleep(2)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_server_matches_offline(server, ice):
    """8 concurrent OpenAI clients (short and ~3.6k-token prompts) get the offline plugin's text."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    url, log_path = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    prompts = SHORT[:6] + LONG
    expected = ice["texts"][:6] + ice["texts"][len(SHORT):]

    def ask(p):
        return client.completions.create(model=model, prompt=p, max_tokens=NEW, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts == expected
    assert "decodes sparse from context" in log_path.read_text()


def test_server_rejects_prompt_over_context(server):
    from openai import BadRequestError, OpenAI

    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with pytest.raises(BadRequestError, match="context length|maximum"):
        client.completions.create(model=model, prompt=[504] * 9000, max_tokens=4, temperature=0)
