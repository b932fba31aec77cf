"""Training the small bundled models: corpus, tokenizer, training loop."""
