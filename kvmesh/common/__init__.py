"""Contracts shared by engine, sidecar, router and operator.

Nothing in this package may import torch or kopf: the router and the operator
import it without either installed.
"""
