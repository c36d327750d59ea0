"""IceCacheConfig validation: a bad value names the field and the allowed range."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache import IceCacheConfig
from icecache.core.errors import ConfigError


def test_defaults_match_the_definitions():
    c = IceCacheConfig(index="sequential")
    assert (c.budget, c.page_size, c.sink, c.window, c.dense_layers, c.reuse_every) == (256, 16, 4, 64, (0, 1), 1)
    assert c.num_threads >= 1


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("budget", -1, r"budget must be in \[0, "),
        ("page_size", 0, r"page_size must be in \[1, 4096\]"),
        ("page_size", 5000, r"page_size must be in \[1, 4096\]"),
        ("sink", -2, r"sink must be in \[0, "),
        ("window", 0, r"window must be in \[1, "),
        ("reuse_every", 0, r"reuse_every must be in \[1, 1024\]"),
        ("threads", -1, r"threads must be in \[0, 1024\]"),
        ("budget", 2.5, r"budget must be an int"),
        ("budget", True, r"budget must be an int"),
        ("index", "", r"index must be a pager name"),
        ("dense_layers", (0, -1), r"dense_layers"),
        ("dense_layers", 2, r"dense_layers"),
        ("index_params", [1], r"index_params must be a dict"),
        ("trace", "yes", r"trace must be a bool"),
        ("gqa", "both", r"gqa must be"),
    ],
)
def test_bad_values_raise_config_error(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        IceCacheConfig(**{"index": "sequential", field: value})
    assert isinstance(info.value, ValueError)  # ConfigError is a ValueError


def test_replace_validates_and_dense_layers_are_normalised():
    c = IceCacheConfig(index="sequential", dense_layers=(3, 1, 1))
    assert c.dense_layers == (1, 3)
    with pytest.raises(ConfigError):
        c.replace(budget=-5)
    assert c.replace(budget=64).budget == 64


@pytest.mark.parametrize("name", ["mdci", "exact", "sequential", "ivf", "hnsw", "pq"])
def test_unknown_pager_parameter_is_a_config_error_naming_the_known_ones(name):
    from icecache.indexes import make_pager

    with pytest.raises(ConfigError, match="no parameter 'bogus'.*record_moves"):
        make_pager(name, head_dim=8, bogus=1)


def test_params_parse():
    from icecache.core.spec import parse_params

    assert parse_params(None) == {}
    assert parse_params("field_of_view=120,page_score=mass,fov_scale=0.01,x=true,y=None") == {
        "field_of_view": 120, "page_score": "mass", "fov_scale": 0.01, "x": True, "y": None}
    assert parse_params("a=1;b=[0,1]") == {"a": 1, "b": [0, 1]}  # ';' separates too; commas inside [...] do not
    for bad in ("oops", "=3", "a b=1"):
        with pytest.raises(ConfigError):
            parse_params(bad)


def test_pager_spec_parse():
    from icecache.core.spec import parse_spec

    assert parse_spec("sequential") == ("sequential", {})
    assert parse_spec("mdci[preset=icecache;field_of_view=30]") == ("mdci", {"preset": "icecache", "field_of_view": 30})
    assert parse_spec("icecache:ivf[nprobe=3]") == ("icecache:ivf", {"nprobe": 3})
    for bad in ("", "mdci[", "a b", "mdci[]", "mdci[x]"):
        with pytest.raises(ConfigError):
            parse_spec(bad)


_NAMES = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)
_VALUES = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(),
                    st.floats(allow_nan=False, allow_infinity=False, width=32),
                    st.from_regex(r"[a-z][a-z_]{0,6}", fullmatch=True).filter(lambda s: s not in ("true", "false", "null", "none")),
                    st.lists(st.integers(0, 99), max_size=3))


@given(name=_NAMES, params=st.dictionaries(st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True), _VALUES, max_size=4))
@settings(max_examples=200, deadline=None)
def test_spec_round_trips(name, params):
    """`format_spec` writes what `parse_spec` reads back, for every value kind a pager parameter takes."""
    from icecache.core.spec import format_spec, parse_spec

    assert parse_spec(format_spec(name, params)) == (name, params)


def test_config_index_takes_a_spec():
    """Any pager name the runtime reports (``stats()["index"]``) is a valid ``IceCacheConfig.index``."""
    cfg = IceCacheConfig(index="mdci[search=exhaustive]", index_params={"field_of_view": 30})
    assert (cfg.index, cfg.index_params) == ("mdci", {"search": "exhaustive", "field_of_view": 30})
    with pytest.raises(ConfigError, match="disagree on search"):
        IceCacheConfig(index="mdci[search=exhaustive]", index_params={"search": "tree"})


def test_insert_mode_is_checked():
    from icecache.core.config import INSERT_MODES

    assert IceCacheConfig().inserts == "auto" and set(INSERT_MODES) == {"auto", "background", "inline"}
    with pytest.raises(ConfigError, match="IceCacheConfig.inserts must be one of"):
        IceCacheConfig(inserts="later")
