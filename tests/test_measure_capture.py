"""The one Q/K capture (`icecache.measure.capture`): what it records is the model's own attention input, the
forward pass is unchanged, and every user (benchmark, calibration, the evaluation harness) goes through it."""

from __future__ import annotations

import threading

import torch

from icecache.measure.capture import CAPTURE_NAME, capture_kv, capture_qk, recording


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_captured_keys_and_queries_are_the_models(tiny_llama):
    ids = _ids(24)
    q, k = capture_qk(tiny_llama, ids)
    assert q.shape == (4, 8, 24, 16) and k.shape == (4, 2, 24, 16)
    with torch.inference_mode():
        out = tiny_llama(input_ids=ids, use_cache=True)
    assert torch.allclose(k[1], out.past_key_values.layers[1].keys[0].float())
    # the captured post-RoPE queries reproduce the model's attention scores: causal softmax of q.k rows sums to 1
    att = torch.softmax((q[0, 0] @ k[0, 0].T).masked_fill(torch.ones(24, 24).triu(1).bool(), float("-inf")), -1)
    assert torch.allclose(att.sum(-1), torch.ones(24))


def test_capture_kv_records_the_layers_asked_and_leaves_the_model_as_it_was(tiny_llama):
    ids = _ids(40, 1)
    impl = tiny_llama.config._attn_implementation
    cap = capture_kv(tiny_llama, ids, layers=[1], last_queries=5, position_offset=100)
    assert tiny_llama.config._attn_implementation == impl and tiny_llama.config.num_hidden_layers == 4
    assert set(cap.keys) == set(cap.values) == set(cap.queries) == {1}
    assert cap.keys[1].shape == (2, 40, 16) and cap.queries[1].shape == (8, 5, 16) and cap.num_tokens == 40
    full = capture_kv(tiny_llama, ids, last_queries=40, position_offset=100, keep_cache=True)
    assert torch.equal(full.queries[1][:, -5:], cap.queries[1]) and torch.equal(full.keys[1], cap.keys[1])
    assert torch.equal(full.past_key_values.layers[3].keys[0], full.keys[3])
    q, _ = capture_qk(tiny_llama, ids)  # positions from 0: other rotations than at offset 100
    assert not torch.allclose(q[1, :, -5:], cap.queries[1])


def test_the_harness_observation_queries_come_from_the_same_capture(tiny_llama):
    from icecache.eval.harness import run_prefill

    ids = _ids(30, 2)
    pre = run_prefill(tiny_llama, ids, obs_window=7)
    q, _ = capture_qk(tiny_llama, ids)
    assert sorted(pre.obs_queries) == [0, 1, 2, 3]
    for layer, obs in pre.obs_queries.items():
        assert obs.shape == (8, 7, 16) and torch.allclose(obs, q[layer, :, -7:])
    with torch.inference_mode():
        ref = tiny_llama(ids).logits[0, -1]
    assert torch.allclose(pre.last_logits, ref, atol=1e-5)


def test_recording_is_per_thread_and_the_function_registered_once(tiny_llama):
    from transformers import AttentionInterface

    fn = AttentionInterface._global_mapping[CAPTURE_NAME]
    seen: dict[str, int] = {}

    def other_thread() -> None:  # a forward in another thread while this one records: nothing of it lands here
        with torch.inference_mode():
            tiny_llama(_ids(9, 3))
        seen["done"] = 1

    with recording(tiny_llama, last_queries=None, values=False) as cap, torch.inference_mode():
        t = threading.Thread(target=other_thread)
        tiny_llama(_ids(12, 4))
        t.start()
        t.join()
    assert seen == {"done": 1} and {v.shape[1] for v in cap.queries.values()} == {12}
    capture_kv(tiny_llama, _ids(8))
    assert AttentionInterface._global_mapping[CAPTURE_NAME] is fn  # wrappers other libraries put around it survive
