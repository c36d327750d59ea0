"""IceCache inside transformers generation: exactness, Quest reference, conservation, misuse, faults."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import SparseDecodeReference, assert_host_kv_is_the_full_caches, make_tiny_llama, record_updates
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.core.errors import CacheMisuseError, ConfigError
from icecache.runtime.attention import use_attention
from icecache.runtime.workers import BackgroundJobError

PAGERS = icecache.available_pagers()


def prompts(batch: int, lengths=(100, 70), seed: int = 1):
    """Token ids [batch, max_len] with left padding, and the attention mask."""
    from icecache.measure.capture import left_padded_random_ids

    return left_padded_random_ids(lengths[:batch], seed=seed)


def run(model, ids, mask, cfg=None, steps=32, cache=None):
    """Greedy generate; returns (sequences, logits [steps, B, V], cache)."""
    kw = {"max_new_tokens": steps, "do_sample": False, "output_logits": True, "return_dict_in_generate": True, "pad_token_id": 0}
    with torch.no_grad():
        if cfg is None and cache is None:
            out = model.generate(ids, attention_mask=mask, **kw)
            return out.sequences, torch.stack(out.logits), None
        cache = cache if cache is not None else IceCache(model.config, cfg)
        with use_attention(model):
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
        return out.sequences, torch.stack(out.logits), cache


@pytest.mark.parametrize("name", PAGERS)
@pytest.mark.parametrize("batch", [1, 2])
def test_full_budget_reproduces_sdpa(tiny_llama, name, batch):
    """Budget >= context: every middle page is selected, so logits match built-in SDPA over 32 steps."""
    ids, mask = prompts(batch)
    ref_seq, ref_logits, _ = run(tiny_llama, ids, mask)
    cfg = IceCacheConfig(index=name, budget=512, page_size=8, sink=4, window=16, dense_layers=())
    seq, logits, cache = run(tiny_llama, ids, mask, cfg)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert torch.equal(seq, ref_seq)
    cache.check_conservation()
    cache.close()


def test_exact_pager_at_budget_of_middle_length_is_exact(tiny_llama):
    ids, mask = prompts(1, lengths=(90,))
    _, ref_logits, _ = run(tiny_llama, ids, mask)
    # middle length at the end = 90 + 32 - 4 - 16 = 102 tokens
    cfg = IceCacheConfig(index="exact", budget=102, page_size=8, sink=4, window=16, dense_layers=(1,))
    _, logits, cache = run(tiny_llama, ids, mask, cfg)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    cache.close()


# ------------------------------------------------------------------------------- Quest reference
class QuestReference(SparseDecodeReference):
    """An independent Quest computation on a plain DynamicCache: sink + window + top token-order pages."""

    def __init__(self, sink, window, page_size, budget, dense_layers=()):
        super().__init__(dense_layers)
        self.S, self.W, self.P, self.B = sink, window, page_size, budget

    def keep(self, layer_idx, q, keys):
        T = keys.shape[0]
        keep = list(range(min(self.S, T))) + list(range(max(0, T - self.W), T))
        mid = list(range(self.S, max(self.S, T - self.W)))
        scores = []
        for start in range(0, len(mid), self.P):
            blk = keys[mid[start : start + self.P]]
            lo, hi = blk.min(0).values, blk.max(0).values
            scores.append(max(float(torch.maximum(qi * lo, qi * hi).sum()) for qi in q))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        used = 0
        for i in order:
            page = mid[i * self.P : (i + 1) * self.P]
            if used + len(page) > self.B:
                break
            keep += page
            used += len(page)
        return keep


def test_sequential_pager_matches_independent_quest_reference():
    model = make_tiny_llama(seed=3)
    ids, mask = prompts(1, lengths=(120,), seed=5)
    S, W, P, budget = 4, 16, 8, 32
    ref = QuestReference(S, W, P, budget)
    AttentionInterface.register("quest_ref", ref)
    AttentionMaskInterface.register("quest_ref", sdpa_mask)
    model.set_attn_implementation("quest_ref")
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), max_new_tokens=24,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    finally:
        model.set_attn_implementation("sdpa")
    cfg = IceCacheConfig(index="sequential", budget=budget, page_size=P, sink=S, window=W, dense_layers=())
    seq, logits, cache = run(model, ids, mask, cfg, steps=24)
    _, full_logits, _ = run(model, ids, mask, steps=24)
    assert torch.equal(seq, out.sequences)
    assert (logits - torch.stack(out.logits)).abs().max().item() <= 1e-4
    # and the budget really is sparse: the run differs from full attention
    assert (logits - full_logits).abs().max().item() > 1e-2
    cache.close()


# ------------------------------------------------------------------------------- conservation
@pytest.mark.parametrize("name", PAGERS)
@pytest.mark.parametrize("lengths", [(100, 70), (10, 3), (21, 20)])
def test_conservation_and_host_kv_equal_full_cache(tiny_llama, name, lengths):
    """Every position in exactly one of sink / window / host page, and the host holds the full cache's KV."""
    ids, mask = prompts(2, lengths=lengths)
    steps = 40  # > window: tokens leave the window and are inserted incrementally
    cfg = IceCacheConfig(index=name, budget=24, page_size=4, sink=4, window=16, dense_layers=(0,))
    cache = IceCache(tiny_llama.config, cfg)
    seen = record_updates(cache)  # what a full cache would hold
    run(tiny_llama, ids, mask, cache=cache, steps=steps)
    cache.check_conservation()
    assert_host_kv_is_the_full_caches(cache, seen, (1, 2, 3), rows=2, heads=2)
    cache.close()


