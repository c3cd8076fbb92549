"""The `polyrl` command line: train, env, doctor, serve, bench, plot."""
