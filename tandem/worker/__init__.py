"""The worker side of a step: the model runner (flatten batch -> forward -> sample) and CPU setup."""
