"""Pretraining ELMo-style biLMs: `elmo-pretrain prepare | train | eval | export`.

Modules: text (reading/cleaning/splitting), prepare (corpus folder), data
(memory-mapped shards, length-bucketed batches), softmax (full / sampled /
adaptive), lm (the training-time model), config (YAML -> strict models), train
(the loop, DDP, checkpoints), checkpoint, evaluate (exact perplexity, export).
"""
