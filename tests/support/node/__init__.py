"""A node agent for tests: runs the Pods that a real kube-scheduler binds to its Node as local
processes, each pod in a network namespace of its own, the way a kubelet would
(docs/local-cluster.md). kvmesh_testing.cluster starts it with the control plane."""
