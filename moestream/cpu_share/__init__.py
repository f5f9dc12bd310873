"""The CPU computing a share of each streamed layer's misses while the GPU computes the rest:
the mailbox and its fallback (share.py), the native worker (worker.py), the retuning of `auto`
(tuning.py) and the native kernels (kernels.py, C++ in native/), which also compute the CPU
device's own experts (moestream.layers.native_experts)."""
