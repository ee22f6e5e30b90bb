"""Text: the Kimi tokenizer and the K3 chat format."""
