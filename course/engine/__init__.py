"""The engine: everything that turns a prompt into tokens.

Config and presets, the device, GGUF reading (weights and tokenizer), the from-scratch model, the KV caches
(contiguous, INT8), sampling, the one decode loop (`generate`), streaming, the compiled step (`fast`), prefix
reuse, speculative decoding and beam search.

May import: nothing else of `course` (it is the bottom layer) except `course.paths`.
"""
