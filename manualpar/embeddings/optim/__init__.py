"""Sparse update rules (SGD, Adagrad, RowWiseAdagrad, Adam), row clipping, and the fused optimizer
that applies them inside backward.
"""
