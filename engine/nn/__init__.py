"""Layers every network is built from: convolutions, norms, linear maps, timestep embeddings, attention.

`layers.py` holds the building blocks named after diffusers' modules (`ResnetBlock2D`, `Attention`,
`Transformer2DModel`'s pieces) and `attention.py` the backend's best attention path (query blocks on a CPU,
cuDNN's fused attention on a GPU, Pallas flash attention on a TPU); `dit.py` the pieces of the diffusion
transformers (adaLN modulation, q/k RMS norm, the tanh-GELU feed-forward, timestep + pooled-text conditioning);
`onednn.py` (with its C++ handlers, `onednn.cc`, `kept.cc` and `attention.cc`, attention's AMX tile products,
`attention_amx.cc`, and our own vector loops, `cpu_loops.cc`) the
CPU's bf16 matrix products, convolutions (upsampling ones as four phase convolutions) and attention in oneDNN,
GroupNorm + SiLU and GEGLU's gate, which `Linear`, `Conv`, `GroupNorm`, `GEGLU` and `attention.py` call where they
run in bf16 on the CPU (`kernel_build.py` compiles the handlers' library once per source and oneDNN); `int8.py` (with `int8.cc`) int8 compute for linear layers and convolutions whose kernel is
a `QuantizedKernel` (`--quantize w8a8`: oneDNN's u8 x s8 kernels on the CPU); `int8_weights.py` `--quantize int8`'s
weight-only `Int8Kernel`s and their widening inside a program (a layer's only once its input exists); `token_merging.py` ToMe's bipartite merging of an image's tokens around a self-attention.
NHWC throughout.

May import: jax, flax, numpy, and of the engine only `engine.cpus` (the CPUs a build or a thread pool may use):
this is the bottom layer.
"""
