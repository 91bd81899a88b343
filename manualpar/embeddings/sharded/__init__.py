"""shard_embeddings and what it builds: the sharded bag and sequence collections, their checkpoint
hooks, the sharded managed-collision remapper.
"""
