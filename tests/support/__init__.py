"""Test and benchmark support, installed as the dev-only distribution kvmesh-testing (package kvmesh_testing)."""
