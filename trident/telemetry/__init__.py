"""Seeing a run: the metrics sinks (JSONL, TensorBoard, optional W&B and MLflow), the trace,
per-sample lineage (``samples/*.parquet``) and the report and inspect commands."""
