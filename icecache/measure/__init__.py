"""Measurements of the real runtime: timings of its components, calibration profiles, Q/K captures, benchmarks.

Modules: `capture` (the one post-RoPE query/key/value capture), `timing` (repeated and interleaved timings),
`components` and `pagers` (the ``measure_*`` timings), `fitting` (raw samples -> the simulator's predictors),
`stack` (library versions and pager code hashes a profile records, and the check against the running stack),
`calibrate` (settings, the calibration run, profile merge; the ``icecache calibrate`` command), `bench_index`
(``icecache bench index``).

Layering: ``cli > eval > measure > (runtime | sim) > indexes > core``: this package may import the runtime,
the indexes and the simulator (whose profile format it writes); the simulator never imports it.
"""
