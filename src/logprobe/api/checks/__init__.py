"""The checks every endpoint shares: the request models' base and shared fields (sampling, constraints),
the size caps, token ids against the vocabulary, steering and interventions."""
