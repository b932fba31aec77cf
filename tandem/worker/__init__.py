"""A worker: one rank's (or the only process's) share of serving a model. It owns
what is done once, before the first step (the device, loading the weights, sizing
the KV pool from the memory settings, building the speculative proposer) and hands
the steps to its ModelRunner, which owns the forward and sampling."""
