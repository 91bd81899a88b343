"""Builders that wrap parts of a model: ddp, fsdp, zero optimizer (one family per file)."""
