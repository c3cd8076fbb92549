"""The built-in pure-PyTorch rollout engine: `NativeEngine` in `engine.py`.

Layout: loader (HF directory -> spec + tensors), weights (fused layout, HF-name map), vision
(Qwen2-VL / Qwen2.5-VL: vision tower, M-RoPE, per-request images), matmul (fp32 CPU weights
prepacked for oneDNN, F.linear elsewhere), model (the forward), kv_cache, sampling, scheduler
(continuous batching core), streaming (per-request token streams), engine (public API).
Nothing is imported here so that `import polyrl.rollout` stays cheap.
"""
