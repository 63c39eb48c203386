"""The CPU serving kernels, beside the model and behind one object.

    select.choose_kernel(bilm, device, precision, weights, compile) -> CpuBiLM | TorchBiLM

* ``cpu_bilm.py`` ``CpuBiLM``: a whole BiLM's inference on the CPU in fp32 (or
  with int8 / bf16 weights): the objects below, behind the model's two calls
  (``encode``, ``contextualize``) and a stream's (``stream_state``, ``stream``);
* ``native_rounded.py`` (numba): compact int8 / bf16 weights and their products
  (fp32 accumulation); ``certificate.py``: such a path's error against
  fp32, measured on the model it runs;
* ``calibrate.py``: per machine and model shape, the native biLSTM or the model's
  torch code, whichever measured faster (never slower than plain torch);
* ``bilstm.py``: both directions of a layer per step, on two worker threads;
  ``ScaledLayer``, the pre-scaled weights the native loops read;
* ``native_step.py`` (numba): one sentence's step loop, one for the three weight
  formats (compiled per format), and the batched element-wise cell; ``native_filters.py`` (numba): the character filters by
  table lookup; ``jit.py``: their shared options and on-disk cache;
* ``packed.py``: matmuls with the weight packed once (oneDNN, MKL, int8);
* ``tuning.py``: the crossover constants, with the machine they were measured on
  (``calibrate.py`` keeps another machine from paying for them).

``select.py``: ``TorchBiLM`` (the model itself: any device, dtype, autocast,
compile) and ``choose_kernel``, which the runner (``bilm/runner.py``) calls once. Importing this package loads nothing (``tuning`` is read
before torch loads); ``cpu_bilm``, and numba with it, is imported when chosen.
"""
