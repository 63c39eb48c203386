"""The serving kernels' tuning constants, in one place.

Measured on the project's machine: 2 cores of an AMD EPYC (AVX-512 with bf16,
32 MB L3), PyTorch 2.13 CPU with MKL and oneDNN, 2 torch threads. Each constant is a crossover
point on that machine; the measurements behind them are in
``docs/bench-embedder.md`` ("Where the constants come from"). On another CPU
they may be off, never wrong: every setting computes the same function. Where
they are off enough that the native biLSTM loses to the model's own torch code,
``kernels/calibrate.py`` measures both once per machine and model shape and routes
each regime (a sentence alone, a batch) to the faster: no cell slower than plain torch.

Imports nothing: ``elmo_service.process`` reads :data:`OMP_SPINCOUNT` before torch loads.
"""

from __future__ import annotations

# -- threads ---------------------------------------------------------------
# libgomp's spin count for an idle OpenMP thread where a model runs on the process's
# own thread (serving, library use): brief, so idle threads give the cores back soon
OMP_SPINCOUNT = "30000"

# -- the batched biLSTM (kernels/bilstm.py) --------------------------------
# at this many rows and more, the two directions run on two worker threads
SPLIT_MIN_ROWS = 2
# the first layer's input matmul runs on the distinct tokens when they are at most
# this share of the real rows (below, the gather costs less than the rows it saves)
DISTINCT_AT_MOST = 0.75

# -- the character CNN (kernels/cpu_bilm.py) --------------------------------
# from this many tokens the native filter lookup splits them over the two workers
NATIVE_SPLIT_MIN_TOKENS = 32

# -- packed matmuls (kernels/packed.py) -------------------------------------
# weights="int8": the character CNN's highway matmuls run int8 (fbgemm) only where it pays:
# smaller weights stay cache-resident, and the quantized kernel has a fixed cost per call
# (the biLSTM's matrices are all rounded: kernels/native_rounded.py)
INT8_MIN_ELEMENTS = 1 << 20
# below this, and for tall matrices, MKL's per-call packing is cheap and its kernel faster
ONEDNN_MIN_ELEMENTS = 1 << 20
