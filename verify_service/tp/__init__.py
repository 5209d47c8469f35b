"""Tensor parallel: rank 0's group (group), the other ranks' loop (worker) and their
command (cli)."""