@pytest.mark.parametrize("inserts", ["background", "inline"])
def test_device_bytes_constant_and_one_copy_per_layer_step(tiny_llama, inserts):
    ids, mask = prompts(1, lengths=(200,))
    cfg = IceCacheConfig(index="sequential", budget=32, page_size=8, sink=4, window=16, dense_layers=(), inserts=inserts)
    cache = IceCache(tiny_llama.config, cfg)
    run(tiny_llama, ids, mask, cache=cache, steps=5)
    dev, host = cache.device_kv_bytes(), cache.host_kv_bytes()
    run_more = cache.stats()
    assert run_more["copies_per_layer_step"] <= 1.0
    # (sink + window + budget) slots per KV head, 2 heads x 16 dims x K and V x fp32 x 4 layers
    assert dev == 4 * 2 * (4 + 16 + 32) * 16 * 2 * 4
    # 4 decode steps pushed 4 tokens out of the window; in the background, the one leaving next was inserted ahead
    assert host == 4 * 2 * (200 + 4 - 4 - 16 + (inserts == "background")) * 16 * 2 * 4
    assert run_more["full_kv_bytes"] == 4 * 2 * 204 * 16 * 2 * 4
    # a select scans on torch's threads only when no insert worker holds a core
    threads = 1 if inserts == "background" else torch.get_num_threads()
    assert run_more["select_threads"] == threads
    assert {p.select_threads for layer in cache.layers for row in layer.pagers for p in row} == {threads}
    cache.close()


def test_layer_reuse_runs_and_is_exact_at_full_budget(tiny_llama):
    ids, mask = prompts(2)
    _, ref_logits, _ = run(tiny_llama, ids, mask, steps=20)
    cfg = IceCacheConfig(index="sequential", budget=512, page_size=8, sink=4, window=16, dense_layers=(), reuse_every=2)
    _, logits, cache = run(tiny_llama, ids, mask, cfg, steps=20)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    cache.close()
    sparse = IceCacheConfig(index="sequential", budget=16, page_size=4, sink=4, window=16, dense_layers=(), reuse_every=2)
    _, _, c2 = run(tiny_llama, ids, mask, sparse, steps=20)
    st = c2.stats()
    assert st["stage_seconds"]["select"] > 0 and st["steps"] == 19
    c2.close()


