"""Raw ids into rows: hashing (HashIds), managed collisions (ManagedCollisions) and the one
protocol of a raw-id remap (remap.py), which the sharded remapper implements too."""
