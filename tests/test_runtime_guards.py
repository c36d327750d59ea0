"""The face a newcomer meets (issue 21, section 7): prompt conventions, bad inputs, context guards, reuse.

Each test pins one behaviour that used to surprise: a bad input gets a one-line icecache error, a completion
prompt is continued as written, a short prompt allocates only what it holds.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_tiny_llama

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.core.errors import CacheMisuseError, ConfigError, InputError
from icecache.runtime.attention import ATTENTION_NAME, use_attention
from icecache.runtime.generate import generate, uses_chat_template


class ByteTokenizer:
    """A tokenizer stand-in for the tiny random Llama: one token per character (ids 3..127)."""

    pad_token_id = 0

    def __init__(self, chat_template: str | None = "{{ messages }}") -> None:
        self.chat_template = chat_template

    def _ids(self, text: str) -> list[int]:
        return [3 + ord(c) % 125 for c in text]

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        ids = torch.tensor([self._ids(text)], dtype=torch.long).reshape(1, -1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self(text)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(int(i)) for i in ids)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, f"multi-line error: {msg!r}"
    return msg


CFG = IceCacheConfig(index="sequential", budget=16, page_size=4, sink=4, window=16, dense_layers=())


# ------------------------------------------------------------------------------- prompt convention
def test_plain_string_is_raw_text_and_messages_get_the_chat_template(tiny_llama):
    tok = ByteTokenizer()
    text = "The passkey is 27611. The passkey is"
    raw = generate(tiny_llama, tok, text, config=CFG, max_new_tokens=3, return_result=True)
    assert raw.prompt_tokens == len(text) and raw.chat_template is False
    messages = [{"role": "user", "content": text}]
    chat = generate(tiny_llama, tok, messages, config=CFG, max_new_tokens=3, return_result=True)
    assert chat.prompt_tokens == len(f"<user>{text}<assistant>") and chat.chat_template is True
    forced = generate(tiny_llama, tok, text, max_new_tokens=3, chat=True, return_result=True)  # explicit override
    assert forced.prompt_tokens == chat.prompt_tokens and forced.chat_template is True
    full = generate(tiny_llama, tok, text, max_new_tokens=3, return_result=True)
    assert full.chat_template is False


@pytest.mark.parametrize("prompt, expected", [
    ([1, 2, 3], "a list of int"),
    (42, "a int"),
    (None, "a NoneType"),
    ([], "an empty list"),
    ([{"text": "hi"}], "without str 'role'/'content'"),
    (["hello", "world"], "a list of str"),
    (torch.tensor([[5, 6]]), "a Tensor"),
])
@pytest.mark.parametrize("config", [None, CFG], ids=["full", "icecache"])
def test_bad_prompt_type_is_a_one_line_input_error(tiny_llama, prompt, expected, config):
    with pytest.raises(InputError) as exc:
        generate(tiny_llama, ByteTokenizer(), prompt, config=config, max_new_tokens=2)
    msg = _one_line(exc)
    assert "must be a str (raw text) or a list of {'role': ..., 'content': ...} dicts" in msg and expected in msg


def test_chat_override_errors(tiny_llama):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InputError, match="chat=False needs a plain-string prompt") as exc:
        generate(tiny_llama, ByteTokenizer(), messages, max_new_tokens=2, chat=False)
    _one_line(exc)
    with pytest.raises(InputError, match="no chat template") as exc:
        generate(tiny_llama, ByteTokenizer(chat_template=None), messages, max_new_tokens=2)
    _one_line(exc)
    with pytest.raises(InputError, match="chat must be True, False or None"):
        uses_chat_template(ByteTokenizer(), "hi", chat="yes")
    with pytest.raises(InputError, match="empty"):
        generate(tiny_llama, ByteTokenizer(), "", max_new_tokens=2)
    # a string with chat=True and a tokenizer without a template stays raw text (as before)
    assert uses_chat_template(ByteTokenizer(chat_template=None), "hi", chat=True) is False


# ------------------------------------------------------------------------------- context guards
def test_window_or_device_tokens_past_the_context_is_a_config_error(tiny_llama):
    context = tiny_llama.config.max_position_embeddings  # 4096
    with pytest.raises(ConfigError, match=rf"window \(100000\) is larger than the model's context \({context} tokens\)") as exc:
        IceCache(tiny_llama.config, IceCacheConfig(window=100_000))
    _one_line(exc)
    with pytest.raises(ConfigError, match=r"sink \+ budget \+ window \(4 \+ 4000 \+ 100 = 4104\)") as exc:
        IceCache(tiny_llama.config, IceCacheConfig(sink=4, budget=4000, window=100))
    _one_line(exc)
    IceCache(tiny_llama.config, IceCacheConfig(sink=4, budget=4092 - 64, window=64)).close()  # exactly the context: fine


def test_short_prompt_allocates_what_it_holds_not_the_window(tiny_llama):
    """A huge window on a short prompt: buffers sized by prompt + max_new_tokens (`generate`), or by the prompt and
    grown while decoding (plain transformers use), never by the configured window."""
    cfg = IceCacheConfig(index="sequential", budget=64, page_size=4, sink=4, window=4000, dense_layers=())
    res = generate(tiny_llama, ByteTokenizer(), "a" * 31, config=cfg, max_new_tokens=8, min_new_tokens=8, return_result=True)
    per_slot = 4 * 2 * 16 * 2 * 4  # sparse layers x KV heads x head_dim x (K, V) x fp32
    assert res.stats["device_kv_bytes"] == 39 * per_slot  # 31 + 8 window slots, no sink or budget slot yet
    ids = torch.randint(3, 128, (1, 31), generator=torch.Generator().manual_seed(0))
    with use_attention(tiny_llama), IceCache(tiny_llama.config, cfg) as cache, torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
        assert cache.layers[0].slots == 31 and cache.device_kv_bytes() == 31 * per_slot


def test_grown_buffers_decode_exactly_like_full_size_buffers(tiny_llama):
    """Sink, budget and window regions all grow during this decode; it decodes the same tokens as buffers
    allocated at full size (sink + budget + window) up front, and as buffers sized for the whole generation, with
    logits equal up to float32 rounding. (Bit-identical while the CPU attention summed in float64: the native
    kernel sums in float32 in slot order, and grown buffers hold the same slots in another order.)"""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in row 1
    cfg = IceCacheConfig(index="sequential", budget=24, page_size=4, sink=4, window=16, dense_layers=(0,))
    kw = {"max_new_tokens": 40, "do_sample": False, "output_logits": True, "return_dict_in_generate": True, "pad_token_id": 0}
    runs = {}
    for name, hint in (("grown", None), ("exact", 50), ("full", 4 + 24 + 16 + 10)):
        with use_attention(tiny_llama), IceCache(tiny_llama.config, cfg, max_cache_len=hint) as cache, torch.no_grad():
            out = tiny_llama.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
            cache.check_conservation()
            runs[name] = (out.sequences, torch.stack(out.logits), cache.layers[1].slots)
    assert runs["full"][2] == 4 + 24 + 16 and runs["grown"][2] == 4 + 24 + 16
    for name in ("grown", "exact"):
        assert torch.equal(runs[name][0], runs["full"][0]), name
        torch.testing.assert_close(runs[name][1], runs["full"][1], rtol=1e-5, atol=1e-5 * runs["full"][1].abs().max().item())


def test_prompt_plus_new_tokens_past_the_context_warns():
    model = make_tiny_llama(max_position_embeddings=64)
    tok = ByteTokenizer()
    for config in (None, CFG):
        with pytest.warns(UserWarning, match=r"prompt \(60 tokens\) \+ max_new_tokens \(8\) = 68 exceeds the model's context \(64 tokens\)"):
            generate(model, tok, "b" * 60, config=config, max_new_tokens=8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            generate(model, tok, "b" * 56, config=config, max_new_tokens=8)  # exactly the context: no warning


def test_progress_shows_the_prefill_layer_by_layer(tiny_llama, monkeypatch):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total, desc, **kw):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    for config in (None, CFG):
        bars.clear()
        res = generate(tiny_llama, ByteTokenizer(), "c" * 40, config=config, max_new_tokens=5, min_new_tokens=5,
                       progress=True, return_result=True)
        prefill, decode = bars
        assert "prefill" in prefill.desc and prefill.total == prefill.n == 4 and prefill.closed
        assert decode.total == decode.n == res.new_tokens == 5 and decode.closed
    hooks = [len(layer._forward_hooks) for layer in tiny_llama.get_decoder().layers]
    assert hooks == [0, 0, 0, 0]


def test_nothing_offloaded_when_the_sequence_fits_in_sink_and_window(tiny_llama):
    tok = ByteTokenizer()
    short = generate(tiny_llama, tok, "d" * 10, config=CFG, max_new_tokens=4, min_new_tokens=4, return_result=True)
    assert short.stats["offloaded_tokens"] == 0 and short.stats["nothing_offloaded"] is True
    long = generate(tiny_llama, tok, "d" * 100, config=CFG, max_new_tokens=4, min_new_tokens=4, return_result=True)
    # the last new token is never fed back: 100 + 3 positions, minus window and sinks
    assert long.stats["offloaded_tokens"] == 100 + 3 - 16 - 4 and long.stats["nothing_offloaded"] is False


@pytest.mark.model
def test_passkey_completion_prompt_is_answered_as_plain_text(smollm2):
    """A completion prompt ending in an answer prefix is continued as written: wrapped in the chat template it
    used to be answered with "a special key that is used to unlock" instead of the number."""
    from icecache.eval.passkey import make_passkey, passkey_correct

    model, tok = smollm2
    sample = make_passkey(tok, 1000, 0.5, seed=3)
    for config in (None, IceCacheConfig(budget=64, page_size=16, sink=4, window=64)):
        res = generate(model, tok, sample.prompt, config=config, max_new_tokens=8, return_result=True)
        assert res.chat_template is False
        assert passkey_correct(sample, res.text), f"{'full' if config is None else 'icecache'}: {res.text!r} != {sample.answer}"


# ------------------------------------------------------------------------------- reuse
def test_second_generation_into_a_used_cache_is_a_cache_misuse_error(tiny_llama):
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    kw = {"do_sample": False, "pad_token_id": 0}
    with use_attention(tiny_llama), torch.no_grad():
        with IceCache(tiny_llama.config, CFG) as cache:
            tiny_llama.generate(ids, past_key_values=cache, max_new_tokens=3, **kw)
            for prompt in (ids, ids[:, :20], torch.cat([ids, ids], dim=1)):  # same, shorter, longer than the cache
                with pytest.raises(CacheMisuseError, match="create a new IceCache") as exc:
                    tiny_llama.generate(prompt, past_key_values=cache, max_new_tokens=3, **kw)
                _one_line(exc)
        with pytest.raises(CacheMisuseError, match="closed; create a new IceCache") as exc:  # finished and closed
            tiny_llama.generate(ids, past_key_values=cache, max_new_tokens=3, **kw)
        _one_line(exc)


def test_continuing_a_generation_in_its_cache_still_works(tiny_llama):
    """Feeding the sequences back (one new position) continues the same generation: not a misuse."""
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    kw = {"do_sample": False, "pad_token_id": 0}
    with use_attention(tiny_llama), torch.no_grad():
        with IceCache(tiny_llama.config, CFG) as cache:
            first = tiny_llama.generate(ids, past_key_values=cache, max_new_tokens=6, **kw)
            both = tiny_llama.generate(first, past_key_values=cache, max_new_tokens=6, **kw)
        with IceCache(tiny_llama.config, CFG) as cache:
            once = tiny_llama.generate(ids, past_key_values=cache, max_new_tokens=12, **kw)
    assert torch.equal(both, once)


# ------------------------------------------------------------------------------- attention switch, import
def test_use_attention_restores_the_previous_implementation_also_on_error(tiny_llama):
    before = tiny_llama.config._attn_implementation
    with use_attention(tiny_llama):
        assert tiny_llama.config._attn_implementation == ATTENTION_NAME
    assert tiny_llama.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="boom"), use_attention(tiny_llama, "eager"):
        assert tiny_llama.config._attn_implementation == "eager"
        raise RuntimeError("boom")
    assert tiny_llama.config._attn_implementation == before


def test_import_is_lazy_and_every_public_name_resolves():
    import subprocess
    import sys

    code = ("import sys, icecache; heavy = [m for m in ('icecache.runtime.cache', 'icecache.runtime.models', "
            "'icecache.indexes.registry', 'numba') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"import icecache loaded {out}"
    for name in icecache.__all__:
        assert getattr(icecache, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        icecache.nope  # noqa: B018
