"""HTTP service for elmo-service: FastAPI app, micro-batcher, embedding cache.

``uvicorn elmo_api.main:app`` or ``elmo_api.server.run(host, port, model_dir)``. The HTTP
layer never touches the model: routes tokenize, look up the cache and hand
token lists to the :class:`elmo_api.batcher.Batcher`, whose single worker thread is
the only caller of the model: it plans the batches and runs each with
``Embedder.run_batch``.
"""
