"""Speculative decoding: proposers (ngram, draft model, PARD, self-quant) and verification (rejection).

Importing the package is cheap (no torch); the proposers and the verifier import torch themselves.
"""
