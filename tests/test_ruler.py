"""RULER generator and scorer (`icecache.eval.ruler`): lengths, structure, determinism, chat templates, scores.

Most tests use `WordTokenizer`, a tiny deterministic stand-in (one token per word or punctuation mark, a BOS
it adds by itself, a toy chat template); the ``model`` tests use the embedded SmolLM2 tokenizer.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.eval.ruler import (
    TASK_SPECS,
    TASKS,
    length_tolerance,
    make_sample,
    make_samples,
    score_sample,
    string_match_all,
    string_match_part,
    task_score,
)
from icecache.eval.ruler.aggregation import fwe_min_words, zipf_counts
from icecache.eval.ruler.haystack import (
    NEEDLE_DEPTHS,
    NOISE_UNIT,
    essay_sentences,
    essay_words,
    random_uuid,
    random_word_key,
    word_list,
)
from icecache.eval.ruler.niah import NIAH_TASKS
from icecache.eval.ruler.sample import fit_units, sample_rng


class WordTokenizer:
    """Stand-in tokenizer: one id per word or punctuation mark; ``<s>`` is a BOS it prepends by itself."""

    bos_token = "<s>"
    bos_token_id = 0
    chat_template = "<stand-in>"
    _token = re.compile(r"<s>|\w+|[^\w\s]")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<s>": 0}
        self.words = ["<s>"]

    def _id(self, token: str) -> int:
        if token not in self.vocab:
            self.vocab[token] = len(self.words)
            self.words.append(token)
        return self.vocab[token]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [self._id(t) for t in self._token.findall(text)]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i == self.bos_token_id))

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "<s>" + "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        text += "<|assistant|>\n" if add_generation_prompt else ""
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


class PlainTokenizer(WordTokenizer):
    """The stand-in without a chat template."""

    chat_template = None


TOK = WordTokenizer()
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
LENGTH = 2500  # fits every task with the stand-in tokenizer (cwe needs ~1.6k)


def _sample(task: str, length: int = LENGTH, **kw):
    return make_sample(task, TOK, length, **kw)


def _check_fit(sample, tokenizer) -> None:
    assert sample.total_tokens <= sample.length
    assert sample.length - sample.total_tokens <= length_tolerance(sample.length)
    assert sample.num_tokens == len(tokenizer(sample.prompt)["input_ids"])
    assert sample.prompt.endswith(sample.answer_prefix)


# --------------------------------------------------------------------------------------------- registry


def test_tasks_are_rulers_eleven_synthetic_tasks_in_order():
    assert TASKS == (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
    )  # fmt: skip
    generate = {t: TASK_SPECS[t].tokens_to_generate for t in TASKS}
    assert generate == {**{t: 128 for t in NIAH_TASKS}, "vt": 30, "cwe": 120, "fwe": 50}
    assert {TASK_SPECS[t].metric for t in TASKS} == {"all"}


# --------------------------------------------------------------------------------------------- length


@settings(max_examples=30, deadline=None)
@given(
    task=st.sampled_from(TASKS),
    length=st.integers(2048, 3072),
    seed=st.integers(0, 10**6),
    index=st.integers(0, 3),
    chat=st.booleans(),
)
def test_every_sample_fits_its_length(task, length, seed, index, chat):
    sample = make_sample(task, TOK, length, seed, index, chat_template=chat)
    _check_fit(sample, TOK)
    assert (sample.task, sample.length, sample.seed, sample.index, sample.chat_template) == (
        task, length, seed, index, chat,
    )  # fmt: skip
    for a, b in sample.needle_spans:
        assert 0 <= a < b <= len(sample.prompt) - len(sample.answer_prefix)


def test_length_tolerance_is_two_percent_or_96_tokens():
    assert length_tolerance(1024) == 96
    assert length_tolerance(4096) == 96
    assert length_tolerance(32768) == 655


@settings(max_examples=60, deadline=None)
@given(
    base=st.integers(0, 500),
    per_unit=st.floats(0.1, 100.0),
    jitter=st.integers(0, 3),
    min_units=st.integers(0, 30),
    extra=st.integers(0, 100_000),
    max_units=st.none() | st.integers(30, 5000),
)
def test_fit_units_finds_the_largest_fitting_count(base, per_unit, jitter, min_units, extra, max_units):
    def count(n: int) -> int:
        return base + int(per_unit * n) + (n * 7919 % (jitter + 1))

    budget = count(min_units) + extra
    n = fit_units(count, budget, min_units, max_units)
    assert count(n) <= budget and n >= min_units
    if max_units is None or n < max_units:
        assert count(n + 1) > budget or jitter  # exact when monotone
        assert budget - count(n) < per_unit + jitter + 1  # less than one unit left over


# --------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("task", TASKS)
def test_same_arguments_same_sample_other_index_other_sample(task):
    first = _sample(task, seed=7, index=2)
    assert _sample(task, seed=7, index=2) == first
    other = _sample(task, seed=7, index=3)
    assert other.prompt != first.prompt and other.answers != first.answers
    assert _sample(task, seed=8, index=2).answers != first.answers


def test_any_sample_regenerates_alone():
    batch = make_samples("niah_multikey_1", TOK, LENGTH, 3, seed=5, start=1)
    assert [s.index for s in batch] == [1, 2, 3]
    assert batch[2] == _sample("niah_multikey_1", seed=5, index=3)
    assert sample_rng(5, "vt", 3).random() == sample_rng(5, "vt", 3).random() != sample_rng(5, "vt", 4).random()


# --------------------------------------------------------------------------------------------- chat template


@pytest.mark.parametrize("task", ["niah_single_1", "vt", "fwe"])
def test_prompt_is_task_text_then_answer_prefix_with_and_without_chat_template(task):
    plain = _sample(task)
    assert plain.prompt == plain.context + plain.question + plain.answer_prefix
    chat = _sample(task, chat_template=True)
    task_text = chat.context + chat.question
    wrapped = TOK.apply_chat_template([{"role": "user", "content": task_text}], add_generation_prompt=True, tokenize=False)
    # the template writes <s>, which the tokenizer adds again by itself: the prompt leaves it out
    assert chat.prompt == wrapped[len("<s>") :] + chat.answer_prefix
    assert TOK(chat.prompt)["input_ids"].count(TOK.bos_token_id) == 1
    assert chat.prompt.endswith("<|assistant|>\n" + chat.answer_prefix)
    _check_fit(chat, TOK)
    custom = _sample(task, chat_template=lambda text: f"[INST] {text} [/INST]")
    assert custom.prompt.startswith("[INST] ") and custom.prompt.endswith(" [/INST]" + custom.answer_prefix)


def test_needle_spans_follow_the_chat_template():
    plain, chat = _sample("niah_multivalue"), _sample("niah_multivalue", chat_template=True)
    assert plain.answers == chat.answers
    assert all(NEEDLE_RE.fullmatch(chat.prompt[a:b]) for a, b in chat.needle_spans)
    assert sorted(NEEDLE_RE.fullmatch(chat.prompt[a:b])[3] for a, b in chat.needle_spans) == sorted(chat.answers)


# --------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("task", list(NIAH_TASKS))
def test_niah_needles_keys_and_values(task):
    config = NIAH_TASKS[task]
    sample = _sample(task, index=1)
    needles = NEEDLE_RE.findall(sample.context)
    inserted = [NEEDLE_RE.fullmatch(sample.prompt[a:b]).groups() for a, b in sample.needle_spans]
    assert len(inserted) == config.num_keys * config.num_values
    assert all(kind == config.value_kind for kind, _, _ in needles)
    keys = list(dict.fromkeys(k for _, k, _ in inserted))
    assert len(keys) == config.num_keys
    queried = [k for k in keys if k in sample.question]
    assert len(queried) == config.num_queries
    assert sorted(v for _, k, v in inserted if k in queried) == sorted(sample.answers)
    assert len(sample.answers) == config.num_values * config.num_queries
    for value in sample.answers:  # each wanted value exactly once in the whole prompt
        assert sample.prompt.count(value) == 1
    for key in queried:  # the queried key once among the needles; no other key contains it
        assert [k for _, k, _ in needles].count(key) == config.num_values
        assert not any(key in k for _, k, _ in needles if k != key)
    if config.haystack == "needles":
        assert len(needles) == sample.num_units + 1 and len({k for _, k, _ in needles}) == len(needles)
    else:
        assert len(needles) == len(inserted)
    if config.key_kind == "uuids":
        assert all(uuid.UUID(k).version == 4 for _, k, _ in needles)
    else:
        adjectives, nouns = set(word_list("adjective")), set(word_list("noun"))
        assert all(k.split("-")[0] in adjectives and k.split("-")[1] in nouns for k in keys)
    if config.value_kind == "numbers":
        assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in sample.answers)


def test_niah_templates_are_rulers_singular_and_plural():
    single = _sample("niah_single_2")
    key = NEEDLE_RE.search(single.context)[2]
    assert single.context.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )
    assert single.question == f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    assert single.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    multi = _sample("niah_multivalue")
    key = NEEDLE_RE.search(multi.context)[2]
    assert multi.context.startswith("Some special magic numbers are hidden within the following text.")
    assert multi.question == f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
    assert multi.answer_prefix == f" The special magic numbers for {key} mentioned in the provided text are"
    query = _sample("niah_multiquery").question
    assert re.search(r"for \S+, \S+, \S+, and \S+ mentioned", query)
    assert _sample("niah_single_3").context.startswith("A special magic uuid is hidden")


def test_noise_and_essay_haystacks():
    noise = _sample("niah_single_1")
    lines = noise.context.split("\n")[1:]
    assert lines.count(NOISE_UNIT) == noise.num_units and len(lines) == noise.num_units + 1
    essay = _sample("niah_single_2")
    ((a, b),) = essay.needle_spans
    assert essay.prompt[a - 1] == " " or essay.prompt[a - 1] == "\n"  # between sentences
    assert essay.context.split("\n", 1)[1].replace(essay.prompt[a:b] + " ", "").startswith(" ".join(essay_words()[:5]))


def test_essay_haystack_is_python_docs_prose_with_40_depths():
    words = essay_words()
    assert len(words) > 30_000 and "Graham" not in words
    assert NEEDLE_DEPTHS[0] == 0 and NEEDLE_DEPTHS[-1] == 100 and len(set(NEEDLE_DEPTHS)) == 40
    sentences = essay_sentences(len(words) + 50)  # longer than the text: it repeats
    assert sum(len(s.split()) for s in sentences) == len(words) + 50


def test_vt_chain_resolves_to_the_answers():
    sample = _sample("vt", index=4)
    lines = [sample.prompt[a:b] for a, b in sample.needle_spans]
    value = re.search(r"assigned the value (\d{5}) in the text above\.$", sample.question)[1]
    assert value != "12345" and sample.prompt.count(f"= {value}") == 1
    assert lines[0] == f"VAR {sample.answers[0]} = {value}"
    assert lines[1:] == [f"VAR {b} = VAR {a}" for a, b in zip(sample.answers, sample.answers[1:])]
    assert len(sample.answers) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in sample.answers)
    real = sample.context.split("\n\nMemorize and track")[1]
    assert [ln for ln in real.split("\n") if ln.startswith("VAR ")] == lines  # in order, once each
    assert sample.answer_prefix == (
        " Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned "
        f"the value {value}, they are: "
    )
    example = sample.context.split("\n\nMemorize and track")[0]
    assert example.startswith("Memorize and track the chain(s) of variable assignment hidden in the following text.")
    assert re.search(r"assigned the value 12345, they are: [A-Z]{3}( [A-Z]{3}){4}$", example)


def test_cwe_counts():
    sample = _sample("cwe", index=2)
    real = sample.context.rsplit("Memorize the ones that appear most often.\n", 1)[1]
    entries = re.findall(r"(\d+)\. (\w+)", real)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert {w: c for w, c in counts.items() if c == 30} == {w: 30 for w in sample.answers}
    assert set(counts.values()) == {30, 3} and len(counts) == 10 + sample.num_units
    assert sorted(sample.prompt[a:b] for a, b in sample.needle_spans) == sorted(sample.answers * 30)
    example = sample.context.split("\n\n")[0]
    assert "Question: What are the 10 most common words in the above list? Answer:" in example
    assert not set(re.findall(r"\d+\. (\w+)", example)) & set(counts)


def test_fwe_ranks():
    sample = _sample("fwe", index=1)
    words = sample.context.split("coded words. ", 1)[1].split(" ")
    counts = Counter(words)
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and tuple(ranked[1:4]) == sample.answers
    assert counts[ranked[3]] > counts[ranked[4]]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    assert len(sample.needle_spans) == sum(counts[w] for w in sample.answers)
    assert sum(zipf_counts(sample.num_units, len(ranked))) <= sample.num_units
    assert fwe_min_words() == 74
    c = zipf_counts(74, 5)
    assert c[1] > c[2] > c[3] > c[4] >= 1


def test_random_keys_and_uuids_are_seeded():
    rng_a, rng_b = sample_rng(1, "t", 0), sample_rng(1, "t", 0)
    assert random_uuid(rng_a) == random_uuid(rng_b)
    assert uuid.UUID(random_uuid(rng_a)).version == 4
    assert re.fullmatch(r"[a-z]+-[a-z]+", random_word_key(rng_a))


# --------------------------------------------------------------------------------------------- errors


def test_errors_name_the_accepted_values():
    with pytest.raises(UnknownNameError, match="niah_single_1.*fwe") as err:
        _sample("niah_single_4")
    assert isinstance(err.value, ValueError)
    with pytest.raises(ConfigError, match="too short for RULER task 'cwe': it needs at least"):
        _sample("cwe", length=1000)
    with pytest.raises(ConfigError, match="too short"):
        _sample("niah_single_1", length=150)
    for bad in (0, -5, True, 4096.0):
        with pytest.raises(ConfigError, match="positive int"):
            _sample("vt", length=bad)
    with pytest.raises(ConfigError, match="index"):
        _sample("vt", index=-1)
    with pytest.raises(ConfigError, match="chat template"):
        make_sample("vt", PlainTokenizer(), LENGTH, chat_template=True)
    with pytest.raises(ConfigError, match="True, False or a callable"):
        _sample("vt", chat_template="chatml")


def test_cwe_longer_than_its_word_list_is_refused():
    with pytest.raises(ConfigError, match="too long for RULER task 'cwe'"):
        _sample("cwe", length=200_000)


# --------------------------------------------------------------------------------------------- scores


def test_string_match_all_by_hand():
    refs = ["1234567", "ABCDE", "apple"]
    assert string_match_all("1234567, abcde and APPLE", refs) == 1.0
    assert string_match_all("  the answer is 1234567  ", refs) == pytest.approx(1 / 3)
    assert string_match_all("Abcde? apples!", refs) == pytest.approx(2 / 3)  # substrings count, as in RULER
    assert string_match_all("", refs) == 0.0
    assert string_match_all("123456", ["1234567"]) == 0.0  # a partial number is not a match
    assert string_match_all("1 2 3 4 5 6 7", ["1234567"]) == 0.0  # only stripping, no normalising


def test_string_match_part_by_hand():
    refs = ["Paris", "the capital of France"]
    assert string_match_part("it is paris.", refs) == 1.0
    assert string_match_part("THE CAPITAL OF FRANCE", refs) == 1.0
    assert string_match_part("London", refs) == 0.0
    assert string_match_part("", refs) == 0.0
    with pytest.raises(ConfigError):
        string_match_part("x", [])
    with pytest.raises(ConfigError):
        string_match_all("x", "one string")


def test_score_sample_and_task_score():
    sample = _sample("niah_multivalue")
    assert score_sample(sample, " " + ", ".join(sample.answers) + ".\n") == 1.0
    assert score_sample(sample, sample.answers[0]) == 0.25
    assert score_sample(sample, "I do not know.") == 0.0
    assert task_score([1.0, 0.25, 0.0, 0.75]) == 50.0
    with pytest.raises(ConfigError):
        task_score([])


# --------------------------------------------------------------------------------------------- real tokenizer


@pytest.mark.model
def test_every_task_fits_4k_with_smollm2(smollm2):
    _, tokenizer = smollm2
    for i, task in enumerate(TASKS):
        sample = make_sample(task, tokenizer, 4096, index=i, chat_template=True)
        _check_fit(sample, tokenizer)
        assert sample.prompt.startswith("system\n")  # <|im_start|> is the BOS the tokenizer adds itself
        assert tokenizer(sample.prompt)["input_ids"][:2] != [tokenizer.bos_token_id] * 2
        assert score_sample(sample, " ".join(sample.answers)) == 1.0


@pytest.mark.model
def test_plain_prompts_fit_4k_with_smollm2(smollm2):
    _, tokenizer = smollm2
    for task in ("niah_single_2", "niah_multikey_3", "cwe", "fwe"):
        _check_fit(make_sample(task, tokenizer, 4096, index=3), tokenizer)
