"""Data: the tasks a trial trains on (MQAR, induction, classification, text) and their corpora.

Deterministic from a seed; nothing downloaded. Imports only attn's library
(attn.config; attn.nn.hf for a pretrained model's tokenizer), no other stage.
"""
