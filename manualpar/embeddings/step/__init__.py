"""One sharded step: routing, the exchanges, lookups and the fused update, replica combining,
frozen tables, table meshes.
"""
