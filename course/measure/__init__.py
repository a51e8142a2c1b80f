"""Measuring the engine: timing and threads, costs (the one home of FLOPs, bytes and dtype sizes), roofline,
sweeps, profiles, the latency model, recorded results.

May import: `course.engine`.
"""
