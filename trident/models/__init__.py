"""Model and tokenizer loading, and the factory of small local checkpoints."""
