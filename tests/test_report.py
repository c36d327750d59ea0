"""`icecache.core.report`: the one token-count parser, CSV writing and Markdown tables; `icecache.core.texts`."""

from __future__ import annotations

import csv
import math
import sys

import pytest

from icecache.core.errors import ConfigError
from icecache.core.report import md_table, write_csv
from icecache.core.spec import parse_tokens


def test_parse_tokens_reads_every_form_once():
    assert parse_tokens("36k") == 36_000 and parse_tokens("1m") == 1_000_000 and parse_tokens("4096") == 4096
    assert parse_tokens("1.5k") == 1500 and parse_tokens(" 4K ") == 4000 and parse_tokens(8192) == 8192
    for bad in ("lots", "", "k", "nank", "inf"):
        with pytest.raises(ConfigError, match="token count"):
            parse_tokens(bad)


def test_eval_parse_length_is_the_same_parser():
    from icecache.eval.runner import parse_length

    for text in ("4k", "8192", "1.5k", "36K"):
        assert parse_length(text) == parse_tokens(text)


def test_write_csv_takes_the_path_first(tmp_path):
    rows = [{"a": 1, "b": 0.123456789}, {"a": 2, "c": "x"}]
    p = write_csv(tmp_path / "sub" / "t.csv", rows)
    back = list(csv.DictReader(p.open()))
    assert list(back[0]) == ["a", "b", "c"] and back[0]["b"] == "0.123456789" and back[1]["c"] == "x"
    write_csv(p, rows, float_format=".3g")
    assert list(csv.DictReader(p.open()))[0]["b"] == "0.123"


def test_md_table_formats_floats_and_nan():
    text = md_table(["m", "x"], [["a", 1.23456], ["b", math.nan], ["c", 123456.7]])
    assert text.splitlines() == ["| m | x |", "|---|---|", "| a | 1.235 |", "| b | - |", "| c | 123457 |"]


def test_leaf_modules_import_no_torch():
    """report and texts import the standard library and `icecache.core.errors` only."""
    import ast
    import importlib.util

    for name in ("report", "texts"):
        tree = ast.parse(open(importlib.util.find_spec(f"icecache.core.{name}").origin).read())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert all(m.split(".")[0] in sys.stdlib_module_names or m == "icecache.core.errors" for m in mods), mods


def test_long_text_ids_continue_real_text():
    from icecache.core.texts import long_text_ids, real_text

    class Chars:  # a tokenizer with one id per character, a special token first
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}

    n = len(real_text()) + 2  # one more than the documentation gives (with its special token)
    ids = long_text_ids(Chars(), n)
    assert ids[0] == 0 and ids[1 : n - 1] == [ord(c) for c in real_text()] and len(ids) > n + 1000
    assert ids[n - 1 : n + 1] == [ord("\n"), ord("\n")]
    assert long_text_ids(Chars(), 10) == [0] + [ord(c) for c in real_text()]


def test_stdlib_text_is_the_sources_in_name_order_and_a_second_corpus():
    from icecache.core.texts import real_text, stdlib_sources, stdlib_text_ids

    class Chars:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}

    sources = list(stdlib_sources())
    first = sources[0] + "\n\n"
    ids = stdlib_text_ids(Chars(), len(first) + 2)  # needs the first file and part of the second
    assert ids[0] == 0 and ids[1 : 1 + len(first)] == [ord(c) for c in first]
    assert len(ids) == 1 + len(first) + len(sources[1]) + 2
    assert "".join(map(chr, ids[1:200])) not in real_text()  # code, not the documentation's prose