def test_trace_records_every_layer_step(tiny_llama):
    ids, mask = prompts(1, lengths=(80,))
    cfg = IceCacheConfig(index="sequential", budget=16, page_size=4, sink=4, window=16, dense_layers=(0,), trace=True)
    _, _, cache = run(tiny_llama, ids, mask, cfg, steps=6)
    assert len(cache.trace) == 5 * 3 * 2  # decode steps x sparse layers x KV heads
    rec = cache.trace[0]
    assert set(rec) >= {"step", "layer", "kv_head", "pages", "tokens", "new_pages", "bytes"}
    assert rec["tokens"] <= 16 and rec["bytes"] == rec["new_tokens"] * 2 * 16 * 4
    cache.close()


# ------------------------------------------------------------------------------- misuse and faults
def test_cache_with_sdpa_attention_raises(tiny_llama):
    ids, mask = prompts(1)
    cache = IceCache(tiny_llama.config, IceCacheConfig(index="sequential", dense_layers=()))
    with pytest.raises(CacheMisuseError, match="set_attn_implementation"), torch.no_grad():
        tiny_llama.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    cache.close()


def test_wrong_layer_count_and_bad_dense_layers(tiny_llama):
    small = make_tiny_llama(num_hidden_layers=2)
    cache = IceCache(small.config, IceCacheConfig(index="sequential", dense_layers=()))
    ids, mask = prompts(1)
    with pytest.raises(CacheMisuseError, match="built for 2 layers"):
        run(tiny_llama, ids, mask, cache=cache, steps=2)
    cache.close()
    with pytest.raises(ConfigError, match="dense_layers"):
        IceCache(tiny_llama.config, IceCacheConfig(index="sequential", dense_layers=(7,)))


def test_multi_token_step_after_prefill_raises(tiny_llama):
    cfg = IceCacheConfig(index="sequential", budget=16, sink=4, window=16, dense_layers=())
    ids, _ = prompts(1)
    with use_attention(tiny_llama), IceCache(tiny_llama.config, cfg) as cache, torch.no_grad():
        tiny_llama(ids[:, :50], past_key_values=cache)
        tiny_llama(ids[:, 50:51], past_key_values=cache)
        with pytest.raises(CacheMisuseError, match="only one token per decode step"):
            tiny_llama(ids[:, 51:60], past_key_values=cache)


def test_closed_cache_refuses_use(tiny_llama):
    cache = IceCache(tiny_llama.config, IceCacheConfig(index="sequential", dense_layers=()))
    cache.close()
    cache.close()  # idempotent
    ids, mask = prompts(1)
    with pytest.raises(CacheMisuseError, match="closed"):
        run(tiny_llama, ids, mask, cache=cache, steps=2)


def test_failing_index_build_surfaces_in_caller_and_recovers(tiny_llama):
    ids, mask = prompts(1)
    cfg = IceCacheConfig(index="sequential", budget=16, sink=4, window=16, dense_layers=(), threads=2)
    cache = IceCache(tiny_llama.config, cfg)

    def boom(layer, b, h):
        if layer == 2:
            raise MemoryError("injected failure")

    cache.inject_fault("build", boom)
    with pytest.raises(BackgroundJobError, match="layer 2") as info:
        run(tiny_llama, ids, mask, cache=cache, steps=3)
    assert isinstance(info.value.__cause__, MemoryError)
    cache.close()
    # a new generation afterwards works
    seq, _, c2 = run(tiny_llama, ids, mask, cfg, steps=3)
    assert seq.shape[1] == ids.shape[1] + 3
    c2.close()


def test_unsupported_model_features_raise_at_construction(tiny_llama):
    cfg = tiny_llama.config.__class__(**{**tiny_llama.config.to_dict(), "attn_logit_softcapping": 30.0})
    with pytest.raises(ConfigError, match="softcapping"):
        IceCache(cfg, IceCacheConfig(index="sequential"))


