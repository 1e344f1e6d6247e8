"""Metrics sinks (JSONL, TensorBoard, optional W&B) and the progress display."""
