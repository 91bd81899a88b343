"""The unsharded collections (bag and sequence), usable on one process, and the tables' initial
values.
"""
