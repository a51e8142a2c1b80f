"""The engine: everything that turns a prompt into tokens.

Config and presets, the device, GGUF reading (weights and tokenizer), the from-scratch model and the one object
that says where its new tokens sit (`positions.Positions`), the KV caches (contiguous, INT8, paged), sampling
(`Sampler`: tokens and the distribution they came from), the one decode loop (`generate.decode_loop`: generate,
beam search, speculative decoding and prefix reuse run on it), streaming, the compiled step (`fast`) and serving.

May import: nothing else of `course` (it is the bottom layer) except `course.paths`.
"""
