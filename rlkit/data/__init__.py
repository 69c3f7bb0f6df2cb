"""Prompt data: loading, validation, tokenization and the dataset-backed prompt source."""
