"""Raw ids into rows, unsharded: hashing (HashIds) and managed collisions (ManagedCollisions)."""
