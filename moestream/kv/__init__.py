"""The paged KV pool: blocks, per-sequence block tables, prefix sharing, windows, recurrent states."""
