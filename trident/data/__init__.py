"""Prompt data: built-in verifiable tasks, file loaders and the resumable cursor."""
