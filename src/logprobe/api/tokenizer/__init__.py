"""POST /tokenize and /detokenize: their bodies (`protocol`)."""
