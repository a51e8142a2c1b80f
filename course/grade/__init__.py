"""Grading, one module per topic: files (atomic writes, the course lock), nbgrader_api (config, assignments,
gradebook, CSV export), submissions (finding and repairing them), sandbox (the sealed bubblewrap runner), harness
(what runs inside it), plain (plain data across its wall), verdicts (the declared checks), cluster (here or on Dask
workers), grader (`kvcourse grade`, the gradebook's only writer), check (`kvcourse check`, Validate), classroom.

May import: every layer below (`engine`, `measure`, `lessons`, `widgets`, `teach`).
"""
