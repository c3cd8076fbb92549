"""Ray actors that hold models: the policy (actor) and, when KL is used, the reference."""
