"""The CPU serving kernels, beside the model and behind one object.

    select.choose_kernel(bilm, device, precision, weights, compile) -> CpuBiLM | TorchBiLM

* ``cpu_bilm.py`` ``CpuBiLM``: a whole BiLM's inference on the CPU in fp32 (or
  with int8 weights): the objects below, behind the model's two calls
  (``encode``, ``contextualize``);
* ``bilstm.py``: both directions of a layer per step, on two worker threads;
  ``ScaledLayer``, the pre-scaled weights the native loops read;
* ``native_step.py`` (numba): one sentence's step loop and the batched
  element-wise cell; ``native_filters.py`` (numba): the character filters by
  table lookup; ``jit.py``: their shared options and on-disk cache;
* ``packed.py``: matmuls with the weight packed once (oneDNN, MKL, int8);
* ``tuning.py``: the crossover constants, with the machine they were measured on.

``select.py``: ``TorchBiLM`` (the model itself: any device, dtype, autocast,
compile) and ``choose_kernel``, which the :class:`~elmo_service.embedder.Embedder`
calls once, at load. Importing this package loads nothing (``tuning`` is read
before torch loads); ``cpu_bilm``, and numba with it, is imported when chosen.
"""
