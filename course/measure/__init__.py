"""Measuring the engine: timing and threads, costs (the one home of FLOPs, bytes and dtype sizes), roofline,
sweeps, profiles, the latency model, recorded results, figures and the no-widget switches (`display`), and the
bench items behind `kvcourse bench` (`bench`: a registry that other layers add to).

May import: `course.engine`.
"""
