"""Where a block's rows live: in memory, or in a file behind a bounded row cache (the disk tier)."""