def test_two_threads_two_caches_do_not_interfere():
    m1, m2 = make_tiny_llama(seed=0), make_tiny_llama(seed=0)
    ids, mask = prompts(1)
    ref_seq, _, _ = run(m1, ids, mask, steps=12)
    cfg = IceCacheConfig(index="sequential", budget=512, sink=4, window=16, dense_layers=())
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(i, model):
        try:
            for _ in range(3):
                seq, _, c = run(model, ids, mask, cfg, steps=12)
                c.close()
                results[i] = seq
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate((m1, m2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert torch.equal(results[0], ref_seq) and torch.equal(results[1], ref_seq)


@pytest.mark.model
@pytest.mark.parametrize("index", ["sequential", "mdci"])
def test_embedded_model_full_budget_matches_sdpa(smollm2, index):
    """On the real model, budget >= context selects every middle page: the same tokens as SDPA, logits 1e-4."""
    model, tok = smollm2
    enc = tok.apply_chat_template([{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ref_seq, ref_logits, _ = run(model, ids, mask, steps=32)
    cfg = IceCacheConfig(index=index, budget=1024, page_size=16, sink=4, window=16)
    seq, logits, cache = run(model, ids, mask, cfg, steps=32)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert torch.equal(seq, ref_seq)
    cache.check_conservation()
    cache.close()


@pytest.mark.model
def test_min_new_tokens_decodes_the_same_steps_with_every_method(smollm2):
    from icecache.runtime.generate import generate

    model, tok = smollm2
    prompt = "Answer with one word: what colour is the sky?"  # the model stops after a few tokens by itself
    free = generate(model, tok, prompt, max_new_tokens=24, return_result=True)
    assert free.new_tokens < 24, "prompt no longer ends early; pick one that does"
    for cfg in (None, IceCacheConfig(index="mdci", budget=16, page_size=4, sink=2, window=4)):
        res = generate(model, tok, prompt, config=cfg, max_new_tokens=24, min_new_tokens=24, return_result=True)
        assert res.new_tokens == 24
    for bad in ({"max_new_tokens": 4, "min_new_tokens": 5}, {"max_new_tokens": 0}, {"max_new_tokens": 4, "min_new_tokens": -1}):
        with pytest.raises(ConfigError, match="new_tokens"):
            generate(model, tok, prompt, **bad)


# ------------------------------------------------------------------------------- hybrid models (Gemma-3)
def make_tiny_gemma3(seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, sliding_window=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=32,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_hybrid_gemma3_full_budget_reproduces_sdpa(batch):
    model = make_tiny_gemma3()
    ids, mask = prompts(batch)
    ref_seq, ref_logits, _ = run(model, ids, mask, steps=32)
    cfg = IceCacheConfig(index="sequential", budget=512, sink=4, window=16, dense_layers=())
    seq, logits, cache = run(model, ids, mask, cfg, steps=32)
    assert cache.kind == ["sliding", "sliding", "sparse"] * 2
    assert (logits - ref_logits).abs().max().item() <= 1e-4 and torch.equal(seq, ref_seq)
    st = cache.stats()
    assert st["layers"] == {"sparse": 2, "dense": 0, "sliding": 4}
    # sliding layers hold exactly their window (sliding_window - 1 past tokens), nothing offloaded
    for layer, kind in zip(cache.layers, cache.kind):
        if kind == "sliding":
            assert layer.keys.shape[-2] == 31
    assert cache.device_kv_bytes(("sliding",)) == 4 * batch * 1 * 31 * 32 * 2 * 4
    cache.check_conservation()
    cache.close()


@pytest.mark.model
def test_gemma3_real_model_full_budget_matches_sdpa():
    import icecache

    model, tok = icecache.load_model("gemma-3-270m")
    enc = tok("The history of the lighthouse begins with", return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ref_seq, ref_logits, _ = run(model, ids, mask, steps=24)
    cfg = IceCacheConfig(index="sequential", budget=1024, sink=4, window=8, dense_layers=())
    seq, logits, cache = run(model, ids, mask, cfg, steps=24)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert torch.equal(seq, ref_seq)
    assert cache.stats()["layers"] == {"sparse": 3, "dense": 0, "sliding": 15}
    cache.close()
