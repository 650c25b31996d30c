"""Schedule: the request owner."""
