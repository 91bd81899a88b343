"""The compute under every layout: the C++ kernels and their loader, the splitmix64 hash, bags of
ids on one block and their pooling, half-row lookups, rounding, row memory. Imports only the
root vocabulary.
"""
