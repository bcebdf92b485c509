"""Federated learning's contracts: the federation spec, the state frames, the digits data.

What the federation service, the coordinator's federated jobs and the CLI share. The
engine (grouping, aggregation, strategies, the server's state machine, the simulator)
lives with the federation service in `services.federation`.
"""
