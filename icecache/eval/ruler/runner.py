"""Run RULER over methods x budgets from one dense prefill per sample, resumably.

Every finished (task, length, sample, method, budget) is appended as one JSON line to
``<out>/predictions.jsonl``; a re-run with the same ``--out`` skips what is there. ``<out>/run.json`` holds
the settings the predictions depend on (model, seed, the shared `IceCacheConfig`, chat template); a re-run
with other settings is refused instead of mixing two runs in one table. Samples are visited index-major
(sample 0 of every task and length, then sample 1, ...), so a run stopped early still has a balanced table.

Each sample is prefilled once (`run_prefill`, dense, which also keeps SnapKV's observation queries) and every
method's cache is built from that prefill (`Method.cache` -> `IceCache.load_prefill`); the result is identical
to prefilling through the method (tests/test_eval.py checks it token for token).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError

#: Fields of a prediction record that identify one unit of work.
UNIT_KEYS = ("task", "length", "index", "method", "budget")


@dataclass
class RulerSpec:
    """What to run.

    ``lengths`` are target lengths in tokens (prompt + tokens to generate, RULER's definition);
    ``samples`` per (task, length); ``methods`` as `icecache.eval.methods.get_method` names, plus
    ``kvpress:<press>`` rows run through kvpress (`icecache.eval.ruler.peers`), every press of a sample from one
    prefill of its context (``kvpress_prefill_seconds``, outside each row's ``seconds``).
    """

    model: str
    tasks: list[str]
    lengths: list[int]
    samples: int
    methods: list[str]
    budgets: list[int]
    seed: int = 42
    config: IceCacheConfig = field(default_factory=IceCacheConfig)
    chat_template: bool | None = None  # None: the model's chat template when its tokenizer has one

    def signature(self) -> dict[str, Any]:
        """The settings a prediction depends on (not which units are asked for)."""
        cfg = self.config.to_dict()
        cfg.pop("budget")  # varies per unit
        cfg.pop("threads")  # results do not depend on threads ...
        cfg.pop("inserts")  # ... nor on where decode inserts run (tests/test_runtime_workers.py)
        if cfg.get("top_p") is None:  # off: runs made before the option existed resume as the same run
            cfg.pop("top_p", None)
        if cfg.get("insert_every") == 1:  # likewise
            cfg.pop("insert_every", None)
        return {"model": self.model, "seed": self.seed, "config": cfg, "chat_template": self.chat_template}


def unit_key(record: dict[str, Any]) -> tuple:
    return tuple(str(record[k]) for k in UNIT_KEYS)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (none when it is missing); a line cut by a crash mid-write is skipped, so its unit
    runs again."""
    if not path.exists():
        return []
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class PredictionLog:
    """``predictions.jsonl`` plus ``run.json`` under one directory: append-only, resumable. Opening one checks
    that an existing ``run.json`` holds the same settings; ``run.json`` is written with the first record."""

    def __init__(self, out_dir: str | Path, signature: dict[str, Any]) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / "predictions.jsonl"
        run_file = self.dir / "run.json"
        if run_file.exists():
            previous = json.loads(run_file.read_text())
            if previous != json.loads(json.dumps(signature)):
                changed = sorted(k for k in set(previous) | set(signature) if previous.get(k) != json.loads(json.dumps(signature.get(k))))
                raise ConfigError(
                    f"{run_file} belongs to a run with other settings ({', '.join(changed)} differ); "
                    "use another --out or the same settings"
                )
        self.signature = signature
        self._run_written = run_file.exists()
        self.records = self._read()
        self.done = {unit_key(r) for r in self.records}

    def _read(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def append(self, record: dict[str, Any]) -> None:
        if not self._run_written:  # written with the first record, so a refused or failed start leaves nothing
            run_file = self.dir / "run.json"
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = run_file.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.signature, indent=1) + "\n")
            os.replace(tmp, run_file)
            self._run_written = True
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
        self.done.add(unit_key(record))


def method_budgets(spec: RulerSpec) -> list[tuple[str, int | None]]:
    """``(method, budget)`` pairs in run order; methods without a budget (``full``) once, with None."""
    from icecache.eval.methods import get_method

    pairs: list[tuple[str, int | None]] = []
    for name in spec.methods:
        if name.startswith("kvpress:") or get_method(name).uses_budget:
            pairs.extend((name, b) for b in spec.budgets)
        else:
            pairs.append((name, None))
    return pairs


def units(spec: RulerSpec) -> Iterator[tuple[int, int, str]]:
    """``(index, length, task)`` in run order: sample-major, so partial runs stay balanced."""
    for index in range(spec.samples):
        for length in spec.lengths:
            for task in spec.tasks:
                yield index, length, task


def _budget_label(budget: int | None) -> str:
    return "-" if budget is None else str(budget)


def pending_units(spec: RulerSpec, done: set[tuple], shard: tuple[int, int] = (0, 1)) -> list[tuple[int, int, str, list]]:
    """``(index, length, task, [(method, budget), ...])`` still to run, in run order (see `units`)."""
    pairs = method_budgets(spec)
    out = []
    for index, length, task in units(spec):
        if index % shard[1] != shard[0]:
            continue
        left = [(m, b) for m, b in pairs
                if unit_key({"task": task, "length": length, "index": index, "method": m, "budget": _budget_label(b)}) not in done]
        if left:
            out.append((index, length, task, left))
    return out


def run_sample(
    model: Any, tokenizer: Any, spec: RulerSpec, index: int, length: int, task: str, pairs: list[tuple[str, int | None]],
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Generate one sample, prefill it once, answer it with every ``(method, budget)`` of ``pairs``.

    Returns one record per pair (``on_record`` sees each as soon as it is scored); kvpress rows run last, from
    their own prefill (`peers`). ``done_after_seconds`` is when a row finished, counted from the end of the shared
    dense prefill.
    """
    from icecache.eval.harness import run_prefill
    from icecache.eval.ruler import make_sample

    chat = spec.chat_template if spec.chat_template is not None else bool(getattr(tokenizer, "chat_template", None))
    t0 = time.perf_counter()
    sample = make_sample(task, tokenizer, length, seed=spec.seed, index=index, chat_template=chat)
    input_ids = tokenizer(sample.prompt, return_tensors="pt")["input_ids"]
    sample_s = time.perf_counter() - t0
    own = [(m, b) for m, b in pairs if not m.startswith("kvpress:")]
    presses = [(m, b) for m, b in pairs if m.startswith("kvpress:")]
    records: list[dict[str, Any]] = []
    base = {"task": task, "length": length, "index": index, "answers": list(sample.answers),
            "prompt_tokens": int(input_ids.shape[1]), "sample_seconds": sample_s}

    def emit(record: dict[str, Any]) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    if own:
        t1 = time.perf_counter()
        prefill = run_prefill(model, input_ids, obs_window=spec.config.window)
        ready = time.perf_counter()
        base["prefill_seconds"] = ready - t1

        for method, budget in own:
            fields = answer_method(model, tokenizer, spec, sample, prefill, method, budget)
            emit({**base, **fields, "done_after_seconds": time.perf_counter() - ready})
    if presses:
        from icecache.eval.ruler.peers import prefill_context, press_answer
        from icecache.eval.ruler.score import score_sample

        press_context = prefill_context(model, tokenizer, sample)  # one context prefill for every press row
        for method, budget in presses:
            t1 = time.perf_counter()
            prediction, extra = press_answer(model, tokenizer, press_context, sample, method.split(":", 1)[1], budget,
                                             spec.config)
            emit({**base, "prefill_seconds": base.get("prefill_seconds", 0.0), "method": method,
                  "budget": _budget_label(budget), "score": score_sample(sample, prediction), "prediction": prediction,
                  "new_tokens": len(tokenizer(prediction, add_special_tokens=False)["input_ids"]),
                  "seconds": time.perf_counter() - t1, **extra})
    return records


def answer_method(
    model: Any, tokenizer: Any, spec: RulerSpec, sample: Any, prefill: Any, method: str, budget: int | None,
) -> dict[str, Any]:
    """Build ``method``'s cache from the dense ``prefill`` at ``budget`` and answer ``sample`` greedily (stopping
    once every reference is in the output); returns the record's method fields."""
    from icecache.eval.harness import decode_greedy
    from icecache.eval.methods import get_method
    from icecache.eval.ruler.score import score_sample
    from icecache.runtime.cache import IceCache

    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()

    def settled(tokens: list[int]) -> bool:
        """Every reference is already in the output: more tokens cannot change RULER's score (a substring
        found stays found), so decoding stops (recorded as ``settled``)."""
        return score_sample(sample, tokenizer.decode(tokens, skip_special_tokens=True)) >= 1.0

    t1 = time.perf_counter()
    cfg = spec.config.replace(budget=budget if budget is not None else spec.config.budget)
    cache = get_method(method).cache(model, prefill, cfg)
    if isinstance(cache, IceCache):
        cache.workers.wait_all()  # the index builds, timed apart from the decode
    extra: dict[str, Any] = {"build_seconds": time.perf_counter() - t1}
    try:
        tokens = decode_greedy(model, cache, prefill.last_logits, sample.tokens_to_generate, stop_ids,
                               stop_when=settled)
        if isinstance(cache, IceCache) and cfg.top_p is not None:
            extra["tokens_per_selection"] = cache.stats()["tokens_per_selection"]
        if isinstance(cache, IceCache) and cfg.index == "auto":  # which select auto chose for this prompt
            extra["auto_choice"] = cache.stats()["index"]
    finally:
        if isinstance(cache, IceCache):
            cache.close()
    prediction = tokenizer.decode(tokens, skip_special_tokens=True)
    extra["settled"] = bool(len(tokens) < sample.tokens_to_generate and tokens[-1] not in stop_ids)
    return {"method": method, "budget": _budget_label(budget), "score": score_sample(sample, prediction),
            "prediction": prediction, "new_tokens": len(tokens), "seconds": time.perf_counter() - t1, **extra}


def run_ruler(
    model: Any, tokenizer: Any, spec: RulerSpec, out_dir: str | Path, *, progress: bool = True,
) -> list[dict[str, Any]]:
    """Run what ``out_dir`` does not hold yet, appending each record as it finishes; return every record of
    the run (old and new)."""
    from tqdm.auto import tqdm

    from icecache.eval.harness import check_fits_context

    check_fits_context(model, spec.lengths)
    log = PredictionLog(out_dir, spec.signature())
    todo = pending_units(spec, log.done)
    bar = tqdm(total=sum(len(p) for *_, p in todo), desc=f"ruler {spec.model}", unit="run", disable=not progress,
               smoothing=0.05)

    def finished(record: dict[str, Any]) -> None:
        log.append(record)
        bar.update(1)

    for index, length, task, pairs in todo:
        bar.set_postfix_str(f"{task} {length} #{index}")
        run_sample(model, tokenizer, spec, index, length, task, pairs, on_record=finished)
    bar.close()
    return log.records


def spec_to_dict(spec: RulerSpec) -> dict[str, Any]:
    out = asdict(spec)
    out["config"] = spec.config.to_dict()
    return out


def spec_from_dict(data: dict[str, Any]) -> RulerSpec:
    data = dict(data)
    data["config"] = IceCacheConfig(**{**data["config"], "dense_layers": tuple(data["config"]["dense_layers"])})
    return RulerSpec(**data)
