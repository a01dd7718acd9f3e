"""Frontend side: tokenization, detokenization, stop strings, request outputs."""
